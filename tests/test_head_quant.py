"""Quantized LM head and input embeddings (`Recipe.head_bits`): modules, save/load, streaming, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from bitquilt.api import model_summary, quantize, quantize_streaming, save
from bitquilt.cli import main
from bitquilt.errors import UserError
from bitquilt.formats.uniform import UniformFormat, UniformGrid
from bitquilt.io import CONFIG_NAME, WEIGHTS_NAME, load_quantized, model_nbytes
from bitquilt.nn.quant_embedding import QuantEmbedding
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.pipeline.head import quantize_head
from bitquilt.recipes import Recipe
from tests.conftest import make_tiny, reload_bit_exact

IDS = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))


def _tiny(model_type: str = "llama", tied: bool = False):
    model = make_tiny(model_type)
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    elif model.lm_head.weight is model.model.embed_tokens.weight:  # Gemma 3 ties by default
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    return model


def _recipe(head_bits: int = 8, **fields) -> Recipe:
    return Recipe(**{"method": "rtn", "w_bits": 4, "group_size": 32, "head_bits": head_bits, "head_group_size": 64,
                     **fields})


@pytest.mark.parametrize("sym, group_size, g_idx", [(True, 32, False), (False, 48, False), (False, 32, True)])
def test_row_gather_is_bit_identical_to_the_full_dequantization(sym, group_size, g_idx):
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
    grid = UniformGrid(4, sym)
    from bitquilt.solvers.rtn import quantize_groups

    q, s, z = quantize_groups(w, grid, group_size)
    idx = torch.randperm(96, generator=torch.Generator().manual_seed(1)).int() % s.shape[1] if g_idx else None
    fmt = UniformFormat.from_codes(q, s, z, grid, group_size, idx)
    rows = torch.tensor([[3, 0, 39], [3, 7, 7]])
    got = fmt.dequantize_rows(rows)
    assert got.shape == (2, 3, 96) and torch.equal(got, fmt.dequantize()[rows])


@pytest.mark.parametrize("model_type, tied", [("llama", False), ("llama", True), ("qwen2", False),
                                              ("gemma3_text", True)])
@pytest.mark.parametrize("head_bits", [8, 4])
def test_save_load_is_bit_exact(tmp_path, model_type, tied, head_bits):
    model = _tiny(model_type, tied)
    report = quantize(model, _recipe(head_bits), None, progress=False)
    embed, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embed, QuantEmbedding) and isinstance(head, QuantLinear)
    assert (head.fmt is embed.fmt) == tied and report.stages["head_quant"]["tied"] == tied
    assert embed.fmt.bits == head_bits and embed.fmt.sym == (head_bits == 8) and embed.fmt.group_size == 64
    loaded = reload_bit_exact(model, IDS, tmp_path / "q")
    assert (loaded.lm_head.fmt is loaded.model.embed_tokens.fmt) == tied
    layers = json.loads((tmp_path / "q" / CONFIG_NAME).read_text())["layers"]
    assert layers["model.embed_tokens"]["kind"] == "embedding"
    assert layers["lm_head"].get("tied") == ("model.embed_tokens" if tied else None)
    with safe_open(str(tmp_path / "q" / WEIGHTS_NAME), "pt") as f:
        keys = set(f.keys())
    assert {"model.embed_tokens.weight", "lm_head.weight"}.isdisjoint(keys)  # no fp32 copy left
    assert any(k.startswith("lm_head.packed_") for k in keys) != tied  # a tied head's tensors are stored once
    assert model_nbytes(loaded) == model_nbytes(model)
    for name, buffer in model.named_buffers():  # non-persistent ones too: RoPE frequencies, Gemma's embed_scale
        assert torch.equal(buffer, loaded.get_buffer(name)), name


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_embedding_rows_are_the_formats_rows(model_type):
    model = _tiny(model_type, tied=True)
    scale = getattr(model.model.embed_tokens, "embed_scale", torch.tensor(1.0))
    quantize(model, _recipe(4), None, progress=False)
    embed = model.model.embed_tokens
    with torch.no_grad():
        assert torch.equal(embed(IDS), embed.fmt.dequantize()[IDS] * scale)
        assert torch.equal(embed(IDS[0, 5]), embed.fmt.dequantize()[IDS[0, 5]] * scale)


def test_bits_per_weight_and_size_count_the_head_once_when_tied(tmp_path):
    sizes = {}
    for tied in (False, True):
        model = _tiny("llama", tied)
        quantize(model, _recipe(8), None, progress=False)
        linears = [m.fmt for m in model.model.layers.modules() if isinstance(m, QuantLinear)]
        table = [model.model.embed_tokens.fmt] + ([] if tied else [model.lm_head.fmt])
        fmts = linears + table
        n = sum(f.in_features * f.out_features for f in fmts)
        expected = sum(f.bits_per_weight() * f.in_features * f.out_features for f in fmts) / n
        summary = model_summary(model)
        assert summary["bits_per_weight"] == pytest.approx(expected)
        dense = sum(p.numel() * p.element_size() for p in model.parameters())  # norms only
        assert model_nbytes(model) == sum(f.nbytes() for f in fmts) + dense
        sizes[tied] = save(model, tmp_path / f"q{tied}").joinpath(WEIGHTS_NAME).stat().st_size
    assert sizes[True] < sizes[False] - 0.9 * model.model.embed_tokens.fmt.nbytes()


def test_8_bit_head_error_is_small_and_4_bit_larger():
    errors, logits = {}, {}
    for bits in (16, 8, 4):
        model = _tiny("llama")
        report = quantize(model, _recipe(bits), None, progress=False)
        with torch.no_grad():
            logits[bits] = model(IDS).logits
        if bits < 16:
            errors[bits] = {r["name"]: r["rel_error"] for r in report.stages["head_quant"]["layers"]}
    assert all(e < 1e-4 for e in errors[8].values()) and all(1e-3 < e < 0.03 for e in errors[4].values())
    drift = {b: float((logits[b] - logits[16]).pow(2).mean() / logits[16].pow(2).mean()) for b in (8, 4)}
    assert drift[8] < 1e-3 and drift[8] < drift[4] / 20


@pytest.mark.parametrize("tied", [False, True])
def test_streaming_quantizes_the_head_identically(tmp_path, tied):
    model = _tiny("llama", tied)
    model.save_pretrained(tmp_path / "fp")
    quantize(model, _recipe(4), None, progress=False)
    streamed, _, report = quantize_streaming(tmp_path / "fp", _recipe(4), None, progress=False)
    assert report.stages["head_quant"]["tied"] == tied
    with torch.no_grad():
        assert torch.equal(streamed(IDS).logits, model(IDS).logits)


def test_quarot_keeps_a_tied_head_tied_so_one_table_is_quantized(tmp_path):
    model = _tiny("llama", tied=True)
    report = quantize(model, _recipe(8, method="quarot+rtn"), None, progress=False)
    assert report.stages["quarot"]["tied_lm_head"] is True and report.stages["head_quant"]["tied"] is True
    reload_bit_exact(model, IDS, tmp_path / "q")


def test_bad_settings_are_refused_with_what_is_accepted(tmp_path, capsys):
    with pytest.raises(ValueError, match="must be one of 16, 8, 4 .* got 5"):
        Recipe("rtn", head_bits=5)
    with pytest.raises(ValueError, match="head_group_size .*supported: 32, 64, 128, 256, -1"):
        Recipe("rtn", head_bits=8, head_group_size=100)
    assert main(["quantize", "smollm2-135m", "--head-bits", "5", "-o", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--head-bits" in err and "16, 8, 4" in err and "got 5" in err
    assert not (tmp_path / "q").exists()
    model = _tiny("llama")
    quantize(model, _recipe(8), None, progress=False)
    with pytest.raises(ValueError, match="quantized once"):
        quantize_head(model, _recipe(8))


def test_inspect_lists_the_head_and_embeddings(tmp_path, capsys):
    model = _tiny("llama", tied=True)
    quantize(model, _recipe(8), None, progress=False)
    save(model, tmp_path / "q")
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "q"), "--json"]) == 0
    rows = {r["layer"]: r for r in json.loads(capsys.readouterr().out)["layers"]}
    assert len(rows) == 16 and rows["model.embed_tokens"]["bits_per_weight"] == pytest.approx(8.25)
    assert "tied to model.embed_tokens" in rows["lm_head"]["format"] and rows["lm_head"]["bytes"] == 0


@pytest.mark.parametrize("edit, message", [
    (lambda layers: layers["lm_head"].update(tied="model.norm"), "tied to 'model.norm'"),
    (lambda layers: layers["model.embed_tokens"].update(kind="table"), "unknown kind 'table'"),
    (lambda layers: layers["model.layers.0.mlp.up_proj"].update(kind="embedding"), "not an embedding"),
])
def test_edited_head_entries_are_refused(tmp_path, edit, message):
    model = _tiny("llama", tied=True)
    quantize(model, _recipe(8), None, progress=False)
    save(model, tmp_path / "q")
    qconfig = json.loads((tmp_path / "q" / CONFIG_NAME).read_text())
    edit(qconfig["layers"])
    (tmp_path / "q" / CONFIG_NAME).write_text(json.dumps(qconfig))
    with pytest.raises(UserError, match=f"corrupt or was edited: .*{message}"):
        load_quantized(tmp_path / "q")


@pytest.mark.parametrize("to", ["gguf", "compressed-tensors"])
def test_exports_refuse_quantized_embeddings_by_name(tmp_path, to):
    from bitquilt.api import export

    model = _tiny("llama", tied=True)
    quantize(model, _recipe(8), None, progress=False)
    save(model, tmp_path / "q")
    with pytest.raises(UserError, match=f"cannot export model.embed_tokens to {to.replace('gguf', 'GGUF')}: .*"
                                        "--head-bits 16"):
        export(tmp_path / "q", tmp_path / "out", to=to)
    assert not (tmp_path / "out").exists()


def test_chunked_conversions_equal_the_whole_matrix_ones(monkeypatch):
    """RTN of the head runs a chunk of rows at a time (bounded temporaries for a 150k vocabulary); the result is
    that of the whole matrix (the kernels' chunked layouts: tests/test_kernels.py)."""
    import bitquilt.pipeline.head as head
    from bitquilt.solvers import get_solver

    w = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    for bits in (8, 4):
        spec = head.head_spec(bits, 32)
        whole = get_solver("rtn")(w, None, spec)
        monkeypatch.setattr(head, "ROW_CHUNK", 128)
        chunked = head._rtn(w, spec)
        assert whole.tensors().keys() == chunked.tensors().keys()
        assert all(torch.equal(t, chunked.tensors()[k]) for k, t in whole.tensors().items())
        error = float((whole.dequantize() - w).pow(2).sum() / w.pow(2).sum())
        assert head.weight_error(w, chunked) == pytest.approx(error)
        monkeypatch.undo()
