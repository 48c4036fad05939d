"""MosaicQuant CPU kernels (bitquilt.kernels.mosaic): fused and two-kernel base + sparse residual, and
the sparse kernel alone, against the torch reference."""

import pytest
import torch

from bitquilt import kernels
from bitquilt.formats import BitplaneFormat, CompositeFormat, MatmulContext, SparseBlockFormat
from bitquilt.kernels import cpu, mosaic
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec

pytestmark = pytest.mark.skipif(cpu.extension() is None, reason="CPU extension unavailable (no AVX2 or build failed)")

OUT, IN = 80, 256  # 80 rows: two whole 32-row tiles and a ragged one
DENSITIES = (0.0, 0.01, 0.1, 0.5)
BATCHES = (1, 3, 64, 300)  # 300 ≥ every sgemm threshold; 64 is sgemm at 4 bits, tables below
BLOCKS = [(1, 32), (4, 32), (16, 32), (1, 64)]
BASES = ["w2g128", "w3g128", "w4g128", "w2g64", "w3g64", "w4g64", "bitplane3g64"]


def make_base(name: str, w: torch.Tensor, seed: int = 0):
    if name.startswith("bitplane"):
        bits, group = 3, 64
        gen = torch.Generator().manual_seed(seed)
        codes = torch.randint(0, 2**bits, w.shape, generator=gen)
        coeffs = torch.randn(w.shape[0], w.shape[1] // group, bits + 1, generator=gen) * 0.01
        return BitplaneFormat.from_codes(codes, coeffs, bits, group)
    bits, group = int(name[1]), int(name[3:])
    return get_solver("rtn")(w, None, LayerSpec(bits=bits, group_size=group))


def make_residual(w: torch.Tensor, block: tuple[int, int], density: float, seed: int = 0) -> SparseBlockFormat:
    """The largest-error tiles would be MosaicQuant's choice; here a seeded random `density` of them."""
    n_tiles = w.shape[0] // block[0] * (w.shape[1] // block[1])
    if density == 0:  # built directly: no tiles to quantize
        return SparseBlockFormat(torch.zeros(0, dtype=torch.int32), torch.zeros(0, block[0] * block[1] // 8,
                                 dtype=torch.int32), torch.zeros(0, dtype=torch.float16), *w.shape, block)
    index = torch.randperm(n_tiles, generator=torch.Generator().manual_seed(seed))[:max(1, round(density * n_tiles))]
    return SparseBlockFormat.from_dense(w, index, block)


def mosaic_format(base: str, block: tuple[int, int], density: float, out: int = OUT, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, IN, generator=gen) * 0.02
    b = make_base(base, w, seed)
    return CompositeFormat({"base": b, "residual": make_residual(w - b.dequantize(), block, density, seed)})


def assert_matches(y: torch.Tensor, ref: torch.Tensor) -> None:
    """The tolerance of the LUT kernel tests (tests/test_kernels.py): 21-bit activation tables."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("base", BASES)
def test_fused_and_two_kernel_match_the_reference(base, block):
    gen = torch.Generator().manual_seed(1)
    for density in DENSITIES:
        fmt = mosaic_format(base, block, density)
        weight = fmt.dequantize()
        for tokens in BATCHES:
            x = torch.randn(tokens, IN, generator=gen)
            ref = fmt.reference_matmul(x, weight=weight)
            fused = kernels.quant_matmul(fmt, x)
            assert fused is not None, "the fused kernel declined a MosaicQuant composite"
            assert_matches(fused, ref)
            assert_matches(mosaic.fused_matmul(fmt, x), ref)
            assert_matches(mosaic.two_pass_matmul(fmt, x), ref)
            assert_matches(mosaic.dense_matmul(fmt, x), fmt.parts["base"].reference_matmul(x))


@pytest.mark.parametrize("block", BLOCKS + [(2, 16)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_sparse_kernel_alone(block):
    gen = torch.Generator().manual_seed(2)
    for density in DENSITIES:
        s = make_residual(torch.randn(OUT, IN, generator=gen), block, density, seed=3)
        for tokens in (1, 5, 300):
            x = torch.randn(tokens, IN, generator=gen)
            y = kernels.quant_matmul(s, x)
            if block[1] % 32:
                assert y is None  # not whole 1×32 segments: the reference runs
                continue
            assert y is not None
            ref = s.reference_matmul(x)  # exact weights both ways: only the fp32 summation order differs
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


def test_segment_layout_holds_the_residual():
    s = make_residual(torch.randn(96, IN), (4, 64), 0.3)
    seg = mosaic.segments(s)
    dense = torch.zeros(96, IN)
    q = torch.stack([seg.codes & 15, seg.codes >> 4], 1).reshape(-1, 32).float() - 8  # byte j: q_j, q_{j+16}
    for k in range(seg.rows.numel()):
        dense[seg.rows[k], seg.cols[k]:seg.cols[k] + 32] = seg.scales[k] * q[k]
    assert torch.equal(dense, s.dequantize())
    assert seg.tile_ptr.tolist() == [0, *torch.bincount(seg.rows.long() // 32, minlength=3).cumsum(0).tolist()]
    assert torch.equal(seg.rows.long(), torch.sort(seg.rows.long()).values)
    assert kernels.kernel_layout_bytes(s) == seg.nbytes() > 0


def test_a_composites_layout_bytes_count_its_parts_and_parts_without_tables_are_declined():
    fmt = mosaic_format("w4g128", (1, 32), 0.1)
    assert kernels.kernel_layout_bytes(fmt) == 0
    mosaic.fused_matmul(fmt, torch.randn(1, IN))
    base, residual = fmt.parts["base"], fmt.parts["residual"]
    assert kernels.kernel_layout_bytes(fmt) == cpu.packed(base).nbytes() + mosaic.segments(residual).nbytes() > 0
    assert cpu.packed(residual) is None  # no lookup-table layout for a residual alone: declined, not a KeyError


def test_fused_is_tried_before_by_parts():
    kernels.quant_matmul(mosaic_format("w4g128", (1, 32), 0.1), torch.randn(1, IN))  # loads the builtins
    names = kernels.kernels_for("composite")
    assert names.index("fused") < names.index("by_parts")


def test_fused_declines_what_it_does_not_run():
    fmt = mosaic_format("w4g128", (1, 32), 0.1)
    x = torch.randn(4, IN)
    assert mosaic.matmul(fmt, x) is not None
    assert mosaic.matmul(fmt, x, MatmulContext()) is not None  # no per-token field
    assert mosaic.matmul(fmt, x, MatmulContext(slices=torch.full((4,), 2))) is None
    permuted = CompositeFormat(fmt.parts, perm=torch.randperm(IN))
    assert mosaic.matmul(permuted, x) is None
    assert mosaic.matmul(CompositeFormat({"base": fmt.parts["base"]}), x) is None
    assert mosaic.matmul(CompositeFormat({"base": fmt.parts["base"], "extra": fmt.parts["residual"]}), x) is None
    narrow = mosaic_format("w4g128", (2, 16), 0.1)
    assert mosaic.matmul(narrow, x) is None
    assert mosaic.matmul(fmt, x.requires_grad_()) is None
    # declined calls still give the right answer, through by_parts or the reference
    for f, ctx in [(permuted, None), (narrow, None), (fmt, MatmulContext(slices=torch.tensor([0, 1, 2, 2])))]:
        y = kernels.quant_matmul(f, x.detach(), ctx)
        assert_matches(y, f.reference_matmul(x.detach(), ctx))


def test_fused_keeps_the_activation_dtype():
    fmt = mosaic_format("w3g64", (16, 32), 0.1)
    x = torch.randn(2, IN).bfloat16()
    y = kernels.quant_matmul(fmt, x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, fmt.reference_matmul(x.float()).bfloat16())


def test_rejects_a_malformed_residual():
    fmt = mosaic_format("w4g128", (1, 32), 0.1)
    p, seg = cpu.packed(fmt.parts["base"]), mosaic.segments(fmt.parts["residual"])
    x = torch.randn(1, IN)
    bad = seg.cols.clone()
    bad[0] = IN - 16  # a segment past the last column
    with pytest.raises(RuntimeError, match="outside"):
        cpu.extension().lut_matmul(x, *p._args(), [seg.tile_ptr, seg.rows, bad, seg.scales, seg.codes])
    with pytest.raises(RuntimeError, match="tile_ptr"):
        cpu.extension().sparse_residual_add_(torch.zeros(1, OUT), x, [seg.tile_ptr[:-1], *seg.segments()[1:]])


def test_threads_give_identical_results():
    fmt = mosaic_format("w3g128", (1, 32), 0.2, out=300)
    before = torch.get_num_threads()
    for tokens in (1, 5, 64):  # tables at 3 bits (sgemm from 96 on: at::mm is not ours to make deterministic)
        x = torch.randn(tokens, IN)
        try:
            torch.set_num_threads(1)
            y1 = (mosaic.fused_matmul(fmt, x), mosaic.two_pass_matmul(fmt, x))
            torch.set_num_threads(2)
            y2 = (mosaic.fused_matmul(fmt, x), mosaic.two_pass_matmul(fmt, x))
        finally:
            torch.set_num_threads(before)
        assert all(torch.equal(a, b) for a, b in zip(y1, y2))
