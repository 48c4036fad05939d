"""GGUF export: blocks read back with gguf's reference dequantizer equal bitquilt's weights, llama.cpp's layout and
metadata (checked against the packaged model's original GGUF), refusals, the CLI and atomic writes."""

import json
import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from bitquilt.api import quantize, save
from bitquilt.cli import main
from bitquilt.errors import UserError
from bitquilt.export.gguf import (
    FAMILIES,
    check_exportable,
    export_gguf,
    model_fields,
    pre_tokenizer_name,
    rotary_order,
    tensor_plan,
    tokenizer_fields,
    tokenizer_metadata,
    write_gguf,
)
from bitquilt.formats.bitplane import BitplaneFormat
from bitquilt.formats.composite import CompositeFormat
from bitquilt.formats.mxint import MXIntFormat
from bitquilt.formats.uniform import UniformFormat, UniformGrid
from bitquilt.models import registry
from bitquilt.nn.act_quant import ActQuantConfig
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import Recipe
from tests.conftest import attach_kv_quantizers, make_tiny

BLOCK_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str, block_names: dict[str, str] = BLOCK_NAMES, top_names: dict[str, str] = TOP_NAMES) -> str:
    """llama.cpp's tensor name for a Hugging Face one (written out here, independently of the exporter)."""
    if hf_name in top_names:
        return top_names[hf_name]
    _, _, block, *rest = hf_name.split(".")
    return f"blk.{block}.{block_names['.'.join(rest[:-1])]}.{rest[-1]}"


def converter_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """`convert_hf_to_gguf.py`'s LlamaModel.permute of q/k rows (n_head already the kv count for k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_back(path) -> dict[str, tuple[Q, torch.Tensor]]:
    """Every tensor of a GGUF file, dequantized by gguf's reference implementation."""
    return {t.name: (t.tensor_type, torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))))
            for t in gguf.GGUFReader(path).tensors}


def fields_of(path) -> dict:
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


def quantized_tiny(model_type="llama", **recipe):
    model = make_tiny(model_type)
    quantize(model, Recipe("rtn", **recipe), progress=False)
    return model


