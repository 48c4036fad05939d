"""The bit-plane × int8 kernel (csrc/kernels/plane_int8.h): MoBiQuant slices on int8-rounded activations."""

from __future__ import annotations

import pytest
import torch
from test_q4_int8 import rounded

from bitquilt import kernels
from bitquilt.formats.base import MatmulContext
from bitquilt.formats.composite import CompositeFormat
from bitquilt.kernels import composite, cpu, q4_int8
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec

pytestmark = pytest.mark.skipif(cpu.extension() is None, reason="CPU extension unavailable (no AVX2 or build failed)")


def _sliced(rows: int, cols: int, bits: int, group: int) -> CompositeFormat:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols))
    return get_solver("mobislice")(w, None, LayerSpec(bits, group), {})


def _slices(rows: int, cols: int, bits: int, group: int) -> list:
    return list(_sliced(rows, cols, bits, group).parts.values())


def _product(parts: list, x: torch.Tensor) -> torch.Tensor:
    """The slices' sum times x through `cpu.matmul_parts` with int8 activations (`plane_int8_matmul_parts`)."""
    with kernels.using(int8_activations=True):
        return cpu.matmul_parts(parts, x)


@pytest.fixture(params=["widest", "avx2"])
def path(request):
    """The widest int8 path (VNNI where the CPU has AVX-512 VBMI), then the baseline (the tables on the rounded
    activations)."""
    chosen = q4_int8.set_isa(None if request.param == "widest" else "avx2")
    yield chosen
    q4_int8.set_isa(None)


@pytest.mark.parametrize("rows, cols, bits, group", [(48, 128, 6, 32), (200, 256, 4, 128), (64, 512, 3, 64)])
def test_the_product_is_the_slices_times_the_rounded_activations(path, rows, cols, bits, group):
    parts = _slices(rows, cols, bits, group)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(3))
    x[5] = 0.0  # an all-zero token: scale 0
    for k in range(1, len(parts) + 1):
        weight = sum(p.dequantize().double() for p in parts[:k])
        expected = rounded(x).double() @ weight.T
        y = _product(parts[:k], x)
        assert y.shape == (40, rows) and not y[5].any()
        assert (y.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
        assert not torch.equal(y.double(), x.double() @ weight.T)  # rounded, not the exact product


def test_each_token_comes_out_as_it_does_alone(path):
    """Tokens are independent (16 to a pass over a tile's planes, then the next 16): the same bits in any batch."""
    parts = _slices(200, 256, 4, 128)[:2]
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(4))
    together = _product(parts, x)
    for t in (0, 15, 16, 36):
        assert torch.equal(together[t:t + 1], _product(parts, x[t:t + 1]))


def test_the_vnni_path_and_the_tables_agree():
    if not cpu.extension().plane_int8_vnni():
        pytest.skip("this CPU takes the tables' path only (no AVX-512 VNNI + VBMI)")
    parts = _slices(200, 256, 4, 128)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(5))
    vnni = _product(parts, x)
    q4_int8.set_isa("avx2")
    try:
        tables = _product(parts, x)
    finally:
        q4_int8.set_isa(None)
    torch.testing.assert_close(vnni, tables, rtol=1e-5, atol=1e-5 * float(tables.abs().max()))


def test_a_composite_runs_its_slices_on_int8_activations_when_enabled():
    """Per token, each its own prefix of slices, with `kernels.using(int8_activations=True)`: the rounded product."""
    fmt = _sliced(48, 128, 6, 32)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(6))
    ctx = MatmulContext(slices=torch.tensor([1, 2, 3, 1, 5, 2]))
    with kernels.using(int8_activations=True):
        y = composite.matmul(fmt, x, ctx)
    torch.testing.assert_close(y, fmt.reference_matmul(rounded(x), ctx), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(y, composite.matmul(fmt, x, ctx), rtol=1e-6, atol=1e-6)
