"""MXINT format, MXINT solvers and the MXSens allocation policy."""

from __future__ import annotations

import copy

import pytest
import torch

from bitquilt.formats import mxint
from bitquilt.formats.mxint import BLOCK, MXIntFormat, dequantize_blocks, quantize_blocks, shared_exponents, step_size
from bitquilt.nn.act_quant import ActQuantConfig, MXActQuantizer, fake_quantize
from bitquilt.policies.mx_sens import LinearShape, allocate, element_bits
from bitquilt.recipes import Recipe
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec, relative_error
from tests.conftest import make_tiny, reload_bit_exact


# ---------------------------------------------------------------- the MXINT-m definition
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_round_trip_error_is_at_most_half_a_step(bits):
    x = torch.randn(64, 8 * BLOCK) * torch.logspace(-3, 3, 64).unsqueeze(1)
    q, e = quantize_blocks(x, bits)
    assert q.abs().max() <= mxint.qmax(bits)
    step = step_size(e, bits).repeat_interleave(BLOCK, dim=1)
    err = (dequantize_blocks(q, e, bits) - x).abs()
    assert (err <= step / 2).all()
    # the exponent is the smallest that clamps nothing: one lower would need an element beyond qmax
    blocks = x.reshape(64, 8, BLOCK).abs().amax(-1)
    assert (torch.round(blocks / step_size(e - 1, bits)) > mxint.qmax(bits)).all()
    assert torch.equal(mxint.fake_quantize(dequantize_blocks(q, e, bits), bits), dequantize_blocks(q, e, bits))


def test_more_mantissa_bits_less_error():
    x = torch.randn(32, 256)
    errs = [float((mxint.fake_quantize(x, b) - x).pow(2).mean()) for b in (4, 6, 8)]
    assert errs[0] > 4 * errs[1] > 16 * errs[2]


def test_zero_huge_and_tiny_blocks():
    x = torch.zeros(3, 2 * BLOCK)
    x[1, :BLOCK] = torch.linspace(-3e37, 3e37, BLOCK)
    x[2, BLOCK:] = torch.linspace(-1e-36, 1e-36, BLOCK)
    for bits in (4, 6, 8):
        q, e = quantize_blocks(x, bits)
        assert e[0].tolist() == [mxint.EXP_MIN] * 2 and not q[0].any()
        assert (e >= mxint.EXP_MIN).all() and (e <= mxint.EXP_MAX).all()
        back = dequantize_blocks(q, e, bits)
        assert torch.isfinite(back).all()
        step = step_size(e, bits).repeat_interleave(BLOCK, dim=1)
        assert ((back - x).abs() <= step / 2).all()