def uniform(w: torch.Tensor, bits: int, group: int, sym: bool, act_order: bool = False) -> UniformFormat:
    grid = UniformGrid(bits, sym)
    out, n = w.shape
    blocks = w.reshape(out * n // group, group)
    scale, zero = grid.fit(blocks)
    q = grid.quantize(blocks, scale, zero).reshape(out, n)
    g_idx = torch.arange(n) // group if act_order else None
    return UniformFormat.from_codes(q, scale.view(out, -1), zero.view(out, -1), grid, group, g_idx)


@pytest.mark.parametrize("model_type, bits, group, sym, qtype, skip", [
    ("llama", 4, 32, False, Q.Q4_1, ("*.k_proj",)),  # a full-precision k_proj: its F32 rows are permuted too
    ("llama", 4, 64, True, Q.Q4_0, ()),
    ("llama", 8, -1, True, Q.Q8_0, ("*.down_proj",)),
    ("qwen2", 4, 128, False, Q.Q4_1, ()),  # q/k/v biases; NeoX-style RoPE: no permutation
    ("qwen2", 8, 32, True, Q.Q8_0, ()),
])
def test_blocks_read_back_equal_bitquilt_weights(tmp_path, model_type, bits, group, sym, qtype, skip):
    model = quantized_tiny(model_type, w_bits=bits, group_size=group, sym=sym, skip=skip)
    save(model, tmp_path / "q")
    summary = export_gguf(tmp_path / "q", tmp_path / "m.gguf")
    got = read_back(tmp_path / "m.gguf")
    config = model.config
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    expected = {n: p.detach() for n, p in model.named_parameters()}  # tied weights appear once
    formats = {f"{n}.weight": m.fmt for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert set(got) == {gguf_name(n) for n in expected | formats}
    rounded = 0
    for hf_name in expected | formats:
        fmt = formats.get(hf_name)
        want = fmt.dequantize() if fmt is not None else expected[hf_name]
        step, zero = fmt.column_params() if fmt is not None else (torch.ones_like(want), torch.zeros_like(want))
        kind = hf_name.split(".")[-2]
        if model_type == "llama" and kind in heads:
            want, step, zero = (converter_permute(t, heads[kind]) for t in (want, step, zero))
        gguf_type, tensor = got[gguf_name(hf_name)]
        assert gguf_type == (qtype if fmt is not None else Q.F32), hf_name
        diff = (tensor - want).abs()
        minimum = step * zero  # Q4_1 stores −s·z in fp16: exact where fp16 holds it, else rounded to nearest
        exact = minimum.half().float() == minimum if gguf_type == Q.Q4_1 else torch.ones_like(diff, dtype=torch.bool)
        assert diff[exact].max() == 0, hf_name
        assert (diff <= 2**-11 * minimum.abs()).all(), hf_name
        rounded += int((~exact).sum()) // 32
    assert summary.q4_1_rounded_minima == rounded and (rounded > 0) == (qtype == Q.Q4_1)
    assert summary.q4_1_max_shift_steps < 2**-11 * 15
    assert summary.tensors == {qtype.name: len(formats), "F32": len(expected)}


def test_metadata_of_a_tiny_model(tmp_path):
    model = quantized_tiny("llama", w_bits=4, group_size=32, sym=True)
    write_gguf(model, None, tmp_path / "m.gguf", "tiny")
    fields = fields_of(tmp_path / "m.gguf")
    c = model.config
    assert fields["general.architecture"] == "llama" and fields["general.name"] == "tiny"
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0
    sizes = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "rope.dimension_count")
    assert [fields[f"llama.{k}"] for k in sizes] == [512, 128, 2, 256, 4, 2, 32]
    assert fields["llama.rope.freq_base"] == c.rope_parameters["rope_theta"]
    assert fields["llama.attention.layer_norm_rms_epsilon"] == np.float32(c.rms_norm_eps)
    assert fields["tokenizer.ggml.model"] == "none"  # no tokenizer saved: llama.cpp's no-vocabulary model


def test_rotary_order_is_the_converters_permutation():
    w = torch.arange(24 * 3).view(24, 3)
    for heads in (1, 2, 3, 6):
        assert torch.equal(w[rotary_order(24, heads)], converter_permute(w, heads))


@pytest.fixture(scope="module")
def original_smollm():
    """The packaged smollm2-135m's original GGUF: its reader and its fields."""
    path = registry.model_dir("smollm2-135m") / registry.MODELS["smollm2-135m"].file
    reader = gguf.GGUFReader(path)
    return path, reader, {k: f.contents() for k, f in reader.fields.items()}


def test_layout_and_metadata_match_the_original_gguf(smollm, original_smollm):
    model, tokenizer = smollm
    path, reader, original = original_smollm
    family = check_exportable(model)
    plan = {name: value for name, value, _ in tensor_plan(model, family)}
    shapes = {name: (v.out_features, v.in_features) if isinstance(v, UniformFormat) else tuple(v.shape)
              for name, v in plan.items()}
    assert shapes == {t.name: tuple(reversed([int(n) for n in t.shape])) for t in reader.tensors}
    ours = model_fields(model.config, family)
    assert ours.keys() <= original.keys()
    assert {k: v for k, (v, _, _) in ours.items()} == {k: original[k] for k in ours}
    fields, source = tokenizer_metadata(model.config, tokenizer, None)
    assert source == str(path)  # the packaged model's GGUF supplies the tokenizer
    assert {k: v for k, (v, _, _) in fields.items()} == {
        k: v for k, v in original.items() if k.startswith(("tokenizer.", "general.")) and k not in (
            "general.architecture", "general.file_type", "general.quantization_version")}


def test_a_tokenizer_gguf_of_another_model_is_refused(tmp_path):
    other = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(other, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(10)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = make_tiny("llama").config  # 320 tokens
    with pytest.raises(UserError, match="does not have the saved model's vocabulary"):
        tokenizer_metadata(config, None, other)
    with pytest.raises(UserError, match="is not a file"):
        tokenizer_metadata(config, None, tmp_path / "missing.gguf")
    (tmp_path / "text.gguf").write_text("not a GGUF file")
    with pytest.raises(UserError, match="is not a readable GGUF file"):
        tokenizer_metadata(config, None, tmp_path / "text.gguf")


def test_rows_follow_llama_cpps_rotary_layout(smollm, original_smollm):
    """transformers un-permuted the original GGUF's q/k blocks on loading: permuting them back reproduces them."""
    model, _ = smollm
    tensors = {t.name: t for t in original_smollm[1].tensors}
    attn = model.model.layers[0].self_attn
    for name, w, heads in (("blk.0.attn_q.weight", attn.q_proj.weight, model.config.num_attention_heads),
                           ("blk.0.attn_k.weight", attn.k_proj.weight, model.config.num_key_value_heads)):
        t = tensors[name]
        assert torch.equal(torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)),
                           w.detach()[rotary_order(w.shape[0], heads)])


