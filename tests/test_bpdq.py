import itertools

import pytest
import torch

from bitquilt.formats import BitplaneFormat, format_class
from bitquilt.formats.bitplane import combine
from bitquilt.solvers import LayerSpec, LinearStats, get_solver, hessian_error
from bitquilt.solvers.bpdq import BPDQOptions, bit_patterns, bpdq_sweep, code_planes, nearest_level
from bitquilt.solvers.hessian import prepare_hessian


def _stats(d: int, n: int = 4096, seed: int = 0) -> LinearStats:
    """Correlated activations with uneven channel scales, like a real layer's input."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(d) + 0.3 * torch.randn(d, d, generator=g) / d**0.5
    x = (torch.randn(n, d, generator=g) @ mix) * torch.linspace(0.2, 3.0, d)
    stats = LinearStats.empty(d)
    stats.update(x)
    return stats


def _err(layer, method: str, spec: LayerSpec, **options) -> float:
    _, w, stats = layer
    fmt = get_solver(method)(w, stats, spec, options)
    return hessian_error(w, fmt.dequantize(), stats.hessian)


# Where GPTQ (act-order, MSE grids) is ahead: layer 0's down projection, whose input Hessian holds its mass in a few
# columns (smollm2's massive activations), at 3 and 4 bits in groups of 128. GPTQ's act-order runs those columns
# first across the whole row; BPDQ's keeps each group's columns together. Measured 2026-12-05: BPDQ 1.09x / 1.14x
# GPTQ's error (3 / 4 bits), against 0.56-0.99x on every other layer and setting here.
GPTQ_AHEAD = {("layers.0.mlp.down_proj", 3, 128): 1.2, ("layers.0.mlp.down_proj", 4, 128): 1.2}


def _check_beats_gptq(layers, bits: int, group_size: int) -> None:
    for layer in layers:
        bpdq = _err(layer, "bpdq", LayerSpec(bits, group_size))
        gptq = _err(layer, "gptq", LayerSpec(bits, group_size))
        bound = GPTQ_AHEAD.get((layer[0], bits, group_size), 0.9 if bits == 2 else 1.0) * gptq
        assert bpdq <= bound, f"{layer[0]} w{bits} g{group_size}: BPDQ {bpdq:.4g} vs GPTQ {gptq:.4g}"


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_bpdq_beats_gptq_on_real_layers(real_linears, bits):
    _check_beats_gptq(real_linears[:2], bits, 128)  # 576 wide: four groups of 128 and a ragged one of 64


@pytest.mark.slow
@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_bpdq_against_gptq_on_all_real_layers(real_linears, bits, group_size):
    _check_beats_gptq(real_linears, bits, group_size)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_uniform_grid_as_bitplanes(bits, sym):
    torch.manual_seed(bits)
    w = torch.randn(64, 288) * torch.rand(64, 1)
    u = get_solver("rtn")(w, None, LayerSpec(bits, 64, sym))  # 4 groups of 64 and a ragged one of 32
    b = BitplaneFormat.from_uniform(u)
    codes = u.codes().long()
    assert all(torch.equal(b.unpacked_planes()[i].long(), (codes >> i) & 1) for i in range(bits))
    if sym:  # C0 = −s·2^(k−1) is exact in fp16: bit-for-bit the uniform result
        assert torch.equal(b.dequantize(), u.dequantize())
        return
    # asym: C0 = −s·z is fp16-rounded when s·z needs more than 11 significant bits; each group
    # is then shifted by at most half an fp16 ulp of s·z, and is exact wherever s·z is exact
    s_z = u.scales.float() * u.zeros.float()
    exact = s_z.half().float() == s_z
    half_ulp = (torch.finfo(torch.float16).eps / 2) * s_z.abs()
    diff = torch.stack([d.amax(dim=1) for d in (b.dequantize() - u.dequantize()).abs().split(64, dim=1)], dim=1)
    assert (diff <= half_ulp).all() and (diff[exact] == 0).all()


@pytest.mark.parametrize("k", [2, 3, 4])
def test_nearest_level_is_exact(k):
    torch.manual_seed(k)
    coeffs = torch.randn(200, k + 1)  # signed coefficients: levels unsorted, not evenly spaced
    patterns = bit_patterns(k)
    levels = coeffs[:, :1] + coeffs[:, 1:] @ patterns
    w = torch.randn(200) * 2
    idx = nearest_level(w, levels)
    for r in range(200):
        c = coeffs[r].tolist()
        brute = min(abs(w[r].item() - c[0] - sum(ci * bi for ci, bi in zip(c[1:], b)))
                    for b in itertools.product((0, 1), repeat=k))
        assert (w[r] - levels[r, idx[r]]).abs().item() == pytest.approx(brute, abs=1e-6)
    # pattern p holds the bits of p, plane 0 least significant
    assert all(int(patterns[i, p]) == (p >> i) & 1 for i in range(k) for p in range(2**k))


@pytest.mark.parametrize("delta", [True, False])
def test_delta_correction_keeps_propagated_errors_consistent(delta):
    torch.manual_seed(0)
    stats = _stats(128)
    prep, w = prepare_hessian(stats.hessian, torch.randn(48, 128), damp=0.01)
    res = bpdq_sweep(w.clone(), prep.hinv_u, 2, 32, BPDQOptions(n_iters=3), delta_correction=delta)
    # the sweep's invariant W = Q + E·U, i.e. E recomputed from scratch for the final Q
    scratch = torch.linalg.solve_triangular(prep.hinv_u, w - res.Q, upper=True, left=False)
    gap = (res.E - scratch).abs().max().item()
    if delta:
        assert gap < 1e-4 * scratch.abs().max().item()
        # ‖E‖² is then the damped objective tr((W − Ŵ)(H + λI)(W − Ŵ)ᵀ) the iterations minimise
        damped = stats.hessian + prep.damp * stats.hessian.diagonal().mean() * torch.eye(128)
        assert res.E.square().sum().item() == pytest.approx(hessian_error(w, res.Q, damped), rel=1e-4)
    else:
        assert gap > 1e-2 * scratch.abs().max().item()


def test_solver_output_dequantizes_to_its_sweep_bit_for_bit():
    torch.manual_seed(1)
    stats = _stats(64)
    w = torch.randn(16, 64)
    fmt = get_solver("bpdq")(w, stats, LayerSpec(3, 32), {"reorder": False})
    prep, wp = prepare_hessian(stats.hessian, w, 0.01)
    res = bpdq_sweep(wp, prep.hinv_u, 3, 32, BPDQOptions(reorder=False))
    assert torch.equal(fmt.dequantize(), res.Q)
    assert torch.equal(fmt.coeffs.float(), res.coeffs)


@pytest.mark.parametrize("reorder", [True, False])
def test_representable_weights_are_recovered_in_original_order(reorder):
    # every (row, group) uses all 4 levels of a 2-plane grid with fp16 coefficients: BPDQ must find
    # them, whatever order it sweeps the columns in; 160 columns at g64: a ragged last group of 32
    torch.manual_seed(2)
    rows, cols, g = 8, 160, 64
    step = torch.rand(rows, 3) + 0.5
    coeffs = torch.stack([-1.5 * step, step, 2 * step], dim=-1).half().float()
    codes = torch.randint(0, 4, (rows, cols))
    for lo in range(0, cols, g):
        codes[:, lo:lo + 4] = torch.arange(4)
    w = torch.cat([combine(coeffs[:, i:i + 1], code_planes(c, 2)) for i, c in enumerate(codes.split(g, dim=1))], 1)
    fmt = get_solver("bpdq")(w, _stats(cols), LayerSpec(2, g), {"reorder": reorder, "ridge": 0.0})
    assert fmt.coeffs.shape == (rows, 3, 3)
    assert torch.equal(fmt.dequantize(), w)


def test_round_trip_and_bits_per_weight():
    torch.manual_seed(3)
    stats = _stats(128)
    for bits, group_size, n_groups in [(2, 32, 4), (3, 64, 2), (4, 128, 1), (3, -1, 1), (2, 256, 1)]:
        fmt = get_solver("bpdq")(torch.randn(24, 128), stats, LayerSpec(bits, group_size), {"n_iters": 2})
        assert fmt.planes.dtype == torch.int32 and fmt.planes.shape == (bits, 24, 4)
        assert fmt.coeffs.dtype == torch.float16 and fmt.coeffs.shape == (24, n_groups, bits + 1)
        back = format_class(fmt.name).from_tensors({k: v.clone() for k, v in fmt.tensors().items()}, fmt.meta())
        assert all(torch.equal(a, b) for a, b in zip(fmt.tensors().values(), back.tensors().values()))
        assert torch.equal(back.dequantize(), fmt.dequantize())
        assert fmt.bits_per_weight() == pytest.approx(bits + 16 * (bits + 1) * n_groups / 128)


@pytest.mark.parametrize(
    ("spec", "cols", "message"),
    [
        (LayerSpec(8, 64), 128, "unsupported weight bits 8 by solver 'bpdq'; supported: 2, 3, 4"),
        (LayerSpec(1, 64), 128, "unsupported weight bits 1"),
        (LayerSpec(2, 48), 128, "unsupported group size 48"),
        (LayerSpec(4, -1), 80, "in_features divisible by 32"),
    ],
)
def test_bad_spec_is_rejected(spec, cols, message):
    with pytest.raises(ValueError, match=message):
        get_solver("bpdq")(torch.randn(8, cols), _stats(cols, 256), spec)
