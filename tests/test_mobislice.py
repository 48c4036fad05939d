"""MoBiSlice: recursive residual bit slices in one checkpoint, served at any number of slices."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny, reload_bit_exact

from bitquilt.formats.composite import CompositeFormat
from bitquilt.nn.quant_linear import set_slices
from bitquilt.recipes import Recipe
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec
from bitquilt.solvers.mobislice import quantize_slice, slice_bits


def _relative(approx, w) -> float:
    return float((approx - w).pow(2).sum() / w.pow(2).sum())


@pytest.mark.parametrize("slices", [(), (2, 2, 2), (3, 1)])
def test_error_falls_with_every_slice_and_storage_is_slice_bits_plus_coefficients(real_linears, slices):
    _, weight, _ = real_linears[3]
    total = sum(slices) or 8
    fmt = get_solver("mobislice")(weight, None, LayerSpec(total, 128), {"slices": slices})
    assert isinstance(fmt, CompositeFormat) and len(fmt.parts) == len(slice_bits(total, slices))
    errors = [_relative(fmt.dequantize(k), weight) for k in range(1, len(fmt.parts) + 1)]
    assert all(b < a for a, b in zip(errors, errors[1:]))
    assert torch.equal(fmt.dequantize(), fmt.dequantize(len(fmt.parts)))
    widths = slice_bits(total, slices)
    assert fmt.bits_per_weight() == pytest.approx(sum(b + 16 * (b + 1) / 128 for b in widths))


def test_all_slices_reconstruct_the_weight_to_the_finest_step(real_linears):
    """On plain min-max grids every weight ends within half a step of the last slice (plus the fp16
    rounding of the coefficients); the refitted slices are closer still on average."""
    _, weight, _ = real_linears[0]
    plain = get_solver("mobislice")(weight, None, LayerSpec(8, 64), {"slices": (4, 4), "iters": 0})
    step = plain.parts["s2"].coeffs.float()[..., 1].repeat_interleave(64, dim=1)  # C_1: the last slice's step
    error = (plain.dequantize() - weight).abs()
    assert (error <= 0.5 * step + 1e-3 * weight.abs().max()).all()
    fitted = get_solver("mobislice")(weight, None, LayerSpec(8, 64), {"slices": (4, 4)})
    assert _relative(fitted.dequantize(), weight) < _relative(plain.dequantize(), weight) < 1e-4


def test_lloyd_refits_beat_the_plain_grid_and_a_slice_is_a_bitplane_weight(real_linears):
    _, weight, _ = real_linears[1]
    plain, fitted = (quantize_slice(weight, 2, 64, iters) for iters in (0, 3))
    assert _relative(fitted.dequantize(), weight) < 0.8 * _relative(plain.dequantize(), weight)
    assert fitted.name == "bitplane" and fitted.bits == 2


def test_bad_slices_are_refused_clearly():
    with pytest.raises(ValueError, match="slices \\[2, 2\\] sum to 4 bits, but the weight has 6"):
        get_solver("mobislice")(torch.randn(8, 64), None, LayerSpec(6, 64), {"slices": (2, 2)})
    with pytest.raises(ValueError, match="slice widths must be in"):
        Recipe("mobislice", w_bits=6, options={"slices": (5, 1)})
    with pytest.raises(ValueError, match="unsupported weight bits 1 by solver 'mobislice'"):
        Recipe("mobislice", w_bits=1)
    with pytest.raises(ValueError, match="no multi-part"):
        set_slices(make_tiny("llama"), 2)


def test_one_checkpoint_serves_every_precision_and_reloads_bit_exact(tmp_path):
    from bitquilt.api import quantize
    from bitquilt.io import load_quantized

    model = make_tiny("llama")
    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model.model(ids).last_hidden_state
    quantize(model, Recipe("mobislice", w_bits=6, group_size=32), None, progress=False)
    errors, bits = [], []
    for k in (1, 2, 3, 4, 5):
        bits.append(set_slices(model, k))
        with torch.no_grad():
            errors.append(_relative(model.model(ids).last_hidden_state, reference))
    assert bits == [2, 3, 4, 5, 6] and all(b < a for a, b in zip(errors, errors[1:]))
    assert set_slices(model, None) == 6
    loaded = reload_bit_exact(model, ids, tmp_path / "mobi")
    set_slices(loaded, 2)
    set_slices(model, 2)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert load_quantized(tmp_path / "mobi")[0] is not None