def test_tokenizer_built_from_the_saved_tokenizer_matches_the_original(smollm, original_smollm):
    model, tokenizer = smollm
    original = original_smollm[2]
    built = tokenizer_fields(tokenizer, model.config.vocab_size)
    for key, (value, _, _) in built.items():
        if key != "tokenizer.ggml.pre":
            assert value == original[key], key
    # the saved tokenizer splits like GPT-2 (converting the GGUF lost SmolLM's digit splitting), and says so
    assert built["tokenizer.ggml.pre"][0] == "gpt-2" and original["tokenizer.ggml.pre"] == "smollm"


@pytest.mark.slow
def test_qwen2_tokenizer_built_from_the_saved_tokenizer_matches_the_original():
    from transformers import AutoTokenizer

    if not registry.is_fetched("qwen2.5-0.5b"):
        pytest.skip("qwen2.5-0.5b is not fetched")
    folder = registry.model_dir("qwen2.5-0.5b")
    original = fields_of(folder / registry.MODELS["qwen2.5-0.5b"].file)
    built = tokenizer_fields(AutoTokenizer.from_pretrained(folder), 151936)
    assert {k: v for k, (v, _, _) in built.items()} == {k: original[k] for k in built}


def test_pre_tokenizer_names():
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert pre_tokenizer_name(byte_level) == "gpt-2"
    assert pre_tokenizer_name({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, byte_level]}) == "smollm"
    assert pre_tokenizer_name({"type": "Whitespace"}) is None and pre_tokenizer_name(None) is None


def refused_formats() -> list[tuple[str, object, str]]:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    u = uniform(w, 4, 32, False)
    return [
        ("3-bit", uniform(w, 3, 32, False), "no block type for 3-bit asymmetric grids"),
        ("8-bit asym", uniform(w, 8, 32, False), "no block type for 8-bit asymmetric grids"),
        ("act-order", uniform(w, 4, 32, True, act_order=True), "act-order"),
        ("group 48", uniform(w, 4, 48, True), "groups of 48 columns"),
        ("bitplane", BitplaneFormat.from_uniform(u), "no bitplane format"),
        ("mxint", MXIntFormat.quantize(w, [4], [96]), "no mxint format"),
        ("composite", CompositeFormat({"base": u}), "no composite format"),
    ]


@pytest.mark.parametrize("label, fmt, why", refused_formats(), ids=[r[0] for r in refused_formats()])
def test_formats_without_an_exact_gguf_type_are_refused(tmp_path, label, fmt, why):
    model = quantized_tiny("llama", w_bits=4, group_size=32)
    model.model.layers[1].mlp.up_proj = QuantLinear(fmt)  # refused before any shape matters
    with pytest.raises(UserError) as e:
        write_gguf(model, None, tmp_path / "m.gguf", "tiny")
    message = str(e.value)
    assert "\n" not in message and why in message and fmt.describe() in message and "exportable:" in message
    assert "model.layers.1.mlp.up_proj" in message and list(tmp_path.iterdir()) == []


