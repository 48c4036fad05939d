"""Block-wise reconstruction: learnable stand-ins start at the solver's result and pack back into its format,
the shared fitting loop lowers the block's output error deterministically, and the engine stage improves RTN
and GPTQ on real blocks while keeping saved models bit-exact."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import block_context, make_tiny, reload_bit_exact

from bitquilt.calib.capture import run_block
from bitquilt.calib.compute import FP32_CPU, CalibCompute, calibrating
from bitquilt.calib.learnable import (
    LearnableBitplane,
    LearnableGGML,
    LearnableLinear,
    LearnableRounding,
    LearnableUniform,
    learnable,
    round_ste,
)
from bitquilt.calib.reconstruct import REPORT_WINDOWS, FitConfig, block_error, fit_block, report_windows
from bitquilt.formats.ggml_blocks import TYPES
from bitquilt.formats.mxint import MXIntFormat
from bitquilt.recipes import Recipe
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec

GPTQ_PLAIN = {"act_order": False, "static_groups": False, "mse": False}


def _solved(weight, stats, solver, bits=3, group_size=64, sym=False, **options):
    return get_solver(solver)(weight, stats, LayerSpec(bits, group_size, sym), options)


def test_round_ste_rounds_forward_and_passes_gradients():
    x = torch.tensor([0.2, 0.7, -1.6], requires_grad=True)
    y = round_ste(x)
    y.sum().backward()
    assert torch.equal(y.detach(), torch.tensor([0.0, 1.0, -2.0]))
    assert torch.equal(x.grad, torch.ones(3))


@pytest.mark.parametrize("solver, sym, options", [
    ("rtn", False, {}), ("rtn", True, {}), ("gptq", False, GPTQ_PLAIN),
    ("gptq", False, {"act_order": True, "static_groups": False}),  # g_idx: groups in act order
])
def test_uniform_stand_in_starts_at_the_solvers_result_and_packs_back_unchanged(real_linears, solver, sym, options):
    _, weight, stats = real_linears[1]
    fmt = _solved(weight, stats, solver, sym=sym, **options)
    stand_in = learnable(weight, fmt)
    assert isinstance(stand_in, LearnableUniform)
    assert torch.equal(stand_in().detach(), fmt.dequantize())
    packed = stand_in.to_format()
    assert packed.describe() == fmt.describe() and packed.bits_per_weight() == fmt.bits_per_weight()
    assert torch.equal(packed.codes(), fmt.codes()) and torch.equal(packed.scales, fmt.scales)
    assert (packed.zeros is None) == sym and (sym or torch.equal(packed.zeros, fmt.zeros))


def _push_out_of_range_and_project(stand_in):
    """Move V and the range factors far out of their ranges; projecting puts them back at the bounds."""
    with torch.no_grad():
        stand_in.v.add_(torch.randn_like(stand_in.v) * 3)
        stand_in.alpha.fill_(0.1)
        stand_in.beta.fill_(2.0)
    stand_in.project_()
    assert (stand_in.v - stand_in.v0).abs().max() <= 0.5
    assert stand_in.alpha.min() == LearnableRounding.CLIP_MIN and stand_in.beta.max() == 1.0


def test_uniform_stand_in_moves_each_code_at_most_one_step_and_keeps_the_clip_range(real_linears):
    _, weight, _ = real_linears[2]
    fmt = _solved(weight, None, "rtn", bits=2)
    stand_in = learnable(weight, fmt)
    _push_out_of_range_and_project(stand_in)
    packed = stand_in.to_format()
    assert packed.codes().max() <= 3 and packed.describe() == fmt.describe()
    assert torch.equal(packed.dequantize(), stand_in().detach())  # what it packs is what it computed


def test_bitplane_stand_in_learns_coefficients_over_fixed_planes(real_linears):
    _, weight, stats = real_linears[0]
    fmt = _solved(weight, stats, "bpdq", bits=2)
    stand_in = learnable(weight, fmt)
    assert isinstance(stand_in, LearnableBitplane)
    assert torch.allclose(stand_in().detach(), fmt.dequantize())
    with torch.no_grad():  # C = C⁰ + |C⁰₁|·D: offsets of C⁰/2 in step units scale every coefficient by 1.5
        stand_in.offsets.copy_(0.5 * stand_in.c0 / stand_in.unit)
    packed = stand_in.to_format()
    assert torch.equal(packed.planes, fmt.planes) and packed.bits_per_weight() == fmt.bits_per_weight()
    expected = 1.5 * fmt.dequantize()  # up to the fp16 rounding of the scaled coefficients
    assert torch.allclose(packed.dequantize(), expected, atol=2e-3 * expected.abs().max())


@pytest.mark.parametrize("name", list(TYPES))
def test_ggml_stand_in_starts_at_the_solvers_blocks_and_packs_what_it_computes(real_linears, name):
    _, weight, stats = real_linears[1]
    fmt = _solved(weight, stats, "gguf_gptq", ggml_type=name)
    stand_in = learnable(weight, fmt)
    assert isinstance(stand_in, LearnableGGML)
    assert torch.equal(stand_in().detach(), fmt.dequantize()) and torch.equal(stand_in.to_format().blocks, fmt.blocks)
    _push_out_of_range_and_project(stand_in)
    packed = stand_in.to_format()
    assert packed.type == fmt.type and packed.nbytes() == fmt.nbytes()
    assert torch.equal(packed.fields().sc, fmt.fields().sc)  # the sub-block scales stay as the search chose them
    assert torch.equal(packed.dequantize(), stand_in().detach())


def test_formats_without_a_stand_in_are_left_alone(real_linears):
    _, weight, _ = real_linears[0]
    assert learnable(weight, MXIntFormat.quantize(weight, [4], [weight.shape[1]])) is None


# ---------------------------------------------------------------- the fitting loop on one block
def _tiny_block():
    """Block 0 of a tiny random llama with RTN 2-bit stand-ins in its linears, its inputs and fp targets."""
    model = make_tiny("llama")
    ids = torch.randint(0, 320, (6, 32), generator=torch.Generator().manual_seed(0))
    ctx = block_context(model, Recipe("rtn"), ids)
    targets = run_block(ctx.block, ctx.inputs, ctx.kwargs)
    stand_ins = []
    for name in ctx.arch.linear_names():
        linear = ctx.block.get_submodule(name)
        stand_in = learnable(linear.weight, _solved(linear.weight.detach(), None, "rtn", bits=2, group_size=32))
        ctx.block.set_submodule(name, LearnableLinear(stand_in, linear.bias))
        stand_ins.append(stand_in)
    return ctx, targets, stand_ins


@pytest.mark.parametrize("optimizer", ["signsgd", "adam"])
def test_fit_block_lowers_the_output_error_and_is_deterministic(optimizer):
    results, states = [], []
    for _ in range(2):
        ctx, targets, stand_ins = _tiny_block()
        params = [p for s in stand_ins for p in s.parameters()]
        config = FitConfig(steps=15, batch=2, optimizer=optimizer, lr=None if optimizer == "signsgd" else 5e-3)
        result = fit_block(ctx.block, ctx.inputs, targets, ctx.kwargs, params, config,
                           project=lambda s=stand_ins: [x.project_() for x in s])
        assert result.loss_after == pytest.approx(block_error(ctx.block, ctx.inputs, targets, ctx.kwargs))
        results.append(result)
        states.append([p.detach().clone() for p in params])
    assert results[0].loss_after < 0.9 * results[0].loss_before
    assert results[0].loss_after == results[1].loss_after
    assert all(torch.equal(a, b) for a, b in zip(*states))


def test_the_loss_is_reported_on_every_window_or_an_even_sample():
    assert report_windows(5) == [0, 1, 2, 3, 4]
    picked = report_windows(128)
    assert len(picked) == REPORT_WINDOWS == len(set(picked)) and picked == sorted(picked)
    assert (picked[0], picked[-1]) == (0, 127) and max(b - a for a, b in zip(picked, picked[1:])) <= 9


def test_fit_block_with_no_steps_changes_nothing():
    ctx, targets, stand_ins = _tiny_block()
    params = [p for s in stand_ins for p in s.parameters()]
    before = [p.detach().clone() for p in params]
    result = fit_block(ctx.block, ctx.inputs, targets, ctx.kwargs, params, FitConfig(steps=0))
    assert result.loss_after == result.loss_before
    assert all(torch.equal(a, b) for a, b in zip(before, params))


def test_fit_block_trains_on_the_inputs_step_inputs_gives_and_measures_on_its_own():
    ctx, targets, stand_ins = _tiny_block()
    params = [p for s in stand_ins for p in s.parameters()]
    other = [x.flip(-1) for x in ctx.inputs]  # another stream, windows at the same positions
    seen = []
    hook = ctx.block.register_forward_pre_hook(lambda _m, args, _kw=None: seen.append(args[0].detach().clone()))
    try:
        result = fit_block(ctx.block, ctx.inputs, targets, ctx.kwargs, params, FitConfig(steps=3, batch=1),
                           step_inputs=lambda: other)
    finally:
        hook.remove()
    n = len(ctx.inputs)
    training = seen[n:n + 3]  # after the error before: one window per step
    assert all(any(torch.equal(x, o) for o in other) for x in training)
    assert not any(torch.equal(x, i) for x in training for i in ctx.inputs)
    assert result.loss_after == pytest.approx(block_error(ctx.block, ctx.inputs, targets, ctx.kwargs))


# ---------------------------------------------------------------- the stage in the engine
def _output_error(model, reference, ids) -> float:
    with torch.no_grad():
        return float((model.model(ids).last_hidden_state - reference).pow(2).mean())


def test_recon_improves_rtn_on_a_tiny_model_and_saves_bit_exact(tmp_path):
    from bitquilt.api import quantize

    model = make_tiny("llama")
    ids = torch.randint(0, 320, (8, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model.model(ids).last_hidden_state
    errors, formats = {}, {}
    for steps in (0, 20):
        m = copy.deepcopy(model)
        report = quantize(m, Recipe("rtn", w_bits=2, group_size=32, recon_steps=steps,
                                    stage_options={"recon": {"batch": 4}} if steps else {}), ids, progress=False)
        errors[steps] = _output_error(m, reference, ids)
        formats[steps] = [r.format for r in report.linears]
    assert errors[20] < 0.8 * errors[0]
    assert formats[20] == formats[0]
    assert set(report.stages["recon"]) == {"model.layers.0", "model.layers.1"}
    assert report.recipe["stage_options"]["recon"]["steps"] == 20
    reload_bit_exact(m, ids[:2], tmp_path / "recon")


def test_recon_trains_through_quantized_activations_and_rotations():
    """W4A4KV4 after QuaRot: gradients pass the activation quantizers (straight-through) and the
    online Hadamard transforms, so every linear of the block moves."""
    from bitquilt.api import quantize

    model = make_tiny("llama")
    ids = torch.randint(0, 320, (8, 32), generator=torch.Generator().manual_seed(2))
    report = quantize(model, Recipe("quarot+rtn", w_bits=4, group_size=32, a_bits=4, kv_bits=4, recon_steps=10,
                                    stage_options={"recon": {"batch": 4}}), ids, progress=False)
    for block in report.stages["recon"].values():
        assert block["loss_after"] < block["loss_before"]


def _block_losses(smollm, calib_ids, solver, options, steps, compute=FP32_CPU, recon_options=(), **grid):
    """(before, after) output error of block 3 of smollm2-135m at W3g128 (or `grid`'s recipe fields): `solver`, then
    `steps` of reconstruction (`recon_options`), all in `compute`'s precision; and the error after measured in fp32
    against the fp32 block's outputs."""
    from bitquilt.stages.recon import fp_reference, recon

    recipe = Recipe(solver, **(grid or {"w_bits": 3, "group_size": 128}), options=options, recon_steps=steps,
                    stage_options={"recon": {"batch": 2, **dict(recon_options)}})
    ctx = block_context(copy.deepcopy(smollm[0]), recipe, calib_ids[:4], index=3)
    fp32_targets = run_block(ctx.block, ctx.inputs, ctx.kwargs)
    stages = {s.name: (s, o) for s, o in recipe.stages()}
    with calibrating(compute):
        fp_reference(ctx, stages["fp_reference"][1])
        for shared in ctx.arch.shared_inputs:
            ctx.linears = shared.linears
            stages["solve"][0].fn(ctx, stages["solve"][1])
        result = recon(ctx, stages["recon"][1])
    return result["loss_before"], result["loss_after"], block_error(ctx.block, ctx.inputs, fp32_targets, ctx.kwargs)


def test_recon_beats_rtn_on_a_block_of_the_default_model(smollm, calib_ids):
    before, after, _ = _block_losses(smollm, calib_ids, "rtn", {}, steps=12)
    assert after < 0.7 * before


def test_recon_in_bf16_loses_little_against_fp32_on_a_block_of_the_default_model(smollm, calib_ids):
    """The bound of reconstruction in bf16 (autocast products, fp32 parameters): on a real block its result's output
    error, measured in fp32, is within 10% of the fp32 fit's and still far below RTN's."""
    before, _, fp32_after = _block_losses(smollm, calib_ids, "rtn", {}, steps=12)
    bf16 = CalibCompute("bf16", "cpu", "test")
    _, _, bf16_after = _block_losses(smollm, calib_ids, "rtn", {}, steps=12, compute=bf16)
    assert bf16_after < 1.1 * fp32_after and bf16_after < 0.7 * before


def test_recon_on_llama_cpps_q2_k_blocks_improves_gptq_on_them(smollm, calib_ids):
    """With --gguf-type the stand-ins are llama.cpp's blocks (Q2_K, Q3_K for down_proj, Q4_0 for rows of 576): 12
    small steps of the rounding alone from GPTQ's codes on that grid lower the block's output error by a tenth."""
    before, after, _ = _block_losses(smollm, calib_ids, "gptq", {}, steps=12, gguf_type="Q2_K",
                                     recon_options={"lr": 0.01, "clip": False})
    assert after < 0.9 * before


@pytest.mark.slow
def test_recon_beats_gptq_on_a_block_of_the_default_model(smollm, calib_ids):
    before, after, _ = _block_losses(smollm, calib_ids, "gptq", GPTQ_PLAIN, steps=25)
    assert after < before


@pytest.mark.parametrize("stream", ["fp", "quantized", "mixed"])
def test_reference_targets_follow_the_stream(stream):
    """fp: the fp block on the fp trajectory (the previous block's fp outputs); quantized: on the block's own
    (quantized-stream) inputs; mixed: mix · the first + (1 − mix) · the second. The fp trajectory is passed on
    whatever the blend."""
    from bitquilt.stages.recon import REFERENCE, fp_reference

    model = make_tiny("llama")
    ids = torch.randint(0, 320, (4, 16), generator=torch.Generator().manual_seed(3))
    recipe = Recipe("rtn", w_bits=4, group_size=32, recon_steps=2,
                    stage_options={"fp_reference": {"stream": stream, "mix": 0.25}})
    ctx = block_context(model, recipe, ids, index=1)
    fp_trajectory = [x + 0.1 * torch.randn_like(x) for x in ctx.inputs]  # differs from the quantized stream
    ctx.scratch[REFERENCE] = {"index": 0, "fp_outputs": fp_trajectory}
    fp_reference(ctx, {s.name: o for s, o in recipe.stages()}["fp_reference"])
    on_fp, on_own = run_block(ctx.block, fp_trajectory, ctx.kwargs), run_block(ctx.block, ctx.inputs, ctx.kwargs)
    assert not torch.allclose(on_fp[0], on_own[0], atol=1e-3)
    expected = {"fp": on_fp, "quantized": on_own, "mixed": [0.25 * a + 0.75 * b for a, b in zip(on_fp, on_own)]}
    reference = ctx.scratch[REFERENCE]
    for got, want in zip(reference["targets"], expected[stream]):
        assert torch.allclose(got, want, atol=1e-6)
    if stream == "quantized":
        assert reference["fp_outputs"] is None
    else:
        for got, want in zip(reference["fp_outputs"], on_fp):
            assert torch.equal(got, want)


def test_recon_options_are_checked_when_the_recipe_is_built():
    with pytest.raises(ValueError, match="recon_steps must be ≥ 0"):
        Recipe("rtn", recon_steps=-1)
    with pytest.raises(ValueError, match="unknown reconstruction optimizer 'sgd'"):
        Recipe("rtn", recon_steps=5, stage_options={"recon": {"optimizer": "sgd"}})
    with pytest.raises(ValueError, match="stream must be fp, quantized or mixed"):
        Recipe("rtn", recon_steps=5, stage_options={"fp_reference": {"stream": "x"}})
    with pytest.raises(ValueError, match="mix must lie strictly between 0 and 1"):
        Recipe("rtn", recon_steps=5, stage_options={"fp_reference": {"stream": "mixed", "mix": 1.0}})
    with pytest.raises(ValueError, match="does not run"):
        Recipe("rtn", stage_options={"recon": {"batch": 2}})
    assert Recipe("awq+gptq", recon_steps=50).label() == "awq+gptq w4g128 recon50"


def test_cli_quantize_with_reconstruction(tmp_path, capsys):
    import json

    from bitquilt.cli import main

    one_block = ["--skip", "model.layers.[1-9].*", "--skip", "model.layers.[12]?.*", "--calib-samples", "4",
                 "--calib-seqlen", "64"]
    code = main(["quantize", "smollm2-135m", "--method", "rtn", "--w-bits", "3", "--recon-steps", "3",
                 "--opt", "recon.batch=2", *one_block, "-o", str(tmp_path / "rec")])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert main(["inspect", str(tmp_path / "rec"), "--json"]) == 0
    recipe = json.loads(capsys.readouterr().out)["summary"]["recipe"]
    assert recipe["recon_steps"] == 3 and recipe["stage_options"]["recon"]["batch"] == 2
    code = main(["quantize", "smollm2-135m", "--method", "rtn", "--recon-steps", "3", "--opt", "recon.optimizer=sgd",
                 *one_block, "-o", str(tmp_path / "bad")])
    _, err = capsys.readouterr()
    assert code != 0 and "unknown reconstruction optimizer 'sgd'" in err and not (tmp_path / "bad").exists()
