"""GGUF export: blocks read back with gguf's reference dequantizer equal bitquilt's weights, llama.cpp's layout and
metadata (checked against the packaged model's original GGUF), refusals, the CLI and atomic writes."""

import json

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


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for a Hugging Face one (written out here, independently of the exporter)."""
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    _, _, block, *rest = hf_name.split(".")
    return f"blk.{block}.{BLOCK_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


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
    assert set(FAMILIES) == {"llama", "qwen2"}


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
