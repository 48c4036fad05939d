"""Streaming quantization: block by block from the checkpoint on disk, bit-identical to quantizing in memory."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from bitquilt.api import open_streaming, quantize, quantize_streaming, save
from bitquilt.cli import main
from bitquilt.errors import UserError
from bitquilt.io import WEIGHTS_NAME, load_quantized
from bitquilt.models.loading import load_model
from bitquilt.models.streaming import fp_weights_held
from bitquilt.recipes import Recipe
from tests.conftest import make_tiny

RECIPES = {
    "rtn": dict(method="rtn", w_bits=4, group_size=32),
    "gptq": dict(method="gptq", w_bits=4, group_size=32),
    "awq+gptq-kv4": dict(method="awq+gptq", w_bits=3, group_size=32, kv_bits=4),
}


def _checkpoint(tmp_path, model_type: str = "llama", tied: bool = False):
    model = make_tiny(model_type)
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    path = tmp_path / f"fp-{model_type}{'-tied' if tied else ''}"
    model.save_pretrained(path)
    return path


def _calib(n: int = 4, seqlen: int = 64) -> torch.Tensor:
    return torch.randint(0, 320, (n, seqlen), generator=torch.Generator().manual_seed(0))


def _assert_same_saved(a, b) -> None:
    ta, tb = load_file(str(a / WEIGHTS_NAME)), load_file(str(b / WEIGHTS_NAME))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def _in_ram(path, recipe: Recipe, ids):
    model, _ = load_model(path)
    quantize(model, recipe, ids, progress=False)
    return model


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen2", False), ("llama", True)])
def test_streaming_is_bit_identical_to_in_memory(tmp_path, name, model_type, tied):
    path = _checkpoint(tmp_path, model_type, tied)
    recipe, ids = Recipe(**RECIPES[name]), _calib()
    ref = _in_ram(path, recipe, ids)
    model, _, report = quantize_streaming(path, recipe, ids, progress=False)
    assert len(report.linears) == len(ref.model.layers) * 7
    save(ref, tmp_path / "ram")
    save(model, tmp_path / "stream")
    _assert_same_saved(tmp_path / "ram", tmp_path / "stream")
    with torch.no_grad():
        assert torch.equal(ref(ids[:2]).logits, model(ids[:2]).logits)
        reloaded, _ = load_quantized(tmp_path / "stream")
        assert torch.equal(reloaded(ids[:2]).logits, model(ids[:2]).logits)


def test_only_one_block_holds_full_precision_weights(tmp_path):
    path = _checkpoint(tmp_path)
    stream = open_streaming(path)
    block = sum(m.weight.numel() for m in stream.layers[0].modules() if isinstance(m, torch.nn.Linear))
    held: list[tuple[int, int]] = []
    load = stream.load

    def spy(i):  # after block i is read: what it holds and what all blocks hold
        load(i)
        held.append((fp_weights_held(stream.layers[i]), fp_weights_held(stream.layers)))

    stream.load = spy
    assert fp_weights_held(stream.layers) == 0  # nothing of the blocks is read up front
    assert stream.model.lm_head.weight.is_meta and not stream.model.model.embed_tokens.weight.is_meta
    model, _, _ = quantize_streaming(stream, Recipe("gptq", w_bits=4, group_size=32), _calib(), progress=False)
    assert held == [(block, block)] * len(stream.layers)  # the block being quantized, nothing else
    assert stream.peak_fp_weights == block
    assert fp_weights_held(model.model.layers) == 0  # every block released: packed formats only
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with pytest.raises(UserError, match="already quantized"):
        quantize_streaming(stream, Recipe("rtn", w_bits=4, group_size=32))


@pytest.mark.parametrize("fields", [
    dict(method="bpdq", w_bits=2, group_size=32),
    dict(method="mxint", w_bits=4, a_bits=4, kv_bits=4),
    dict(method="smoothquant+rtn", w_bits=4, group_size=32, a_bits=8),
    dict(method="awq+rtn", w_bits=3, group_size=32, recon_steps=2),
], ids=lambda f: f["method"])
def test_every_block_method_streams(tmp_path, fields):
    path, recipe, ids = _checkpoint(tmp_path), Recipe(**fields), _calib(2, 32)
    ref = _in_ram(path, recipe, ids)
    model, _, _ = quantize_streaming(path, recipe, ids, progress=False)
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, model(ids).logits)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_every_architecture_streams(tmp_path, model_type):
    path, recipe, ids = _checkpoint(tmp_path, model_type), Recipe("gptq", w_bits=4, group_size=32), _calib(2, 32)
    ref = _in_ram(path, recipe, ids)
    model, _, _ = quantize_streaming(path, recipe, ids, progress=False)
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, model(ids).logits)


@pytest.mark.parametrize("fields,names", [
    (dict(method="quarot+rtn", a_bits=4, kv_bits=4), ["quarot (model)"]),
    (dict(method="quarot+rtn", a_bits=4, a8_layers=1), ["quarot (model)", "dynamic_a8 (model)"]),
    (dict(method="mxsens", w_bits=4, stage_options={"mx_sens": {"target_bits": 4.5}}), ["mx_sens (prepass)"]),
])
def test_whole_model_stages_are_refused_by_name(tmp_path, fields, names):
    with pytest.raises(UserError, match="--stream") as e:
        quantize_streaming(tmp_path / "never-opened", Recipe(**fields), _calib())
    assert all(n in str(e.value) for n in names)


def test_refuses_what_is_not_a_full_precision_hf_folder(tmp_path):
    path = _checkpoint(tmp_path)
    model, _ = load_model(path)
    quantize(model, Recipe("rtn", w_bits=4, group_size=32), progress=False)
    save(model, tmp_path / "q")
    with pytest.raises(UserError, match="already quantized"):
        open_streaming(tmp_path / "q")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(UserError, match="is a .gguf file"):
        open_streaming(tmp_path / "m.gguf")
    (path / WEIGHTS_NAME).write_bytes((path / WEIGHTS_NAME).read_bytes()[:-1000])
    with pytest.raises(UserError, match="truncated"):
        open_streaming(path)


def test_nan_weights_are_refused_when_their_block_is_read(tmp_path):
    path = _checkpoint(tmp_path)
    model, _ = load_model(path)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(path)
    with pytest.raises(UserError, match=r"layers\.1\.mlp\.up_proj\.weight contains NaN"):
        quantize_streaming(path, Recipe("rtn", w_bits=4, group_size=32), progress=False)


def test_cli_stream_matches_the_in_memory_cli(tmp_path, capsys):
    path = _checkpoint(tmp_path, "qwen2")
    args = ["quantize", str(path), "--method", "rtn", "--w-bits", "4", "--group-size", "32", "--json"]
    assert main(args + ["-o", str(tmp_path / "ram")]) == 0
    assert main(args + ["--stream", "-o", str(tmp_path / "stream")]) == 0
    _assert_same_saved(tmp_path / "ram", tmp_path / "stream")
    for name in ("config.json", "generation_config.json"):
        assert (tmp_path / "ram" / name).read_text() == (tmp_path / "stream" / name).read_text()
    capsys.readouterr()
    code = main(["quantize", str(path), "--recipe", "quarot+rtn", "--a-bits", "4", "--stream",
                 "-o", str(tmp_path / "quarot")])
    err = capsys.readouterr().err
    assert code == 2 and "quarot (model)" in err and "without --stream" in err
    assert not (tmp_path / "quarot").exists()
