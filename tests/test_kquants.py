"""llama.cpp's K-quants in bitquilt: ggml block layouts bit-exact against the `gguf` package's reference dequantizers,
calibrated solvers beating llama.cpp's own search on the same grid, the K-quant mixes, and export to a GGUF file
whose blocks read back as bitquilt's weights bit for bit (llama.cpp's own tools, when built, load it)."""

from __future__ import annotations

import json
import subprocess

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from bitquilt.api import quantize
from bitquilt.cache import cache_dir
from bitquilt.cli import main
from bitquilt.export.gguf import export_gguf, rotary_order
from bitquilt.formats.ggml import GGMLFormat
from bitquilt.formats.ggml_blocks import TYPES, pack, unpack, with_fallback
from bitquilt.io import load_quantized, save
from bitquilt.policies.gguf_mix import linear_type, more_bits, tensor_type
from bitquilt.recipes import Recipe
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec, relative_error
from bitquilt.solvers.ggml_search import fit
from tests.conftest import make_tiny

LLAMACPP_BIN = cache_dir() / "llamacpp" / "build" / "bin"  # where bench/gguf_kquants.py builds llama.cpp


def reference(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """gguf's reference dequantization of ggml bytes [rows, bytes]."""
    return torch.from_numpy(np.array(gguf.quants.dequantize(blocks.numpy(), Q[name])))


@pytest.mark.parametrize("name", list(TYPES))
def test_layouts_are_ggmls_bit_for_bit(name):
    t = TYPES[name]
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (3, 2 * t.nbytes), dtype=torch.uint8, generator=g)
    fields = unpack(t, raw)  # every bit pattern of the codes and scales, finite fp16 factors
    fields.d = torch.randn(fields.d.shape, generator=g).half()
    if fields.dmin is not None:
        fields.dmin = torch.randn(fields.dmin.shape, generator=g).half()
    data = pack(t, fields)
    assert torch.equal(pack(t, unpack(t, data)), data)
    assert torch.equal(GGMLFormat(data, name, 2 * t.block).dequantize(), reference(data, name))
    w = torch.randn(4, 2 * t.block, generator=g) * 0.02  # and what the search fits
    fmt = GGMLFormat.from_fields(t, fit(w, t, torch.rand(2 * t.block, generator=g)))
    assert torch.equal(fmt.dequantize(), reference(fmt.blocks, name))
    assert torch.equal(fmt.dequantize_rows(torch.tensor([[2], [0]])), fmt.dequantize()[[2, 0]].unsqueeze(1))
    assert fmt.nbytes() == 4 * 2 * t.nbytes and fmt.bits_per_weight() == t.bits_per_weight()
    assert relative_error(w, fmt.dequantize(), torch.eye(w.shape[1])) < 0.1


