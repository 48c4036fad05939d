"""MosaicQuant: the sparse 4-bit residual format, the Δ-score and its alternatives, the solve-stage residual,
save/load, the recovery analysis and the command line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny, reload_bit_exact

from bitquilt.api import quantize, residual_recovery
from bitquilt.cli import main
from bitquilt.formats.composite import CompositeFormat
from bitquilt.formats.sparse_blocks import SparseBlockFormat
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import Recipe
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec, LinearStats, hessian_error
from bitquilt.solvers.mosaic import (
    MosaicOptions,
    Residual,
    delta_scores,
    greedy_order,
    mosaic_residual,
    mosaic_solve,
    ranking,
    recovery_curve,
    tile_count,
)

BUDGETS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.5)
IDS = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(0))


def _layer(out=64, inp=256, seed=0):
    """A weight, its RTN W4g128 base and calibration statistics with a few outlier input channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, inp, generator=g) * torch.rand(inp, generator=g).mul(2).add(0.2)
    x[:, :4] *= 15
    stats = LinearStats.empty(inp)
    stats.update(x)
    w = torch.randn(out, inp, generator=g)
    return w, get_solver("rtn")(w, None, LayerSpec(4, 128)), stats


# ---------------------------------------------------------------- the format
@pytest.mark.parametrize("block", [(1, 32), (4, 32), (2, 16), (16, 64)])
def test_sparse_blocks_hold_the_chosen_tiles_and_round_trip(block):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    n = 64 // block[0] * (128 // block[1])
    index = torch.randperm(n, generator=torch.Generator().manual_seed(2))[: n // 4]
    fmt = SparseBlockFormat.from_dense(w, index, block)
    dense = fmt.dequantize()
    covered = torch.zeros(n, dtype=torch.bool)
    covered[index] = True
    r, c = block
    mask = covered.reshape(64 // r, 128 // c).repeat_interleave(r, 0).repeat_interleave(c, 1)
    assert (dense[~mask] == 0).all()
    step = fmt.scales.float().repeat_interleave(r * c).max()
    assert (dense[mask] - w[mask]).abs().max() <= step / 2 + 1e-6  # 4-bit rounding within each tile
    assert fmt.nbytes() == len(index) * (r * c // 2 + 4 + 2)  # codes, int32 id, fp16 scale
    again = SparseBlockFormat.from_tensors(fmt.tensors(), fmt.meta())
    assert torch.equal(again.dequantize(), dense)


def test_sparse_blocks_refuse_bad_shapes_and_ids():
    w = torch.randn(48, 96)
    with pytest.raises(ValueError, match="do not tile"):
        SparseBlockFormat.from_dense(w, torch.tensor([0]), (5, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        SparseBlockFormat.from_dense(w, torch.tensor([0]), (1, 16))
    fmt = SparseBlockFormat.from_dense(w, torch.tensor([0, 3]), (1, 32))
    with pytest.raises(ValueError, match="strictly increasing"):
        SparseBlockFormat(fmt.index.flip(0), fmt.qweight, fmt.scales, 48, 96, (1, 32))
    with pytest.raises(ValueError, match="qweight has shape"):
        SparseBlockFormat(fmt.index, fmt.qweight[:, :2], fmt.scales, 48, 96, (1, 32))


# ---------------------------------------------------------------- scores
@pytest.mark.parametrize("block", [(1, 32), (4, 32), (2, 64)])
def test_delta_score_is_the_diagonal_hessian_weighted_error_drop_of_each_tile(block):
    w, base, stats = _layer()
    res = Residual.of(w, base.dequantize(), block)
    scores = delta_scores(res, stats.hessian.diagonal())
    h = stats.hessian.diagonal()
    for b in (0, 5, res.n_tiles - 1):
        stored = SparseBlockFormat.from_dense(res.error, torch.tensor([b]), block).dequantize()
        measured = (h * (res.error.pow(2) - (res.error - stored).pow(2))).sum()
        torch.testing.assert_close(scores[b], measured, rtol=1e-4, atol=1e-6)


def test_exact_score_is_each_tiles_true_drop_alone():
    w, base, stats = _layer(out=16, inp=128)
    res = Residual.of(w, base.dequantize(), (2, 32))
    order = ranking(res, "exact", stats, res.n_tiles)
    before = hessian_error(res.error, None, stats.hessian)
    drops = torch.tensor([before - hessian_error(res.error, res.dense(torch.tensor([t])), stats.hessian)
                          for t in range(res.n_tiles)])
    assert torch.equal(order, torch.argsort(drops, descending=True, stable=True))


def test_greedy_takes_the_tile_of_largest_true_drop_at_every_step():
    w, base, stats = _layer(out=16, inp=128)
    res = Residual.of(w, base.dequantize(), (1, 32))
    order = greedy_order(res, stats.hessian, 3)
    taken: list[int] = []
    for b in order.tolist():
        now = hessian_error(res.error, res.dense(torch.tensor(taken, dtype=torch.long)), stats.hessian)
        drops = {t: now - hessian_error(res.error, res.dense(torch.tensor(taken + [t])), stats.hessian)
                 for t in range(res.n_tiles) if t not in taken}
        assert b == max(drops, key=drops.get)
        taken.append(b)


@pytest.mark.parametrize("score", ["delta", "greedy"])
def test_distortion_falls_monotonically_with_the_budget(score):
    w, base, stats = _layer()
    res = Residual.of(w, base.dequantize(), (1, 32))
    order = ranking(res, score, stats, tile_count(max(BUDGETS), res.n_tiles))
    curve = recovery_curve(res, order, stats.hessian, BUDGETS)
    assert curve[0] == 0.0
    assert all(b > a for a, b in zip(curve, curve[1:]))


def test_delta_beats_magnitude_and_random_at_every_budget_and_greedy_bounds_it():
    w, base, stats = _layer()
    res = Residual.of(w, base.dequantize(), (1, 32))
    n = tile_count(max(BUDGETS), res.n_tiles)
    curves = {s: recovery_curve(res, ranking(res, s, stats, n), stats.hessian, BUDGETS[1:])
              for s in ("delta", "magnitude", "random", "greedy")}
    for i in range(len(BUDGETS) - 1):
        assert curves["delta"][i] > curves["magnitude"][i] > 0
        assert curves["delta"][i] > curves["random"][i] > 0
        assert curves["greedy"][i] >= curves["delta"][i] - 1e-3


def test_zero_budget_is_the_base_and_the_composite_adds_the_residual():
    w, base, stats = _layer()
    none = mosaic_residual(w, base, stats, MosaicOptions(budget=0.0))
    assert isinstance(none, CompositeFormat) and none.parts["residual"].index.numel() == 0
    assert torch.equal(none.dequantize(), base.dequantize())
    fmt = mosaic_residual(w, base, stats, MosaicOptions(budget=0.1))
    residual = fmt.parts["residual"]
    assert residual.index.numel() == tile_count(0.1, residual.n_blocks)
    assert torch.equal(fmt.dequantize(), base.dequantize() + residual.dequantize())
    assert hessian_error(w, fmt.dequantize(), stats.hessian) < hessian_error(w, base.dequantize(), stats.hessian)
    assert fmt.bits_per_weight() == pytest.approx(base.bits_per_weight() + 0.1 * (4 + 48 / 32), abs=0.02)


def test_bad_options_are_refused_with_what_is_accepted():
    for bad, match in [({"budget": 1.5}, "budget"), ({"block": (1, 8)}, "multiple of 32"),
                       ({"score": "best"}, "score must be one of")]:
        with pytest.raises(ValueError, match=match):
            MosaicOptions(**bad)
    w, base, _ = _layer()
    with pytest.raises(ValueError, match="needs the layer's Hessian"):
        mosaic_residual(w, base, None, MosaicOptions())


# ---------------------------------------------------------------- the pipeline
def test_recipe_residual_validation_and_label():
    recipe = Recipe("gptq", residual="mosaic", residual_options={"budget": 0.05})
    assert "+mosaic 5%" in recipe.label() and recipe.needs_calibration
    assert Recipe("rtn", residual="mosaic", residual_options={"score": "magnitude"}).needs_calibration is False
    with pytest.raises(ValueError, match="unknown residual 'zipper'"):
        Recipe("gptq", residual="zipper")
    with pytest.raises(ValueError, match="without a residual method"):
        Recipe("gptq", residual_options={"budget": 0.1})
    with pytest.raises(ValueError, match="no option"):
        Recipe("gptq", residual="mosaic", residual_options={"ratio": 0.1})


def test_quantize_with_a_residual_saves_loads_bit_exactly_and_reports_recovery(tmp_path):
    model = make_tiny("qwen2")
    recipe = Recipe("quarot+gptq", w_bits=4, group_size=64, a_bits=4, kv_bits=4, residual="mosaic",
                    residual_options={"budget": 0.1})
    quantize(model, recipe, IDS, progress=False)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(isinstance(m.fmt, CompositeFormat) and set(m.fmt.parts) == {"base", "residual"}
                           for m in linears)
    loaded = reload_bit_exact(model, IDS[:2], tmp_path / "mosaic")
    rows = residual_recovery(tmp_path / "mosaic")
    assert len(rows) == len(linears) and all(0 < r.recovered <= 1 for r in rows)
    assert [r.name for r in residual_recovery(loaded)] == [r.name for r in rows]


def test_residual_tiles_that_do_not_fit_a_layer_are_refused_before_any_work():
    model = make_tiny("llama")
    recipe = Recipe("rtn", residual="mosaic", residual_options={"block": (3, 32), "score": "magnitude"})
    with pytest.raises(ValueError, match=r"q_proj: residual blocks of 3×32 do not tile"):
        quantize(model, recipe, None, progress=False)


# ---------------------------------------------------------------- command line
def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_quantize_with_mosaic_then_analyze_recovery(tmp_path, capsys):
    out = tmp_path / "mosaic"
    code, stdout, err = _run(capsys, "quantize", "smollm2-135m", "--method", "gptq", "--residual", "mosaic",
                             "--residual-budget", "0.2", "--residual-block", "2x32", "--calib-samples", "4",
                             "--calib-seqlen", "128", "--skip", "model.layers.[1-9].*", "--skip",
                             "model.layers.[12]?.*", "-o", out, "--json")
    assert code == 0, err
    assert json.loads((out / "quantization_config.json").read_text())["recipe"]["residual_options"] == {
        "budget": 0.2, "block": [2, 32]}
    plot = tmp_path / "recovery.png"
    code, stdout, err = _run(capsys, "analyze", out, "--residual-recovery", "--plot", plot, "--json")
    assert code == 0, err
    result = json.loads(stdout)
    assert [r["layer"] for r in result["linears"]] == [0] * 7
    assert result["summary"][-1]["kind"] == "all" and 0 < result["summary"][-1]["mean_recovered"] < 1
    assert plot.stat().st_size > 0
    code, _, err = _run(capsys, "analyze", "smollm2-135m", "--residual-recovery")
    assert code == 2 and "not a saved bitquilt model" in err


def test_cli_refuses_bad_residual_input(tmp_path, capsys):
    code, _, err = _run(capsys, "quantize", "smollm2-135m", "--residual-budget", "0.1", "-o", tmp_path / "x")
    assert code == 2 and "add --residual mosaic" in err
    code, _, err = _run(capsys, "quantize", "smollm2-135m", "--residual", "mosaic", "--residual-budget", "2",
                        "-o", tmp_path / "x")
    assert code == 2 and "budget is a fraction" in err
    with pytest.raises(SystemExit):
        main(["quantize", "smollm2-135m", "--residual", "mosaic", "--residual-block", "1by32", "-o", "x"])
    assert "ROWSxCOLS" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- GPTQ base, on real layers
def test_a_residual_fitted_after_gptq_hurts_but_the_joint_sweep_recovers(real_linears):
    """GPTQ's error is shaped by its feedback: tiles fitted to it afterwards raise the output distortion; the joint
    sweep (tiles chosen first, GPTQ compensating base + residual) lowers it, Δ ahead of magnitude and random."""
    gptq, options = get_solver("gptq"), get_solver("gptq").make_options({})
    spec = LayerSpec(4, 128)
    for _, w, stats in real_linears[:2]:
        plain = gptq(w, stats, spec, options)
        before = hessian_error(w, plain.dequantize(), stats.hessian)
        after = mosaic_residual(w, plain, stats, MosaicOptions(budget=0.1))
        assert hessian_error(w, after.dequantize(), stats.hessian) > before
        joint = {score: mosaic_solve(w, stats, spec, gptq, options, MosaicOptions(budget=0.1, score=score))
                 for score in ("delta", "magnitude", "random")}
        recovered = {score: 1 - hessian_error(w, fmt.dequantize(), stats.hessian) / before
                     for score, (fmt, _) in joint.items()}
        assert recovered["delta"] > recovered["magnitude"] > recovered["random"] > 0.05
        assert joint["delta"][1].dequantize().equal(plain.dequantize())  # the reference is plain GPTQ
