"""Phi-3/Phi-4 (`model_type` phi3): fused q/k/v and gate/up projections split on load (`bitquilt.models.fused`),
quantized like a llama block, saved and reloaded, run by bitquilt's runtime, and fused back for GGUF."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import make_tiny, reload_bit_exact, save_tiny_with_tokenizer
from safetensors import safe_open
from transformers import Phi3Config, Phi3ForCausalLM

from bitquilt.api import export, quantize, save
from bitquilt.cli import main
from bitquilt.errors import UserError
from bitquilt.formats.base import concat_rows
from bitquilt.io import load_quantized
from bitquilt.models.adapters import architecture_of
from bitquilt.models.fused import SplitLinear, fuse_parts, split_fused
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import Recipe
from bitquilt.runtime.engines import decode
from bitquilt.runtime.lean import unsupported_reason
from bitquilt.runtime.module_tree import ModuleTreeLM

PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")


def _ids(n=4, seqlen=32, vocab=320, seed=0):
    return torch.randint(0, vocab, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _phi3(partial: float = 1.0, **extra) -> Phi3ForCausalLM:
    """A random Phi-3 as transformers builds it (fused projections), the issue's tiny shape."""
    config = Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        partial_rotary_factor=partial, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)
    torch.manual_seed(0)
    return Phi3ForCausalLM(config).eval()


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_split_model_computes_the_transformers_logits_and_fuses_back_bit_exact(partial):
    model = _phi3(partial)
    fused_state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = _ids(2, 16, vocab=256)
    with torch.no_grad():
        want = model(ids).logits
        split_fused(model)
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, SplitLinear)
        assert all(type(model.model.layers[1].get_submodule(p)) is torch.nn.Linear for p in PARTS)
        assert torch.equal(model(ids).logits, want)
        assert split_fused(model) is model and torch.equal(model(ids).logits, want)  # split once
        fuse_parts(model)
    assert model.state_dict().keys() == fused_state.keys()
    assert all(torch.equal(v, fused_state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("recipe", [Recipe("rtn", w_bits=4, group_size=32), Recipe("gptq", w_bits=4, group_size=32),
                                    Recipe("awq", w_bits=4, group_size=32),
                                    Recipe("smoothquant+rtn", w_bits=8, group_size=32, a_bits=8),
                                    Recipe("quarot+rtn", w_bits=8, group_size=32)], ids=Recipe.label)
def test_methods_quantize_every_linear_and_reload_bit_exact(tmp_path, recipe):
    model = make_tiny("phi3")
    assert architecture_of(model).name == "phi3"
    ids = _ids()
    with torch.no_grad():
        ref = model(ids[:2]).logits
    quantize(model, recipe, ids, progress=False)
    for block in model.model.layers:
        assert all(isinstance(block.get_submodule(p), QuantLinear) for p in PARTS)
    with torch.no_grad():
        out = model(ids[:2]).logits
    rel = (out - ref).pow(2).mean() / ref.pow(2).mean()
    assert rel < (3e-2 if recipe.w_bits == 4 else 1e-3), rel
    loaded = reload_bit_exact(model, ids[:2], tmp_path / "q")
    assert isinstance(loaded.model.layers[0].self_attn.qkv_proj, SplitLinear)  # the transformers Phi3 skeleton


def test_cli_quantizes_streams_evaluates_and_generates(tmp_path, capsys):
    """`bitquilt quantize` on a Phi-3 checkpoint (fused tensors on disk), in memory and streamed (the parts read as
    rows of the fused tensors) to the same model; then `eval` and `generate` on the result."""
    fp = tmp_path / "fp"
    save_tiny_with_tokenizer(fp, "phi3")
    assert "model.layers.0.self_attn.qkv_proj.weight" in safe_open(fp / "model.safetensors", "pt").keys()
    calib = ["--calib-samples", "4", "--calib-seqlen", "64"]
    for stream in ([], ["--stream"]):
        out = tmp_path / f"q{len(stream)}"
        assert main(["quantize", str(fp), "--method", "gptq", "--w-bits", "4", "--group-size", "32", *calib, *stream,
                     "-o", str(out)]) == 0
    a, b = load_quantized(tmp_path / "q0")[0], load_quantized(tmp_path / "q1")[0]
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "q0"), "--ppl", "--seqlen", "64", "--ppl-windows", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ppl_wiki"] > 1 and result["ppl_settings"]["wiki"]["n_windows"] == 2
    assert main(["generate", str(tmp_path / "q0"), "--prompt", "The capital of France is", "--max-new-tokens", "4",
                 "--runtime", "bitquilt", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_tokens"] >= 1


@pytest.mark.parametrize("partial, engine", [(1.0, "fused"), (0.75, "lean")])
def test_bitquilt_runtime_gives_the_transformers_tokens(tmp_path, partial, engine):
    model = split_fused(_phi3(partial))
    quantize(model, Recipe("rtn", w_bits=4, group_size=32), None, progress=False)
    save(model, tmp_path / "q")
    reference, _ = load_quantized(tmp_path / "q")
    native, _ = load_quantized(tmp_path / "q", runtime="bitquilt")
    assert isinstance(native, ModuleTreeLM) and native.state_dict().keys() == reference.state_dict().keys()
    ids = _ids(2, 12, vocab=256, seed=1)
    with torch.no_grad():
        assert torch.allclose(native(ids), reference(ids, use_cache=False).logits, atol=1e-4)
    prompt = _ids(1, 6, vocab=256, seed=3)
    want = decode(reference, prompt, 10, engine="transformers")
    got = decode(native, prompt, 10, engine=engine)
    assert got.engine == engine and got.new_ids == want.new_ids


def test_longrope_runs_in_the_bitquilt_runtime_as_in_transformers(tmp_path):
    """LongRoPE (Phi-3.5, Phi-4-mini) within its original context: the short factors and the attention factor, as
    transformers computes them there, in the module tree and the lean and fused engines (whose tables are computed
    once for a run); a longer run, where transformers switches to the long factors, is refused, and so are the
    standalone and GGUF exports."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(8)],
            "long_factor": [2.0 + i / 4 for i in range(8)], "original_max_position_embeddings": 64}
    model = split_fused(_phi3(rope_parameters=rope, original_max_position_embeddings=64))
    assert unsupported_reason(model, 64) is None
    assert "RoPE type 'longrope' past its original context (65 positions > 64)" in unsupported_reason(model, 65)
    quantize(model, Recipe("rtn", w_bits=4, group_size=32), None, progress=False)
    save(model, tmp_path / "q")
    reference, _ = load_quantized(tmp_path / "q")
    native, _ = load_quantized(tmp_path / "q", runtime="bitquilt")
    assert isinstance(native, ModuleTreeLM)
    ids = _ids(2, 64, vocab=256, seed=1)
    with torch.no_grad():
        assert torch.allclose(native(ids), reference(ids, use_cache=False).logits, atol=1e-4)
        with pytest.raises(ValueError, match="past its original context"):
            native(_ids(1, 65, vocab=256))
    prompt = _ids(1, 6, vocab=256, seed=3)
    want = decode(reference, prompt, 10, engine="transformers")
    got = decode(native, prompt, 10, engine="fused")
    assert got.engine == "fused" and got.new_ids == want.new_ids
    for to in ("standalone", "gguf"):  # neither file holds the attention factor or the switch of factors
        with pytest.raises(UserError, match="LongRoPE|RoPE scaling 'longrope'"):
            export(tmp_path / "q", tmp_path / f"out-{to}", to=to)
        assert not (tmp_path / f"out-{to}").exists()


def test_fusing_parts_of_different_grids_is_refused(tmp_path, capsys):
    model = make_tiny("phi3")
    quantize(model, Recipe("rtn", w_bits=4, group_size=32, overrides={"*.v_proj": {"bits": 8, "sym": True}}), None,
             progress=False)
    save(model, tmp_path / "q")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "q"), "--to", "gguf", "-o", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot fuse model.layers.0.self_attn.qkv_proj exactly: its parts differ" in err[0]
    assert not (tmp_path / "m.gguf").exists()
    with pytest.raises(UserError, match=r"cannot fuse model.layers.0.self_attn.qkv_proj exactly: its parts differ"):
        fuse_parts(model)
    q = model.model.layers[0].self_attn.q_proj.fmt
    assert torch.equal(concat_rows([q, q]).dequantize(), torch.cat([q.dequantize()] * 2))


@pytest.mark.parametrize("bits, sym, qtype", [(4, True, "Q4_0"), (8, True, "Q8_0"), (4, False, "Q4_1")])
def test_gguf_export_fuses_qkv_and_gate_up_as_llama_cpp_reads_them(tmp_path, bits, sym, qtype):
    import gguf

    from bitquilt.export.gguf import export_gguf

    model = make_tiny("phi3")  # partial rotary 0.75: 24 of each head's 32 dimensions rotate
    quantize(model, Recipe("rtn", w_bits=bits, group_size=32, sym=sym), None, progress=False)
    save(model, tmp_path / "q")
    summary = export_gguf(tmp_path / "q", tmp_path / "m.gguf")
    assert summary.arch == "phi3" and summary.tensors == {qtype: 2 * 4, "F32": 2 * 2 + 3}
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    tensors = {t.name: t for t in reader.tensors}
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(2)
        for n in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")}
    assert set(tensors) == expected
    assert set(tensors) <= {gguf.TENSOR_NAMES[t].format(bid=i) + ".weight" for i in range(2)
                            for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.PHI3]} | {"token_embd.weight"}
    c, block = model.config, model.model.layers[1]
    for name, parts in (("attn_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                        ("ffn_up", ("mlp.gate_proj", "mlp.up_proj"))):
        t = tensors[f"blk.1.{name}.weight"]
        assert t.tensor_type.name == qtype
        got = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        want = torch.cat([block.get_submodule(p).fmt.dequantize() for p in parts])
        minimum = torch.cat([torch.mul(*block.get_submodule(p).fmt.column_params()) for p in parts])
        assert got.shape == want.shape == (sum(block.get_submodule(p).out_features for p in parts), c.hidden_size)
        assert ((got - want).abs() <= 2**-11 * minimum.abs()).all()  # Q4_1 rounds −s·z to fp16, else exact
        if qtype != "Q4_1":
            assert torch.equal(got, want)
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("phi3.")}
    assert fields["phi3.rope.dimension_count"] == 24 and fields["phi3.attention.head_count_kv"] == 2
    assert fields["phi3.rope.scaling.original_context_length"] == c.original_max_position_embeddings
    assert fields["phi3.attention.sliding_window"] == 0 and fields["phi3.feed_forward_length"] == 256


def test_compressed_tensors_export_writes_the_fused_phi3_layout(tmp_path):
    from safetensors.torch import load_file

    from bitquilt.export.compressed_tensors import export_compressed_tensors

    model = make_tiny("phi3")
    quantize(model, Recipe("rtn", w_bits=4, group_size=32), None, progress=False)
    save(model, tmp_path / "q")
    export_compressed_tensors(tmp_path / "q", tmp_path / "ct")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert config["model_type"] == "phi3"
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    parts = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    assert not [k for k in tensors if any(f".{p}." in k for p in parts)]
    assert tuple(tensors["model.layers.0.self_attn.qkv_proj.weight_shape"].tolist()) == (128 + 2 * 64, 128)
    assert tuple(tensors["model.layers.0.mlp.gate_up_proj.weight_shape"].tolist()) == (2 * 256, 128)
    q = model.model.layers[0].self_attn
    fused = concat_rows([q.q_proj.fmt, q.k_proj.fmt, q.v_proj.fmt])
    assert torch.equal(tensors["model.layers.0.self_attn.qkv_proj.weight_packed"], fused.qweight)


def test_standalone_export_runs_a_full_rotary_phi3_and_refuses_a_partial_one(tmp_path, int8_on):
    from bitquilt.api import export
    from bitquilt.runtime.lean import LeanDecoder
    from bitquilt.runtime.standalone.generate import generate_ids
    from bitquilt.runtime.standalone.model import StandaloneModel

    for partial in (1.0, 0.75):
        model = split_fused(_phi3(partial))
        quantize(model, Recipe("rtn", w_bits=4, group_size=64), None, progress=False)
        save(model, tmp_path / f"q{partial}")
    refused = (r"standalone runtime: a partial rotary factor of 0\.75, where it rotates whole heads "
               r".*phi3 and MoE models\)$")
    with pytest.raises(UserError, match=refused):
        export(tmp_path / "q0.75", tmp_path / "out", to="standalone")
    export(tmp_path / "q1.0", tmp_path / "out", to="standalone")
    standalone = StandaloneModel(tmp_path / "out")
    reference = LeanDecoder(load_quantized(tmp_path / "q1.0", runtime="bitquilt")[0], 16)
    ids = _ids(1, 8, vocab=256, seed=5)[0].tolist()
    standalone.begin(16)
    for token in ids:
        expected = reference.forward(torch.tensor([[token]])).numpy()
        np.testing.assert_allclose(standalone.forward([token]), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    reference.reset()
    tokens = [int(reference.forward(torch.tensor([ids[:4]])).argmax())]
    while len(tokens) < 6:
        tokens.append(int(reference.forward(torch.tensor([[tokens[-1]]])).argmax()))
    assert generate_ids(standalone, ids[:4], 6).new_ids == tokens


def test_gguf_mix_gives_each_fused_tensors_parts_its_type_and_exports(tmp_path):
    """llama.cpp's Q4_K_M gives phi3's attn_qkv Q5_K (not attn_q/k's Q4_K and attn_v's Q6_K): the parts take it, so
    they fuse; gate and up take ffn_up's type."""
    import gguf

    from bitquilt.export.gguf import export_gguf
    from bitquilt.formats.ggml_blocks import with_fallback
    from bitquilt.policies.gguf_mix import linear_type

    model = make_tiny("phi3")
    types = {p: linear_type("Q4_K_M", f"model.layers.0.{p}", model.config) for p in PARTS}
    assert [types[p] for p in PARTS[:3]] == ["Q5_K"] * 3 and types["mlp.gate_proj"] == types["mlp.up_proj"] == "Q4_K"
    quantize(model, Recipe("rtn", gguf_type="Q4_K_M"), _ids(), progress=False)
    save(model, tmp_path / "q")
    export_gguf(tmp_path / "q", tmp_path / "m.gguf")
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    block = model.model.layers[0]
    for name, parts in (("attn_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                        ("ffn_up", ("mlp.gate_proj", "mlp.up_proj"))):
        fmts = [block.get_submodule(p).fmt for p in parts]
        assert {f.type.name for f in fmts} == {with_fallback(types[parts[0]], 128).name}  # rows of 128: fallback
        t = tensors[f"blk.0.{name}.weight"]
        assert t.tensor_type.name == fmts[0].type.name
        assert np.array_equal(np.array(t.data).reshape(-1), torch.cat([f.blocks for f in fmts]).numpy().reshape(-1))