def test_error_falls_with_the_type_width():
    w = torch.randn(32, 512, generator=torch.Generator().manual_seed(1))
    errors = [float((GGMLFormat.from_fields(TYPES[n], fit(w, TYPES[n])).dequantize() - w).square().mean())
              for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-3 < errors[0]


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q6_K"])
def test_calibrated_solvers_beat_llama_cpps_search_on_real_layers(real_linears, name):
    """On smollm2's real linears and their calibration Hessians: GPTQ onto the same grid < llama.cpp's search with
    the importance matrix < without it (output error tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)). Rows of 576 get the fallback type."""
    rtn, gptq = get_solver("gguf_rtn"), get_solver("gguf_gptq")
    for layer, w, stats in real_linears[::2]:
        spec = LayerSpec(TYPES[name].bits, 256)
        plain = rtn(w, None, spec, {"ggml_type": name, "imatrix": False})
        weighted = rtn(w, stats, spec, {"ggml_type": name})
        solved = gptq(w, stats, spec, {"ggml_type": name})
        assert solved.type == with_fallback(name, w.shape[1]), layer
        errors = [relative_error(w, f.dequantize(), stats.hessian) for f in (plain, weighted, solved)]
        assert errors[2] < 0.8 * errors[1] and errors[1] <= errors[0], (layer, errors)  # Q8_0 has no search


def test_mixes_follow_llama_cpp():
    assert [more_bits(i, 24) for i in range(8)] == [True, True, True, False, False, True, False, False]
    assert tensor_type("Q4_K_M", "attn_v", 2, 24) == "Q6_K" and tensor_type("Q4_K_M", "attn_v", 3, 24) == "Q4_K"
    assert tensor_type("Q4_K_M", "ffn_down", 23, 24) == "Q6_K" and tensor_type("Q4_K_M", "attn_q", 0, 24) == "Q4_K"
    assert [tensor_type("Q3_K_M", "attn_v", i, 24) for i in (1, 2)] == ["Q5_K", "Q4_K"]
    assert [tensor_type("Q3_K_M", "ffn_down", i, 32) for i in (1, 2)] == ["Q5_K", "Q4_K"]
    assert tensor_type("Q3_K_M", "attn_output") == "Q4_K" and tensor_type("Q3_K_S", "attn_v") == "Q3_K"
    assert [tensor_type("Q2_K", "attn_v", n_gqa=g) for g in (3, 4)] == ["Q3_K", "Q4_K"]
    assert tensor_type("Q2_K", "ffn_down") == tensor_type("Q2_K", "attn_output") == "Q3_K"
    assert tensor_type("Q2_K", "output") == tensor_type("Q5_K_M", "tied_embd") == "Q6_K"
    assert tensor_type("Q4_K_S", "attn_v", 3) == "Q5_K" and tensor_type("Q4_K_S", "attn_v", 4) == "Q4_K"
    assert [with_fallback(n, 576).name for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")] == \
        ["Q4_0", "Q4_0", "Q5_0", "Q5_1", "Q8_0"]
    config = make_tiny("qwen2").config
    assert linear_type("Q2_K", "model.layers.1.mlp.down_proj", config) == "Q3_K"


@pytest.mark.parametrize("model_type, mix, method, recon_steps", [
    ("llama", "Q3_K_M", "gptq", 0), ("qwen2", "Q4_K_M", "rtn", 0), ("qwen2", "Q2_K", "gptq", 3),
])
def test_export_reads_back_as_bitquilts_weights(tmp_path, model_type, mix, method, recon_steps):
    model = make_tiny(model_type)
    ids = torch.randint(0, model.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
    report = quantize(model, Recipe(method, gguf_type=mix, recon_steps=recon_steps), ids, progress=False)
    if recon_steps:  # reconstruction trained every block's llama.cpp blocks and packed them back
        assert [r["steps"] for r in report.stages["recon"].values()] == [recon_steps] * model.config.num_hidden_layers
    save(model, tmp_path / "q")
    summary = export_gguf(tmp_path / "q", tmp_path / "m.gguf")
    loaded, _ = load_quantized(tmp_path / "q")
    packed = {n: m.fmt for n, m in loaded.named_modules() if isinstance(getattr(m, "fmt", None), GGMLFormat)}
    assert {type(f) for f in packed.values()} == {GGMLFormat} and len(packed) == 2 + 7 * model.config.num_hidden_layers
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    tensors = {t.name: t for t in reader.tensors}
    config = model.config
    for name, fmt in packed.items():
        if name.endswith("lm_head") and "output.weight" not in tensors:
            continue
        gguf_name = {"model.embed_tokens": "token_embd", "lm_head": "output"}.get(name)
        if gguf_name is None:
            _, _, i, _, proj = name.split(".")
            gguf_name = f"blk.{i}." + {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                                        "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
                                        "down_proj": "ffn_down"}[proj]
        t = tensors[f"{gguf_name}.weight"]
        want = fmt.dequantize()
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(name[-6:])
        if model_type == "llama" and heads:
            want = want[rotary_order(want.shape[0], heads)]
        assert t.tensor_type == Q[fmt.type.name], name
        assert torch.equal(reference(torch.from_numpy(np.array(t.data)), fmt.type.name).view_as(want), want), name
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType[f"MOSTLY_{mix}"]
    assert sum(summary.tensors.values()) == len(tensors)


def test_cli_quantize_export_and_a_bad_mix(tmp_path, capsys):
    source = tmp_path / "tiny"
    make_tiny("qwen2").save_pretrained(source)
    out = tmp_path / "q2k"
    assert main(["quantize", str(source), "--gguf-type", "Q2_K", "--method", "rtn", "--no-imatrix", "-o", str(out),
                 "--json"]) == 0
    stdout = capsys.readouterr().out
    assert json.loads(stdout[stdout.index("{"):])["gguf_type"] == "Q2_K"
    assert main(["export", str(out), "--to", "gguf", "-o", str(tmp_path / "m.gguf"), "--json"]) == 0
    tensors = json.loads(capsys.readouterr().out)["tensors"]
    assert tensors["Q3_K"] == 2 and tensors["Q4_0"] > 0  # ffn_down in 256; narrower rows fall back
    for argv, why in ((["--gguf-type", "Q9_K"], "unknown --gguf-type 'Q9_K'"),
                      (["--gguf-type", "Q4_K_M", "--method", "bpdq"], "needs a method ending in rtn or gptq"),
                      (["--gguf-type", "Q4_K_M", "--head-bits", "8"], "does not combine with --head-bits")):
        code = main(["quantize", str(source), *argv, "-o", str(tmp_path / "bad")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and why in err, err
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
@pytest.mark.skipif(not (LLAMACPP_BIN / "llama-perplexity").is_file(), reason="no llama.cpp build (bench)")
def test_llama_cpp_loads_the_export(tmp_path, smollm):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["The quick brown fox jumps over the lazy dog."] * 200))
    out = tmp_path / "q"
    assert main(["quantize", "smollm2-135m", "--gguf-type", "Q4_K_M", "--method", "rtn", "--no-imatrix",
                 "-o", str(out)]) == 0
    assert main(["export", str(out), "--to", "gguf", "-o", str(tmp_path / "m.gguf")]) == 0
    proc = subprocess.run([str(LLAMACPP_BIN / "llama-perplexity"), "-m", str(tmp_path / "m.gguf"), "-f", str(text),
                           "-c", "128", "--chunks", "2", "-t", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Final estimate: PPL" in proc.stdout + proc.stderr, proc.stderr[-2000:]