def test_online_modules_and_other_families_are_refused(tmp_path):
    model = quantized_tiny("llama", w_bits=4, group_size=32)
    attach_kv_quantizers(model, ActQuantConfig(bits=4))
    with pytest.raises(UserError, match=r"cannot export model\.layers\.0\.self_attn to GGUF: .*kv_quant .*llama.cpp "
                                        "cannot run"):
        check_exportable(model)
    with pytest.raises(UserError, match="supported families: llama, qwen2"):
        check_exportable(make_tiny("qwen3"))
    assert set(FAMILIES) == {"llama", "qwen2", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe", "olmoe"}


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_export_and_its_exit_codes(tmp_path, capsys):
    good, bad = tmp_path / "q4", tmp_path / "q3"
    save(quantized_tiny("qwen2", w_bits=4, group_size=32, sym=True), good)
    save(quantized_tiny("qwen2", w_bits=3, group_size=32), bad)
    out = tmp_path / "out" / "m.gguf"
    code, stdout, _ = run(capsys, "export", good, "--to", "gguf", "-o", out, "--json")
    assert code == 0 and json.loads(stdout)["tensors"] == {"F32": 13, "Q4_0": 14} and out.is_file()
    before = out.read_bytes()
    code, _, err = run(capsys, "export", good, "-o", out)
    assert code == 2 and "already exists" in err and out.read_bytes() == before
    code, stdout, _ = run(capsys, "export", good, "-o", out, "--overwrite")
    assert code == 0 and "Q4_0" in stdout and out.read_bytes() == before  # deterministic
    refused = tmp_path / "out" / "q3.gguf"
    code, stdout, err = run(capsys, "export", bad, "-o", refused)
    assert code == 2 and stdout == "" and err.count("\n") == 1
    assert err.startswith("bitquilt export: error: cannot export model.layers.0.self_attn.q_proj (uniform w3 g32 "
                          "asym) to GGUF") and "(and 13 more layers)" in err
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]  # nothing else written, no temporaries
    code, _, err = run(capsys, "export", tmp_path / "missing", "-o", tmp_path / "x.gguf")
    assert code == 2 and "not a model saved by bitquilt" in err
    code, _, err = run(capsys, "export", good, "-o", tmp_path)
    assert code == 2 and "is a directory" in err
    with pytest.raises(SystemExit):
        main(["export", str(good), "--to", "onnx", "-o", str(out)])


def test_a_failed_write_leaves_the_previous_file(tmp_path, monkeypatch):
    model = quantized_tiny("llama", w_bits=8, group_size=32, sym=True)
    out = tmp_path / "m.gguf"
    write_gguf(model, None, out, "tiny")
    before = out.read_bytes()

    def broken(self, progress=False):
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_gguf(model, None, out, "tiny")
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


