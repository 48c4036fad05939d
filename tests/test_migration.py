"""Outlier migration: exact Spearman ρ, per-token KL at several precisions, the matrices, and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_tiny, save_tiny_with_tokenizer

from bitquilt.cli import main
from bitquilt.errors import UserError
from bitquilt.eval.migration import (
    MigrationResult,
    average_ranks,
    migration,
    plot_migration,
    precision_settings,
    slice_precisions,
    spearman,
    token_errors,
)
from bitquilt.nn.quant_linear import set_slices
from bitquilt.recipes import Recipe


@pytest.fixture(scope="module")
def sliced():
    """(fp model, the same model quantized by mobislice at 8 bits = slices 2,1,1,1,1,1,1)."""
    from bitquilt.api import quantize

    model = make_tiny("llama")
    quantize(model, Recipe("mobislice", w_bits=8, group_size=32), None, progress=False)
    return make_tiny("llama"), model


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(0))


def test_spearman_matches_a_hand_computed_example_with_ties():
    a, b = torch.tensor([1.0, 2.0, 2.0, 4.0]), torch.tensor([10.0, 30.0, 20.0, 40.0])
    # ranks (1, 2.5, 2.5, 4) and (1, 3, 2, 4), both mean 2.5: centred (−1.5, 0, 0, 1.5) and (−1.5, .5, −.5, 1.5);
    # ρ = 4.5 / √(4.5 · 5) = √0.9
    assert average_ranks(a).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert average_ranks(torch.tensor([3.0, 3.0, 3.0, 1.0])).tolist() == [3.0, 3.0, 3.0, 1.0]
    assert spearman(a, b) == pytest.approx(math.sqrt(0.9), abs=1e-12)


def test_spearman_is_one_for_monotone_transforms_and_minus_one_reversed():
    x = torch.randn(500, generator=torch.Generator().manual_seed(1))
    assert spearman(x, x.pow(3)) == pytest.approx(1.0, abs=1e-12)
    assert spearman(x, x.exp() + 7) == pytest.approx(1.0, abs=1e-12)
    assert spearman(x, -x) == pytest.approx(-1.0, abs=1e-12)
    assert math.isnan(spearman(x, torch.ones(500)))  # undefined for a constant
    with pytest.raises(ValueError, match="1-D tensors of one length"):
        spearman(x, x[:10])


def test_slice_precisions_are_what_set_slices_reports(sliced):
    _, model = sliced
    static = slice_precisions(model)
    assert static == {2.0: 1, 3.0: 2, 4.0: 3, 5.0: 4, 6.0: 5, 7.0: 6, 8.0: 7}
    assert all(set_slices(model, k) == b for b, k in static.items())


def test_error_at_all_slices_is_far_below_two_bits_and_zero_against_itself(sliced, windows):
    fp, model = sliced
    settings = precision_settings(model, [2, 8])
    assert list(settings) == ["static 2", "static 8"]
    errors = token_errors(fp, model, windows, settings)
    assert {e.shape for e in errors.values()} == {torch.Size([2 * 48])}
    assert (errors["static 2"] >= 0).all() and errors["static 8"].mean() < 0.05 * errors["static 2"].mean()
    same = token_errors(fp, fp, windows, {"fp": lambda m: None})["fp"]
    assert same.abs().max() < 1e-6


def test_migration_matrices_are_symmetric_with_unit_diagonal(sliced, windows, tmp_path):
    fp, model = sliced
    result = migration(token_errors(fp, model, windows, precision_settings(model, [2, 3, 5])), top_fraction=0.05)
    assert result.labels == ["static 2", "static 3", "static 5"]
    assert result.mean_error[0] > result.mean_error[1] > result.mean_error[2]
    assert result.top_k == math.ceil(0.05 * 96) and result.n_tokens == 96
    for m in (result.spearman, result.top_shared):
        assert torch.equal(m, m.T) and torch.allclose(m.diagonal(), torch.ones(3, dtype=m.dtype))
        assert (m >= -1 - 1e-12).all() and (m <= 1 + 1e-12).all()
    path = plot_migration(result, tmp_path / "m.png", "tiny")
    assert path.stat().st_size > 5_000 and set(result.to_dict()) >= {"spearman", "top_shared", "mean_kl"}
    again = MigrationResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again.labels == result.labels and again.mean_error == result.mean_error
    assert torch.equal(again.spearman, result.spearman) and torch.equal(again.top_shared, result.top_shared)
    assert (again.top_fraction, again.top_k, again.n_tokens) == (result.top_fraction, result.top_k, result.n_tokens)


def test_migration_on_known_rankings():
    a = torch.arange(200.0)
    result = migration({"a": a, "same order": a.sqrt(), "reversed": -a})  # top 1%: k = 2 tokens
    assert result.top_k == 2 and result.chance_shared == 0.01
    assert result.spearman[0].tolist() == pytest.approx([1.0, 1.0, -1.0])
    assert result.top_shared[0].tolist() == [1.0, 1.0, 0.0]


def test_unreachable_bits_and_unsliced_models_are_refused(sliced):
    with pytest.raises(UserError, match=r"2\.5 bits: no prefix .* \(static precisions: 2, 3, 4, 5, 6, 7, 8 bits\)"):
        precision_settings(sliced[1], [2, 2.5])
    with pytest.raises(UserError, match="needs a sliced checkpoint.*--method mobislice"):
        precision_settings(make_tiny("llama"), [2])


def test_routed_settings_where_the_routers_reach(sliced, monkeypatch):
    """With routers (faked here: a routed range of [3, 6] bits), each b gets the settings that reach it."""
    import bitquilt.nn.slice_router as slice_router

    def set_precision(model, avg_bits):
        if not 3 <= avg_bits <= 6:
            raise ValueError(f"average bits {avg_bits:g} are out of this checkpoint's routed range [3.00, 6.00]")
        return 0.5

    monkeypatch.setattr(slice_router, "has_routers", lambda model: True)
    monkeypatch.setattr(slice_router, "set_precision", set_precision)
    settings = precision_settings(sliced[1], [2, 4, 4.5])
    assert list(settings) == ["static 2", "static 4", "routed 4", "routed 4.5"]
    with pytest.raises(UserError, match=r"2\.5 bits: .* and average bits 2\.5 are out of .* routed range"):
        precision_settings(sliced[1], [2.5])


# ---------------------------------------------------------------- command line
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Directories: `fp` (a tiny llama with the default model's tokenizer and vocabulary), `mobi` (it, mobislice
    at 4 bits = slices 2,1,1), `rtn` (it, RTN at 4 bits), `other` (a tiny llama of another vocabulary)."""
    from bitquilt.api import quantize, save

    root = tmp_path_factory.mktemp("migration")
    tokenizer = save_tiny_with_tokenizer(root / "fp")
    make_tiny("llama").save_pretrained(root / "other")
    for name, method in (("mobi", "mobislice"), ("rtn", "rtn")):
        model = make_tiny("llama")
        model.resize_token_embeddings(len(tokenizer))
        quantize(model, Recipe(method, w_bits=4, group_size=32), None, progress=False)
        save(model, root / name, tokenizer=tokenizer)
    return root


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_writes_the_plot_json_and_table(saved, capsys):
    args = ["analyze", saved / "mobi", "--outlier-migration", "--fp-model", saved / "fp", "--windows", "2",
            "--seqlen", "64"]
    code, stdout, err = run(capsys, *args, "--bits", "2,4", "--plot", saved / "m.png", "--json")
    assert code == 0, err
    result = json.loads(stdout)
    assert result["labels"] == ["static 2", "static 4"] and result["n_tokens"] == 128 and result["windows"] == 2
    assert set(result) >= {"mean_kl", "spearman", "top_shared", "top_k", "chance_shared", "fp_model"}
    assert result["mean_kl"]["static 2"] > result["mean_kl"]["static 4"] > 0
    assert result["spearman"][0][0] == pytest.approx(1.0) and (saved / "m.png").stat().st_size > 5_000
    code, stdout, err = run(capsys, *args)  # default: every static precision
    assert code == 0, err
    assert "ρ static 3" in stdout.splitlines()[0] and "| static 4 |" in stdout and "shared" in stdout


@pytest.mark.parametrize("model, args, message", [
    ("mobi", ["--fp-model", "{fp}", "--bits", "2.5"], "static precisions: 2, 3, 4 bits"),
    ("rtn", ["--fp-model", "{fp}"], "--method mobislice` (or mobiquant)"),
    ("fp", ["--fp-model", "{fp}"], "is not a saved bitquilt model"),
    ("mobi", ["--fp-model", "{other}"], "vocab_size 320 there, 49152 in the checkpoint"),
    ("mobi", ["--fp-model", "{fp}", "--residual-stream"], "choose exactly one analysis"),
    ("mobi", [], "give it with --fp-model"),
])
def test_cli_bad_input_is_one_line(saved, capsys, model, args, message):
    paths = {"fp": saved / "fp", "other": saved / "other"}
    code, stdout, err = run(capsys, "analyze", saved / model, "--outlier-migration", "--seqlen", "32", "--windows", "1",
                            *[a.format(**paths) for a in args])
    assert code == 2 and message in err and "Traceback" not in err and stdout == ""
    assert err.count("error:") == 1  # (besides transformers' loading progress)