def test_bad_input_is_rejected_clearly():
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize_blocks(x, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_blocks(torch.randn(2, 40), 4)
    with pytest.raises(ValueError, match="supported: 4, 6, 8"):
        shared_exponents(torch.randn(1, BLOCK), 5)
    with pytest.raises(ValueError, match="whole 32-column"):
        MXIntFormat.quantize(torch.randn(4, 64), [8, 4], [16, 48])


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_signed_packing_round_trip(bits):
    q = torch.randint(-mxint.qmax(bits), mxint.qmax(bits) + 1, (5, 96), dtype=torch.int8)
    assert torch.equal(mxint.unpack_signed(mxint.pack_signed(q, bits), bits, 96), q)


# ---------------------------------------------------------------- format: classes and permutation
def test_permutation_and_inverse_are_the_identity_on_outputs():
    torch.manual_seed(0)
    w, x = torch.randn(48, 128), torch.randn(5, 128)
    perm = torch.randperm(128)
    fmt = MXIntFormat.quantize(w, [8], [128], perm)  # 8-bit: close to w, so the order must be right
    stored = MXIntFormat.quantize(w[:, perm], [8], [128])
    assert torch.equal(fmt.dequantize()[:, perm], stored.dequantize())
    assert torch.allclose(fmt.reference_matmul(x), x[:, perm] @ stored.dequantize().T, atol=1e-5)
    exact = x @ w.T
    assert (fmt.reference_matmul(x) - exact).norm() < 0.01 * exact.norm()


def test_mixed_classes_cost_and_round_trip():
    w = torch.randn(16, 256)
    fmt = MXIntFormat.quantize(w, [8, 6, 4], [32, 64, 160], torch.randperm(256))
    assert fmt.element_bits() == pytest.approx((8 * 32 + 6 * 64 + 4 * 160) / 256)
    assert fmt.bits_per_weight() == pytest.approx(fmt.element_bits() + 8 / 32 + 32 / 16)  # + int32 perm per row
    back = MXIntFormat.from_tensors(fmt.tensors(), fmt.meta())
    assert torch.equal(back.dequantize(), fmt.dequantize())


# ---------------------------------------------------------------- activations and KV cache
def test_mx_activation_quantizer_follows_the_weight_classes():
    torch.manual_seed(1)
    x = torch.randn(3, 7, 128)
    perm = torch.randperm(128)
    config = ActQuantConfig(4, format="mxint")
    quant = MXActQuantizer(config, [8, 4], [32, 96], perm)
    y = quant(x)
    xp = x[..., perm]
    expected = torch.cat([mxint.fake_quantize(xp[..., :32], 8), mxint.fake_quantize(xp[..., 32:], 4)], -1)
    assert torch.equal(y[..., perm], expected)
    restored = MXActQuantizer.from_dict(quant.to_dict())
    restored.load_state_dict(quant.state_dict())
    assert torch.equal(restored(x), y)
    assert torch.equal(fake_quantize(x, config), mxint.fake_quantize(x, 4))


def test_mx_activation_config_is_validated():
    with pytest.raises(ValueError, match="MXINT activation bits"):
        ActQuantConfig(5, format="mxint").validate()
    with pytest.raises(ValueError, match="no clipping"):
        ActQuantConfig(4, clip_ratio=None, format="mxint").validate()
    with pytest.raises(ValueError, match="activation format"):
        ActQuantConfig(4, format="fp4").validate()


def test_recipe_defaults_for_mxint():
    r = Recipe("mxsens", a_bits=4, kv_bits=4)
    assert (r.solver, r.group_size, r.a_format) == ("mxint", 32, "mxint")
    assert r.kv_config().format == "mxint" and r.needs_calibration
    assert Recipe("rtn").group_size == 128 and Recipe("rtn").a_format == "int"
    assert not Recipe("mxint").needs_calibration
    with pytest.raises(ValueError, match="unsupported weight bits 3"):
        Recipe("mxint", w_bits=3)
    with pytest.raises(ValueError, match="group size 128"):
        Recipe("mxint", group_size=128)


# ---------------------------------------------------------------- solvers
def test_uniform_mxint_solver_and_error_feedback(real_linears):
    solver = get_solver("mxint")
    for name, w, stats in real_linears[:4]:
        rtn = solver(w, stats, LayerSpec(4, 32, True))
        assert rtn.describe() == f"mxint 4:{w.shape[1]}" and rtn.perm is None
        fed = solver(w, stats, LayerSpec(4, 32, True), {"error_feedback": True, "order": "hessian"})
        e_rtn = relative_error(w, rtn.dequantize(), stats.hessian)
        e_fed = relative_error(w, fed.dequantize(), stats.hessian)
        assert e_fed < e_rtn, name


def test_classes_in_hessian_order_put_the_top_columns_at_8_bits(real_linears):
    name, w, stats = real_linears[1]
    k = w.shape[1]
    fmt = get_solver("mxint")(w, stats, LayerSpec(4, 32), {"classes": ((8, 32), (6, 64), (4, k - 96)),
                                                           "order": "hessian"})
    top = torch.topk(torch.diagonal(stats.hessian), 32).indices
    assert set(fmt.perm[:32].tolist()) == set(top.tolist())
    uniform = get_solver("mxint")(w, stats, LayerSpec(4, 32))
    assert relative_error(w, fmt.dequantize(), stats.hessian) < relative_error(w, uniform.dequantize(), stats.hessian)
    with pytest.raises(ValueError, match="adding up to"):
        get_solver("mxint")(w, stats, LayerSpec(4, 32), {"classes": ((8, 32), (4, 32))})


# ---------------------------------------------------------------- allocation
def _shapes():
    return {"a": LinearShape(576, 576, 4), "b": LinearShape(1536, 576, 4), "c": LinearShape(576, 1536, 4),
            "d": LinearShape(192, 576, 4)}


@pytest.mark.parametrize("target", [4.2, 4.5, 5.0, 5.6])
def test_allocation_hits_the_target_within_one_block_per_layer(target):
    shapes = _shapes()
    weights = {"a": 0.2, "b": 1.0, "c": 2.5, "d": 0.3}
    classes, r = allocate(shapes, weights, target)
    achieved = element_bits(shapes, classes)
    assert abs(achieved - target) <= max((6 - 4) * BLOCK / s.in_features for s in shapes.values())
    for n, cls in classes.items():
        assert cls[0] == (8, 32) and sum(c for _, c in cls) == shapes[n].in_features
        assert all(c % BLOCK == 0 and c >= 0 for _, c in cls)
    mids = {n: cls[1][1] for n, cls in classes.items()}
    assert mids["c"] / 1504 >= mids["b"] / 544 >= mids["a"] / 544  # more sensitive, larger middle share


def test_allocation_needs_widths_in_order():
    shapes = {"a": LinearShape(64, 576, 6)}
    with pytest.raises(ValueError, match="base bits < middle_bits"):
        allocate(shapes, {"a": 1.0}, 6.5)


def test_allocation_out_of_reach_is_an_error():
    with pytest.raises(ValueError, match="out of reach"):
        allocate(_shapes(), dict.fromkeys("abcd", 1.0), 4.0)
    with pytest.raises(ValueError, match="out of reach"):
        allocate(_shapes(), dict.fromkeys("abcd", 1.0), 7.0)


# ---------------------------------------------------------------- the method on the default model
@pytest.fixture(scope="module")
def short_smollm(smollm):
    """The default model cut to its first 4 blocks (the allocation comparison in seconds, not minutes)."""
    model = copy.deepcopy(smollm[0])
    model.model.layers = model.model.layers[:4]
    model.config.num_hidden_layers = 4
    return model


def _output_error(model, reference, ids):
    from bitquilt.api import quantize  # noqa: F401  (import check only)

    with torch.no_grad():
        out = model.model(ids).last_hidden_state
    return float((out - reference).pow(2).sum() / reference.pow(2).sum())


def test_sensitivity_allocation_beats_random_and_the_4_8_split(short_smollm, calib_ids, tmp_path, monkeypatch):
    from bitquilt.api import quantize

    monkeypatch.setenv("BITQUILT_CACHE", str(tmp_path))
    held_out = calib_ids[8:12]
    with torch.no_grad():
        reference = short_smollm.model(held_out).last_hidden_state
    errors, bits = {}, {}
    for label, options in {"mxsens": {}, "random": {"columns": "random"}, "split48": {"middle_bits": 8}}.items():
        model = copy.deepcopy(short_smollm)
        report = quantize(model, Recipe("mxsens", stage_options={"mx_sens": {"target_bits": 4.6, "samples": 2,
                                                                             **options}}),
                          calib_ids[:8], progress=False)
        bits[label] = report.plan["decisions"]["mx_sens"]["element_bits"]
        errors[label] = _output_error(model, reference, held_out)
    assert all(abs(b - 4.6) < 0.12 for b in bits.values()), bits
    assert errors["mxsens"] < errors["random"] and errors["mxsens"] < errors["split48"], errors


# ---------------------------------------------------------------- save/load and the command line
def test_mxsens_w4a4kv4_save_load_is_bit_exact(tmp_path, monkeypatch):
    from bitquilt.api import quantize
    from bitquilt.nn.quant_linear import QuantLinear

    monkeypatch.setenv("BITQUILT_CACHE", str(tmp_path / "cache"))
    model = make_tiny("qwen2")  # k/v biases: key centres too
    ids = torch.randint(0, 320, (6, 32), generator=torch.Generator().manual_seed(1))
    report = quantize(model, Recipe("mxsens", a_bits=4, kv_bits=4, stage_options={"mx_sens": {"target_bits": 5.2}}),
                      ids, progress=False)
    assert abs(report.plan["decisions"]["mx_sens"]["element_bits"] - 5.2) < 0.25
    loaded = reload_bit_exact(model, ids[:2], tmp_path / "q")
    for (name, a), (_, b) in zip(model.named_modules(), loaded.named_modules()):
        if isinstance(a, QuantLinear):
            assert a.fmt.describe() == b.fmt.describe(), name
            assert all(torch.equal(t, b.fmt.tensors()[k]) for k, t in a.fmt.tensors().items())


def _cli(capsys, *argv):
    from bitquilt.cli import main

    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


ONE_BLOCK = ["--skip", "model.layers.[1-9].*", "--skip", "model.layers.[12]?.*", "--calib-samples", "4",
             "--calib-seqlen", "128"]


def test_cli_quantize_and_compare_mxsens(tmp_path, capsys, monkeypatch):
    import json

    code, stdout, err = _cli(capsys, "quantize", "smollm2-135m", "--method", "mxsens", "--target-bits", "4.6",
                             "--a-bits", "4", "--kv-bits", "4", *ONE_BLOCK, "-o", tmp_path / "mxs", "--json")
    assert code == 0, err
    code, stdout, _ = _cli(capsys, "inspect", tmp_path / "mxs", "--json")
    info = json.loads(stdout)
    assert info["summary"]["layers"] == 7 and all(r["format"].startswith("mxint 8:32/") for r in info["layers"])
    code, stdout, err = _cli(capsys, "compare", "smollm2-135m", "--methods", "mxint,mxsens", "--w-bits", "4",
                             "--target-bits", "4.6,5", "--a-bits", "4", "--kv-bits", "4", *ONE_BLOCK,
                             "--seqlen", "128", "--ppl-windows", "2", "--json")
    assert code == 0, err
    rows = json.loads(stdout)["rows"]
    assert [(r["method"], r.get("target_bits")) for r in rows] == [("mxint", None), ("mxsens", 4.6), ("mxsens", 5)]
    assert rows[1]["bits_per_weight"] < rows[2]["bits_per_weight"]


@pytest.mark.parametrize("args, message", [
    (["--method", "gptq", "--target-bits", "4.5"], "--target-bits applies to methods with a bit budget"),
    (["--method", "mxsens", "--target-bits", "3"], "out of reach"),
    (["--method", "mxint", "--w-bits", "5"], "unsupported weight bits 5 by solver 'mxint'; supported: 4, 6, 8"),
    (["--method", "mxsens", "--a-bits", "4", "--a-clip", "search"], "MXINT activations take no clipping"),
])
def test_cli_bad_mxsens_input(tmp_path, capsys, args, message):
    code, _, err = _cli(capsys, "quantize", "smollm2-135m", *args, *ONE_BLOCK, "-o", tmp_path / "q")
    last = err.strip().splitlines()[-1]  # (the model loads before its shapes can rule out a target)
    assert code == 2 and message in last and last.startswith("bitquilt quantize: error:"), err
    assert not (tmp_path / "q").exists()


def test_down_proj_permutation_folds_into_gate_and_up_rows_exactly(tmp_path, monkeypatch):
    from bitquilt.api import quantize

    monkeypatch.setenv("BITQUILT_CACHE", str(tmp_path))
    ids = torch.randint(0, 320, (6, 32), generator=torch.Generator().manual_seed(2))
    logits = {}
    for method in ("mx_sens+mxint", "mxsens"):  # mxsens = mx_sens+fold_perm+mxint
        model = make_tiny("llama")
        report = quantize(model, Recipe(method, a_bits=4, kv_bits=4, stage_options={"mx_sens": {"target_bits": 5.2}}),
                          ids, progress=False)
        with torch.no_grad():
            logits[method] = model(ids[:2]).logits
        mlp = model.model.layers[0].mlp
        assert (mlp.down_proj.fmt.perm is None) == (method == "mxsens")
        assert mlp.gate_proj.fmt.perm is not None  # the residual-stream readers keep their gather
    assert torch.equal(logits["mxsens"], logits["mx_sens+mxint"])
    assert "fold_perm" in report.stages