# ---------------------------------------------------------------- compressed-tensors
def ct_linears(model) -> dict[str, UniformFormat]:
    return {n: m.fmt for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def random_uniform(out: int, n: int, bits: int, group: int, sym: bool) -> UniformFormat:
    """Random codes, scales and zeros: every bit of the layout matters."""
    gen = torch.Generator().manual_seed(bits * 1000 + group)
    groups = -(-n // group)
    q = torch.randint(0, 2**bits, (out, n), generator=gen)
    scales = torch.rand(out, groups, generator=gen) + 0.01
    zeros = torch.randint(0, 2**bits, (out, groups), generator=gen)
    return UniformFormat.from_codes(q, scales, zeros, UniformGrid(bits, sym), group)


@pytest.mark.parametrize("bits, group, sym", [(4, 32, False), (2, 64, False), (8, 128, True), (4, 64, True),
                                              (4, 128, False), (8, 192, False)])
def test_compressed_tensors_own_decompressor_reads_bitquilts_weights_exactly(bits, group, sym):
    """Widths 192 (at g128: a last group of 64, exported at g64) and 96 rows (zero points padded to whole words)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from bitquilt.export.compressed_tensors import packed_tensors, plan_schemes, weight_args

    fmt = random_uniform(96, 192, bits, group, sym)
    scheme = plan_schemes({"l": fmt})["l"]
    assert scheme == (bits, sym, None if group >= 192 else math.gcd(group, 192))
    args = QuantizationArgs(**weight_args(scheme, act_order=False))
    state = packed_tensors(fmt, scheme[2], torch.float32)
    weight = PackedQuantizationCompressor.decompress(state, QuantizationScheme(targets=["Linear"], weights=args))
    assert torch.equal(weight["weight"], fmt.dequantize())  # fp32: s·(q − z) has ≤ 19 significant bits
    # and compressed-tensors' own compressor, given the same weights, scales and zeros, writes the same tensors
    zero = {} if sym else {"weight_zero_point": weight["weight_zero_point"]}  # unpacked: signed z − 2^(b−1)
    again = PackedQuantizationCompressor.compress(
        {"weight": fmt.dequantize(), "weight_scale": state["weight_scale"], **zero},
        QuantizationScheme(targets=["Linear"], weights=args))
    assert again.keys() == state.keys() and all(torch.equal(again[k], state[k]) for k in state)


@pytest.fixture(scope="module")
def ct_export(tmp_path_factory):
    """The tiny llama quantized with RTN W4 g128 (asymmetric), saved with the default model's tokenizer, and its
    compressed-tensors export: (model, saved dir, export dir, summary)."""
    from transformers import AutoTokenizer

    from bitquilt.export.compressed_tensors import export_compressed_tensors

    tmp = tmp_path_factory.mktemp("ct")
    model = quantized_tiny("llama", w_bits=4, group_size=128)
    save(model, tmp / "q", tokenizer=AutoTokenizer.from_pretrained(registry.fetched_dir(registry.DEFAULT_MODEL)))
    return model, tmp / "q", tmp / "ct", export_compressed_tensors(tmp / "q", tmp / "ct")


def test_compressed_tensors_export_loads_in_transformers_exactly(ct_export):
    """transformers (with compressed-tensors installed) dequantizes the export to bitquilt's weights bit for bit
    in fp32, so the logits agree to float summation order (bitquilt's kernels vs dense matmuls)."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    model, saved, out, summary = ct_export
    assert summary.schemes == {"group_0": "w4 g128 asym (14 linears)"} and summary.regrouped == 0
    assert summary.dtype == "float32" and summary.rounded == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "bitquilt" not in config
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    assert q["ignore"] == ["lm_head"] and q["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert q["config_groups"]["group_0"]["weights"] == {"num_bits": 4, "type": "int", "symmetric": False,
                                                         "dynamic": False, "strategy": "group", "group_size": 128}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (saved / name).read_bytes()
    # asymmetric grids load through the dequantizing path: transformers 5.24's default path sizes packed zero points
    # as unpacked ones and refuses any asymmetric pack-quantized checkpoint, compressed-tensors' own included
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(dequantize=True))
    for name, fmt in ct_linears(model).items():
        assert torch.equal(loaded.get_submodule(name).weight, fmt.dequantize()), name
    for name, p in model.named_parameters():
        assert torch.equal(loaded.get_parameter(name), p), name
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-4)
    assert AutoTokenizer.from_pretrained(out)("The sea")["input_ids"]


def test_symmetric_and_regrouped_exports_load_through_transformers_default_path(tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from bitquilt.export.compressed_tensors import export_compressed_tensors

    model = quantized_tiny("qwen2", w_bits=8, group_size=-1, sym=True, skip=("*.k_proj",))  # per channel, biases
    save(model, tmp_path / "q")
    summary = export_compressed_tensors(tmp_path / "q", tmp_path / "ct")
    assert summary.schemes == {"group_0": "w8 per-channel sym (12 linears)"}
    q = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert q["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert q["ignore"] == ["model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.k_proj", "lm_head"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32)
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-4)
    for name, fmt in ct_linears(model).items():
        assert torch.equal(loaded.get_submodule(name).weight, fmt.dequantize()), name


def test_groups_that_do_not_divide_every_width_share_the_largest_common_size():
    from bitquilt.export.compressed_tensors import plan_schemes

    formats = {"a": random_uniform(32, 576, 4, 128, False), "b": random_uniform(32, 1536, 4, 128, False),
               "c": random_uniform(32, 256, 8, 256, True), "d": random_uniform(32, 512, 8, 512, True)}
    assert plan_schemes(formats) == {"a": (4, False, 64), "b": (4, False, 64), "c": (8, True, None),
                                     "d": (8, True, None)}
    formats["e"] = random_uniform(32, 512, 8, 128, True)
    assert plan_schemes(formats)["c"] == (8, True, 128)  # a per-row layer repeats its scale over the groups


def ct_refused() -> list[tuple[str, object, str]]:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    u = uniform(w, 4, 32, False)
    return [
        ("3-bit", uniform(w, 3, 32, False), "3-bit codes are packed differently"),
        ("act-order", uniform(w, 4, 32, True, act_order=True), "act-order (g_idx) columns"),
        ("bitplane", BitplaneFormat.from_uniform(u), "compressed-tensors has no bitplane format"),
        ("mxint", MXIntFormat.quantize(w, [4], [96]), "compressed-tensors has no mxint format"),
        ("composite", CompositeFormat({"base": u}), "compressed-tensors has no composite format"),
    ]


@pytest.mark.parametrize("label, fmt, why", ct_refused(), ids=[r[0] for r in ct_refused()])
def test_formats_compressed_tensors_cannot_hold_are_refused(tmp_path, label, fmt, why):
    from bitquilt.export.compressed_tensors import write_compressed_tensors

    model = quantized_tiny("llama", w_bits=4, group_size=32)
    model.model.layers[1].mlp.up_proj = QuantLinear(fmt)  # refused before any shape matters
    with pytest.raises(UserError) as e:
        write_compressed_tensors(model, tmp_path, tmp_path / "ct")
    message = str(e.value)
    assert "\n" not in message and why in message and fmt.describe() in message and "exportable: uniform" in message
    assert "model.layers.1.mlp.up_proj" in message and list(tmp_path.iterdir()) == []


def test_online_modules_are_refused_for_compressed_tensors(tmp_path):
    from bitquilt.export.compressed_tensors import write_compressed_tensors

    model = quantized_tiny("llama", w_bits=4, group_size=32)
    attach_kv_quantizers(model, ActQuantConfig(bits=4))
    with pytest.raises(UserError, match=r"cannot export model\.layers\.0\.self_attn to compressed-tensors: .*kv_quant"):
        write_compressed_tensors(model, tmp_path, tmp_path / "ct")


def test_cli_compressed_tensors_export_and_a_refused_bpdq_model(tmp_path, capsys):
    good, bpdq = tmp_path / "q4", tmp_path / "bpdq"
    save(quantized_tiny("llama", w_bits=4, group_size=64, sym=True), good)
    model = make_tiny("llama")
    quantize(model, Recipe("bpdq", w_bits=2, group_size=64), torch.randint(0, 320, (2, 32)), progress=False)
    save(model, bpdq)
    out = tmp_path / "out" / "ct"
    code, stdout, _ = run(capsys, "export", good, "--to", "compressed-tensors", "-o", out, "--json")
    assert code == 0 and json.loads(stdout)["schemes"] == {"group_0": "w4 g64 sym (14 linears)"}
    assert sorted(p.name for p in out.iterdir()) == [".bitquilt-files", "config.json", "generation_config.json",
                                                       "model.safetensors"]  # the manifest: --overwrite may replace it
    before = (out / "model.safetensors").read_bytes()
    code, _, err = run(capsys, "export", good, "--to", "compressed-tensors", "-o", out)
    assert code == 2 and "already exists" in err
    code, _, _ = run(capsys, "export", good, "--to", "compressed-tensors", "-o", out, "--overwrite")
    assert code == 0 and (out / "model.safetensors").read_bytes() == before  # deterministic
    refused = tmp_path / "out" / "bpdq-ct"
    code, stdout, err = run(capsys, "export", bpdq, "--to", "compressed-tensors", "-o", refused)
    assert code == 2 and stdout == "" and err.count("\n") == 1
    assert err.startswith("bitquilt export: error: cannot export model.layers.0.self_attn.q_proj (bitplane") and \
        "compressed-tensors has no bitplane format (and 13 more layers); exportable: uniform 2, 4, 8-bit" in err
    assert sorted(p.name for p in out.parent.iterdir()) == ["ct"]  # no partial output, no temporaries
    code, _, err = run(capsys, "export", good, "--to", "compressed-tensors", "-o", good, "--overwrite")
    assert code == 2 and "is or holds the input" in err and (good / "quantization_config.json").is_file()
    code, _, err = run(capsys, "export", good, "--to", "compressed-tensors", "-o", tmp_path / "x",
                       "--tokenizer-from", tmp_path / "m.gguf")
    assert code == 2 and "--tokenizer-from (tokenizer_from) applies to GGUF exports" in err
