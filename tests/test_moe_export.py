"""Exports of mixture-of-experts models: GGUF's stacked expert tensors and router (read back equal to bitquilt's
weights; llama.cpp's hidden states when its optional venv is there), compressed-tensors' per-expert linears (loaded by
transformers into its 3D experts exactly), and what either runtime would compute otherwise, refused in one line."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from bitquilt.api import export, quantize, save
from bitquilt.errors import UserError
from bitquilt.io import load_quantized
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import Recipe
from tests.conftest import llamacpp_hidden, make_tiny, needs_llamacpp
from tests.test_export import converter_permute, fields_of, read_back

# configs llama.cpp's graphs compute as transformers does (olmoe: no GQA, no renormalised top-k)
FAMILIES = {"mixtral": ("llama", {}), "qwen3_moe": ("qwen3moe", {}),
            "olmoe": ("olmoe", dict(num_key_value_heads=4, norm_topk_prob=False))}
STACKS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


W4 = Recipe("rtn", w_bits=4, group_size=32, sym=True)


def saved_moe(tmp_path, model_type, recipe=W4, **config):
    model = make_tiny(model_type, **FAMILIES[model_type][1] | config)
    quantize(model, recipe, progress=False)
    save(model, tmp_path / model_type)
    return model, tmp_path / model_type


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("bits, qtype", [(4, Q.Q4_0), (8, Q.Q8_0)])
def test_gguf_stacks_each_blocks_experts_and_keeps_the_router_in_f32(tmp_path, model_type, bits, qtype):
    model, saved = saved_moe(tmp_path, model_type, Recipe("rtn", w_bits=bits, group_size=32, sym=True))
    summary = export(saved, tmp_path / "m.gguf")
    got, fields = read_back(tmp_path / "m.gguf"), fields_of(tmp_path / "m.gguf")
    arch, config = FAMILIES[model_type][0], model.config
    assert fields["general.architecture"] == arch
    assert fields[f"{arch}.expert_count"] == 4 and fields[f"{arch}.expert_used_count"] == 2
    assert fields.get(f"{arch}.expert_feed_forward_length") == (128 if model_type == "qwen3_moe" else None)
    for i, layer in enumerate(model.model.layers):
        router_type, router = got[f"blk.{i}.ffn_gate_inp.weight"]
        assert router_type == Q.F32 and torch.equal(router, layer.mlp.gate.weight)
        for linear, name in STACKS.items():
            gguf_type, stacked = got[f"blk.{i}.{name}.weight"]
            want = torch.stack([getattr(e, linear).fmt.dequantize() for e in layer.mlp.experts])
            assert gguf_type == qtype and stacked.shape == want.shape == (4, *want.shape[1:])
            assert torch.equal(stacked, want), (i, name)
        q = layer.self_attn.q_proj.fmt.dequantize()  # llama (Mixtral) permutes q/k rows; the NeoX families do not
        want_q = converter_permute(q, config.num_attention_heads) if arch == "llama" else q
        assert torch.equal(got[f"blk.{i}.attn_q.weight"][1], want_q)
    assert summary.tensors[qtype.name] == 2 * (4 + 3)  # per layer: q, k, v, o and three expert stacks


def test_experts_of_different_types_are_refused(tmp_path):
    _, saved = saved_moe(tmp_path, "mixtral", Recipe("rtn", w_bits=4, group_size=32, sym=True,
                                                     skip=("*.experts.1.up_proj",)))
    with pytest.raises(UserError, match=r"cannot export model.layers.0.mlp.experts.up_proj.weight to GGUF: its experts "
                                        r"are of different types \(F32, Q4_0\)"):
        export(saved, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("model_type, config, why", [
    ("olmoe", dict(num_key_value_heads=2), "grouped-query attention"),
    ("olmoe", dict(norm_topk_prob=True), r"norm_topk_prob=True \(llama.cpp never renormalises"),
    ("olmoe", dict(clip_qkv=4.0), r"q/k/v clipping \(clip_qkv\)"),
    ("qwen3_moe", dict(norm_topk_prob=False), r"norm_topk_prob=False \(llama.cpp always renormalises"),
    ("mixtral", dict(sliding_window=64), "a sliding window"),
])
def test_what_llama_cpps_moe_graphs_compute_otherwise_is_refused(tmp_path, model_type, config, why):
    _, saved = saved_moe(tmp_path, model_type, **config)
    with pytest.raises(UserError, match=f"cannot export this '{model_type}' model to GGUF: {why}"):
        export(saved, tmp_path / "m.gguf")


@needs_llamacpp
@pytest.mark.parametrize("model_type", FAMILIES)
def test_llama_cpp_runs_the_exported_experts_as_bitquilt_does(tmp_path, model_type):
    """llama.cpp's final-norm hidden states equal bitquilt's to within what a dense llama's export gives (llama.cpp
    rounds activations to 8 bits for the Q4_0 matmuls and keeps an F16 KV cache): same routing, same experts."""
    _, saved = saved_moe(tmp_path, model_type)
    export(saved, tmp_path / "m.gguf")
    model = load_quantized(saved)[0]
    ids = [5, 17, 200, 33, 91, 7, 150, 250, 3, 44]
    got = llamacpp_hidden(tmp_path / "m.gguf", ids)
    with torch.no_grad():
        want = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    assert isinstance(model.model.layers[0].mlp.experts[0].up_proj, QuantLinear)
    assert (got - want).abs().max() < 0.02 * want.abs().max()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_compressed_tensors_writes_per_expert_linears_that_transformers_loads_exactly(tmp_path, model_type):
    pytest.importorskip("compressed_tensors")
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model, saved = saved_moe(tmp_path, model_type)
    export(saved, tmp_path / "ct", to="compressed-tensors")
    with safe_open(tmp_path / "ct" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    block = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    gate = "w1" if model_type == "mixtral" else "gate_proj"
    assert f"model.layers.1.{block}.experts.3.{gate}.weight_packed" in names  # the family's per-expert names
    assert f"model.layers.1.{block}.gate.weight" in names
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32)
    for ours, theirs in zip(model.model.layers, loaded.model.layers, strict=True):
        assert torch.equal(theirs.mlp.gate.weight, ours.mlp.gate.weight)
        for e, expert in enumerate(ours.mlp.experts):
            gate_up = torch.cat([expert.gate_proj.fmt.dequantize(), expert.up_proj.fmt.dequantize()])
            assert torch.equal(theirs.mlp.experts.gate_up_proj[e], gate_up)
            assert torch.equal(theirs.mlp.experts.down_proj[e], expert.down_proj.fmt.dequantize())
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-4)


def test_asymmetric_experts_are_refused_for_compressed_tensors(tmp_path):
    _, saved = saved_moe(tmp_path, "qwen3_moe", Recipe("rtn", w_bits=4, group_size=32, sym=False))
    with pytest.raises(UserError, match=r"cannot export model.layers.0.mlp.experts.0.gate_proj \(.*\) to "
                                        "compressed-tensors: transformers decompresses expert weights without zero "
                                        "points.*--sym"):
        export(saved, tmp_path / "ct", to="compressed-tensors")
    assert not (tmp_path / "ct").exists()


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("recipe", [Recipe("gptq", w_bits=4, group_size=32, sym=True),
                                    Recipe("awq", w_bits=8, group_size=32, sym=True),
                                    Recipe("quarot+rtn", w_bits=4, group_size=32, sym=True)], ids=Recipe.label)
def test_every_method_exports_or_is_refused_in_one_line(tmp_path, model_type, recipe):
    """The export column of the family × method matrix (tests/test_moe.py runs quantize → save → load → generate):
    weight-only methods export to GGUF and compressed-tensors; QuaRot's online rotations are refused by both."""
    pytest.importorskip("compressed_tensors")
    model = make_tiny(model_type, **FAMILIES[model_type][1])
    quantize(model, recipe, torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(0)), progress=False)
    save(model, tmp_path / "q")
    for to, output in (("gguf", tmp_path / "m.gguf"), ("compressed-tensors", tmp_path / "ct")):
        if recipe.method.startswith("quarot"):
            with pytest.raises(UserError, match=f"cannot export .* to {to.replace('gguf', 'GGUF')}: it runs the "
                                                "online module"):
                export(tmp_path / "q", output, to=to)
        else:
            export(tmp_path / "q", output, to=to)
            assert output.exists()
