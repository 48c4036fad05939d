"""CPU kernels (bitquilt.kernels.cpu) against the torch reference, and the fallback without them."""

import dataclasses
import gc
import logging
import sys
import weakref

import pytest
import torch
from torch import nn

from bitquilt import kernels
from bitquilt.formats import BitplaneFormat, CompositeFormat, MatmulContext, UniformFormat, UniformGrid
from bitquilt.formats.packing import pack
from bitquilt.kernels import cpu, registry
from bitquilt.nn.online import attach
from bitquilt.nn.quant_linear import QuantLinear

needs_ext = pytest.mark.skipif(cpu.extension() is None, reason="CPU extension unavailable (no AVX2 or build failed)")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_bitplane(n: int, k: int, bits: int, group: int, seed: int = 0) -> BitplaneFormat:
    gen = torch.Generator().manual_seed(seed)
    planes = torch.randint(0, 2, (bits, n, k), generator=gen)
    coeffs = torch.randn(n, -(-k // group), bits + 1, generator=gen) * 0.02  # a ragged last group is allowed
    return BitplaneFormat(pack(planes, 1), coeffs.half(), bits, group, k)


def make_uniform(w: torch.Tensor, bits: int, group: int, sym: bool) -> UniformFormat:
    """RTN codes per (row, group); the last group may be shorter than `group`."""
    n, k = w.shape
    grid = UniformGrid(bits, sym)
    g = k if group == -1 else group
    q, scales, zeros = [], [], []
    for start in range(0, k, g):
        s, z = grid.fit(w[:, start:start + g])
        q.append(grid.quantize(w[:, start:start + g], s, z))
        scales.append(s)
        zeros.append(z)
    return UniformFormat.from_codes(torch.cat(q, 1), torch.stack(scales, 1), torch.stack(zeros, 1), grid, g)


def llm_like(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Heavy-tailed weights with uneven row scales, activations with a few outlier channels."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.exp(0.7 * torch.randn(n, k, generator=gen))  # scale mixture
    w *= 0.02 * torch.exp(0.5 * torch.randn(n, 1, generator=gen))
    x = torch.randn(5, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:3]] *= 60
    return w, x


def term_magnitudes(fmt) -> torch.Tensor:
    """|C0| + Σ|C_i|·B_i per weight: the size of the terms the kernels add up (the planes form)."""
    if isinstance(fmt, BitplaneFormat):
        return BitplaneFormat(fmt.planes, fmt.coeffs.abs(), fmt.bits, fmt.group_size, fmt.in_features).dequantize()
    scale, zero = fmt.column_params()
    return scale * (fmt.codes().float() + zero)


def table_rounding(fmt, x: torch.Tensor) -> torch.Tensor:
    """Bound [tokens, out] on what the 21-bit activation tables add to the lookup-table kernel.

    In each block of B columns a table entry is off by at most ~0.63 step (half a step, plus fp32
    rounding of the scaling), a step being max|T|/(2^20 − 1) over the block's tables; B/4 lookups
    per plane, each weighted by |C_i|. So the error is relative to the largest activation of the
    block, not to each activation: an outlier channel coarsens its block's neighbours.
    """
    p = cpu.packed(fmt)
    tokens, k = x.shape
    quads = x.double().view(tokens, k // 4, 4)
    t_max = torch.maximum(quads.clamp(min=0).sum(-1), (-quads).clamp(min=0).sum(-1))  # max_m |T_q[m]|
    step = t_max.view(tokens, k // p.block, p.block // 4).amax(-1) / (2**20 - 1)  # [tokens, blocks]
    if isinstance(fmt, BitplaneFormat):
        c_sum = fmt.coeffs[..., 1:].double().abs().sum(-1)  # Σ_i |C_i| per (row, group)
    else:
        c_sum = fmt.scales.double() * (2**fmt.bits - 1)
    group_of_block = torch.arange(k // p.block) * p.block // p.group
    return step @ c_sum[:, group_of_block].T * (0.7 * p.block / 4)


def assert_fp32_accurate(y: torch.Tensor, fmt, x: torch.Tensor, tables: bool = True) -> None:
    """|y − y_exact| ≤ γ·|x|·(|C0| + Σ|C_i|B_i)ᵀ (+ the table rounding bound for the LUT kernel).

    The first term is the classical fp32 bound for summing those terms, γ = K·2^-24 ≤ γ_K; the
    terms, not |Ŵ|, set the scale because C0 and the planes are summed separately (as in any
    zero-point-folding kernel), so cancellation between them shows.
    """
    exact = x.double() @ fmt.dequantize().double().T
    bound = (x.double().abs() @ term_magnitudes(fmt).double().T) * (x.shape[1] * 2.0**-24)
    if tables:
        bound += table_rounding(fmt, x)
    assert y.shape == exact.shape and y.dtype == x.dtype
    excess = ((y.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"error exceeds the bound by {excess:.3g}"
    assert ((y.double() - exact).norm() / exact.norm()).item() < 1e-4  # fp16 weights alone: ~1e-3


@needs_ext
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_bitplane_matches_reference(bits, group):
    n, k = 77, 384  # rows not a multiple of the 32-row tile
    fmt = make_bitplane(n, k, bits, k if group == -1 else group, seed=bits)
    gen = torch.Generator().manual_seed(bits)
    for tokens in (1, 3, 17):
        x = torch.randn(tokens, k, generator=gen)
        assert_fp32_accurate(cpu.matmul(fmt, x), fmt, x)


@needs_ext
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [False, True])
def test_uniform_matches_reference(bits, group, sym):
    w, x = llm_like(45, 256, seed=bits)
    fmt = make_uniform(w, bits, group, sym)
    assert_fp32_accurate(cpu.matmul(fmt, x), fmt, x)
    assert_fp32_accurate(cpu.matmul(fmt, x[:1]), fmt, x[:1])


@needs_ext
@pytest.mark.parametrize("sym", [False, True])
def test_compact_uniform_coefficients_give_the_fp32_ones_results(sym):
    """A saved grid's (fp16 s, uint8 z) are stored as such (96 bytes per 32 rows and group, not (s, −s·z) in fp32:
    256): both kernel paths give bit-identical results from either storage; a grid whose scales are not fp16 values
    keeps the fp32 storage and its exactness."""
    w, x = llm_like(77, 384, seed=5)
    fmt = make_uniform(w, 4, 128, sym)
    p = cpu.packed(fmt)
    assert p.coeffs.dtype == torch.uint8 and p.coeffs.shape == (3, 3, 96)
    wide = dataclasses.replace(p, coeffs=torch.empty(3, 3, 2, 32))
    assert cpu._fill_tiles(wide.coeffs, fmt, cpu._fp32_tiles)
    for tokens in (1, 5, 64):
        xt = torch.cat([x] * 16)[:tokens]
        assert torch.equal(p.lut(xt), wide.lut(xt)) and torch.equal(p.sgemm(xt), wide.sgemm(xt))
    finer = UniformFormat(fmt.qweight, fmt.scales.float() * (1 + 2**-15), fmt.zeros, 4, 128, 384)
    assert cpu.packed(finer).coeffs.dtype == torch.float32
    assert_fp32_accurate(cpu.matmul(finer, x), finer, x)


@needs_ext
def test_ragged_last_group_and_tiny_layer():
    w, x = llm_like(40, 576)  # smollm2's width at g128: groups of 128, 128, 128, 128, 64
    fmt = make_uniform(w, 4, 128, sym=False)
    assert fmt.scales.shape == (40, 5)
    assert_fp32_accurate(cpu.matmul(fmt, x), fmt, x)
    planes = make_bitplane(40, 576, 3, 128)
    assert planes.coeffs.shape == (40, 5, 4)
    assert_fp32_accurate(cpu.matmul(planes, x), planes, x)
    tiny = make_bitplane(3, 32, 2, 32)
    x = torch.randn(2, 32)
    assert_fp32_accurate(cpu.matmul(tiny, x), tiny, x)


@needs_ext
def test_uniform_as_bitplanes_agrees():
    w, x = llm_like(64, 256)
    u = make_uniform(w, 3, 64, sym=True)  # symmetric: C0 = −s·z is exact in fp16
    b = BitplaneFormat.from_uniform(u)
    assert torch.equal(b.dequantize(), u.dequantize())
    torch.testing.assert_close(cpu.matmul(b, x), cpu.matmul(u, x), rtol=2e-6, atol=1e-5)


@needs_ext
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_sgemm_path_for_large_batches(bits):
    w, _ = llm_like(70, 384, seed=bits)
    fmt = make_uniform(w, bits, 128, sym=False)
    x = torch.randn(40, 384, generator=torch.Generator().manual_seed(bits))
    p = cpu.packed(fmt)
    assert_fp32_accurate(p.sgemm(x), fmt, x, tables=False)
    assert_fp32_accurate(p.lut(x), fmt, x)
    big = torch.randn(cpu._SGEMM_BATCH[bits], 384)
    assert torch.equal(cpu.matmul(fmt, big), p.sgemm(big))
    assert torch.equal(cpu.matmul(fmt, big[:-1]), p.lut(big[:-1]))


@needs_ext
def test_declines_what_it_cannot_run():
    w, x = llm_like(32, 128)
    fmt = make_uniform(w, 4, 32, sym=False)
    fmt.g_idx = torch.arange(128, dtype=torch.int32) // 32
    assert cpu.matmul(fmt, x) is None  # act-order
    odd = make_uniform(w[:, :96], 4, 48, sym=False)
    assert cpu.matmul(odd, x[:, :96]) is None  # group not a multiple of 32
    plain = make_uniform(w, 4, 32, sym=False)
    assert cpu.matmul(plain, x.requires_grad_()) is None  # autograd wants the reference
    with torch.no_grad():
        assert cpu.matmul(plain, x) is not None


@needs_ext
@pytest.mark.parametrize("kind", ["asym", "sym", "bitplane"])
def test_quant_matmul_agrees_with_the_format_reference(kind):
    w, x = llm_like(64, 256)
    fmt = make_bitplane(64, 256, 3, 64) if kind == "bitplane" else make_uniform(w, 4, 64, sym=kind == "sym")
    y = kernels.quant_matmul(fmt, x)
    assert y is not None
    torch.testing.assert_close(y, fmt.reference_matmul(x), rtol=1e-4, atol=1e-4 * y.abs().max().item())


@needs_ext
def test_layouts_are_cached_in_kernels_not_on_the_format():
    fmt = make_bitplane(64, 256, 2, 64)
    attributes = set(vars(fmt))
    assert kernels.kernel_layout_bytes(fmt) == 0
    layout = cpu.packed(fmt)
    assert cpu.packed(fmt) is layout and set(vars(fmt)) == attributes
    assert kernels.kernel_layout_bytes(fmt) == layout.nbytes() > 0
    dead = weakref.ref(layout)
    del fmt, layout
    gc.collect()
    assert dead() is None  # dropped with its format


@needs_ext
def test_per_token_context_declines_to_the_reference():
    fmt = make_bitplane(32, 128, 3, 32)
    x = torch.randn(4, 128)
    assert kernels.quant_matmul(fmt, x, MatmulContext()) is not None  # no per-token field: the kernel runs
    assert kernels.quant_matmul(fmt, x, MatmulContext(slices=torch.ones(4, dtype=torch.long))) is None
    assert cpu.matmul(fmt, x, MatmulContext(slices=torch.ones(4, dtype=torch.long))) is None


def test_quant_matmul_hands_the_context_to_kernels(monkeypatch):
    seen = []
    monkeypatch.setattr(registry, "_KERNELS", {})
    monkeypatch.setattr(kernels, "_builtin_loaded", True)  # the spy alone
    kernels.register_kernel("bitplane", "spy", lambda fmt, x, ctx: seen.append(ctx))
    ctx = MatmulContext(slices=torch.zeros(2))
    assert kernels.quant_matmul(make_bitplane(8, 32, 2, 32), torch.randn(2, 32), ctx) is None
    assert seen == [ctx]


class SliceRouter(nn.Module):
    """Tokens whose first feature is positive use every slice, the others only the first."""

    def __init__(self, n_slices: int):
        super().__init__()
        self.n_slices = n_slices

    def forward(self, x: torch.Tensor) -> MatmulContext:
        return MatmulContext(slices=torch.where(x[..., 0] > 0, self.n_slices, 1))


def test_quant_linear_routes_tokens_to_slices():
    w, _ = llm_like(48, 128)
    first = make_uniform(w, 2, 32, sym=False)
    fmt = CompositeFormat({"slice1": first, "slice2": make_uniform(w - first.dequantize(), 4, 32, sym=False)})
    layer = QuantLinear(fmt, bias=torch.randn(48))
    attach(layer, "router", SliceRouter(2))
    assert {"packed_slice1__qweight", "packed_slice2__scales"} <= set(layer.state_dict())
    x = torch.randn(2, 3, 128)
    with torch.no_grad():
        y = layer(x)
    assert layer._dequantized is None  # a per-token call never uses (or fills) the full-weight cache
    flat = x.reshape(-1, 128)
    expected = torch.stack([t @ fmt.dequantize(2 if t[0] > 0 else 1).T for t in flat]) + layer.bias
    torch.testing.assert_close(y.reshape(-1, 48), expected)
    attach(layer, "router", None)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), x @ fmt.dequantize().T + layer.bias)


def test_quant_linear_buffers_rebuild_the_format():
    w, _ = llm_like(32, 64)
    fmt = CompositeFormat({"base": make_uniform(w, 4, 32, sym=True)}, perm=torch.randperm(64))
    layer = QuantLinear(fmt).to("cpu")
    assert isinstance(layer.fmt, CompositeFormat) and layer.fmt is not fmt
    assert torch.equal(layer.fmt.dequantize(), fmt.dequantize())


@needs_ext
@pytest.mark.parametrize("fmt_name", ["bitplane", "mxint"])
def test_threads_give_identical_results(fmt_name):
    from bitquilt.formats.mxint import MXIntFormat

    fmt = make_bitplane(300, 512, 3, 128) if fmt_name == "bitplane" else MXIntFormat.quantize(
        torch.randn(300, 512), [8, 6, 4], [32, 32, 448], torch.randperm(512))
    x = torch.randn(5, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = kernels.quant_matmul(fmt, x)
        torch.set_num_threads(2)
        y2 = kernels.quant_matmul(fmt, x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y2)


def _mixed_mxint():
    from bitquilt.formats.mxint import MXIntFormat

    return MXIntFormat.quantize(torch.randn(96, 256), [8, 6, 4], [32, 32, 192], torch.randperm(256))


@needs_ext
@pytest.mark.parametrize("make, kernel", [(lambda: make_bitplane(96, 256, 4, 64), "cpu_lut"),
                                          (_mixed_mxint, "cpu_mxint")], ids=["bitplane", "mxint"])
def test_quant_linear_dispatches_to_the_kernel(make, kernel):
    fmt = make()
    assert kernel in kernels.kernels_for(fmt.name)
    layer = QuantLinear(fmt, bias=torch.randn(96))
    x = torch.randn(2, 3, 256)
    with torch.no_grad():
        y = layer(x)
        y16 = layer(x.bfloat16())
        assert layer._dequantized is None  # the kernel never materialised the fp32 weight
        with kernels.using(enabled=False):
            ref = layer(x)
    assert y.shape == (2, 3, 96) and y16.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    expected16 = (x.bfloat16().float() @ fmt.dequantize().T).bfloat16() + layer.bias.bfloat16()
    torch.testing.assert_close(y16, expected16)


def test_fallback_when_the_extension_cannot_build(monkeypatch, caplog):
    def broken(verbose: bool = False):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(cpu, "_load_extension", broken)
    monkeypatch.setattr(cpu, "_ext", None)
    monkeypatch.setattr(cpu, "_failed", False)
    monkeypatch.setattr(registry, "_KERNELS", {})
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        assert cpu.register() is False
        assert cpu.register() is False
    assert len(caplog.records) == 1 and "torch reference" in caplog.records[0].getMessage()
    assert kernels.kernels_for("bitplane") == [] and kernels.kernels_for("uniform") == []

    fmt = make_bitplane(40, 128, 3, 32)
    x = torch.randn(3, 128)
    assert cpu.matmul(fmt, x) is None
    with torch.no_grad():
        y = QuantLinear(fmt)(x)
    torch.testing.assert_close(y, x @ fmt.dequantize().T)


# ---------------------------------------------------------------- 8-bit uniform GEMV (decode batches)
@needs_ext
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 16])
def test_uniform8_gemv_matches_the_reference(sym, tokens):
    from bitquilt.kernels import uniform8

    w, x = llm_like(80, 576, seed=tokens)  # 576 = 4 groups of 128 and a last one of 64
    x = torch.cat([x] * 4)[:tokens]
    fmt = make_uniform(w, 8, 128, sym=sym)
    y = uniform8.matmul(fmt, x)
    assert_fp32_accurate(y, fmt, x, tables=False)
    assert kernels.kernel_layout_bytes(fmt) == 2 * 4 * 80 * 5  # fp32 scale and scale·zero per (row, group)


@needs_ext
def test_uniform8_runs_decode_batches_ahead_of_the_lookup_tables_and_declines_the_rest():
    from bitquilt.kernels import uniform8

    kernels.quant_matmul(make_uniform(torch.randn(8, 64), 8, 32, sym=True), torch.randn(1, 64))  # load builtins
    order = kernels.kernels_for("uniform")  # the int8-activation kernel may sit between them: it takes no 8-bit call
    assert order.index("cpu_uniform8") < order.index("cpu_lut") and order.index("cpu_q4_int8") < order.index("cpu_lut")
    w, x = llm_like(64, 256)
    fmt = make_uniform(w, 8, 64, sym=False)
    big = torch.randn(uniform8.MAX_TOKENS + 1, 256)
    assert uniform8.matmul(fmt, big) is None  # the sgemm path of cpu_lut takes it
    torch.testing.assert_close(kernels.quant_matmul(fmt, big), fmt.reference_matmul(big), rtol=1e-4, atol=1e-3)
    assert uniform8.matmul(make_uniform(w, 4, 64, sym=False), x) is None  # 4 bits: the lookup tables
    assert uniform8.matmul(make_uniform(w[:, :96], 8, 48, sym=False), x[:, :96]) is None  # group not a multiple of 32
    assert uniform8.matmul(fmt, x, MatmulContext(slices=torch.ones(5, dtype=torch.long))) is None


@needs_ext
@pytest.mark.parametrize(("near", "far"), [(0, 0), (4096, 0), (1024, 4096)])
def test_read_pass_ors_every_word_with_or_without_prefetch(near, far):
    """The benchmarks' bandwidth ceiling really reads the whole buffer: its result is the OR of all 64-bit words."""
    words = torch.zeros(1024, dtype=torch.int64)  # 8 KB, 64 steps of 128 bytes
    words[-1] = 1 << 40
    words[17] = 5
    assert cpu.extension().read_pass(words, near, far) == (1 << 40) | 5
    with pytest.raises(RuntimeError, match="multiple of 128 bytes"):
        cpu.extension().read_pass(words[:-1], near, far)
    with pytest.raises(RuntimeError, match="distances must be >= 0"):
        cpu.extension().read_pass(words, -near - 1, far)
    assert 0 < cpu.extension().read_pass_seconds(words, near, far) < 1  # the same pass, timed in C


@needs_ext
def test_the_batch1_kernels_prefetch_plan_names_distances_in_bytes():
    """The plan the report's prefetching ceiling copies: T0 distance > 0, T1 distance 0 (none) or beyond it."""
    near, far = cpu.extension().prefetch_plan()
    assert near > 0 and near % 64 == 0
    assert far == 0 or (far > near and far % 64 == 0)


@needs_ext
def test_the_int8_kernel_timed_in_c_runs_the_kernel_on_checked_arguments():
    from bitquilt.kernels import q4_int8

    w, x = llm_like(64, 256)
    layout = q4_int8.layout(make_uniform(w, 4, 128, sym=False))
    ext = cpu.extension()
    args = (layout.codes, layout.scales, 64, layout.group, layout.bits)
    assert 0 < ext.q4_int8_seconds(x[:1].contiguous(), *args) < 1
    with pytest.raises(RuntimeError, match="packed codes do not match the shape"):
        ext.q4_int8_seconds(x[:1, :192].contiguous(), *args)


@needs_ext
@pytest.mark.parametrize("bits", range(1, 9))
def test_bit_planes_of_the_extension_are_the_reference_ones(bits):
    """csrc/kernels/repack.cpp cuts a uniform weight's codes into the lookup-table kernel's bit-planes; rows taken apart
    from a larger weight (strided words, as a layout is built a chunk of rows at a time) give the same planes."""
    from bitquilt.formats.packing import bit_planes

    values = torch.randint(0, 2**bits, (23, 160), generator=torch.Generator().manual_seed(bits))
    words = pack(values, bits)
    assert torch.equal(cpu.extension().bit_planes(words, bits, 160), bit_planes(words, bits, 160))
    assert torch.equal(cpu.extension().bit_planes(words[7:12], bits, 160), bit_planes(words[7:12], bits, 160))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu.extension().bit_planes(words[:, :-1], bits, 160)


@needs_ext
@pytest.mark.parametrize("make", [lambda w: make_uniform(w, 4, 32, sym=False), lambda w: make_bitplane(70, 96, 3, 32)])
def test_layouts_built_a_few_rows_at_a_time_are_the_whole_ones(make, monkeypatch):
    w = torch.randn(70, 96)
    fmt = make(w)
    whole = cpu._PACKERS[fmt.name](fmt)
    monkeypatch.setattr(cpu, "PACK_TILES", 1)  # 32 rows a chunk: two whole tiles and a padded one
    monkeypatch.setattr(cpu, "PACK_ROWS", 32)  # the same for a uniform grid's coefficients
    chunked = cpu._PACKERS[fmt.name](fmt)
    assert torch.equal(chunked.planes, whole.planes) and torch.equal(chunked.coeffs, whole.coeffs)


@needs_ext
@pytest.mark.parametrize(("bytes_per_row", "block"), [(1120, 128), (36, 32), (24, 64)])  # 16-byte steps, and tails
def test_planes_to_tiles_is_the_reference_reordering(bytes_per_row, block):
    """csrc/kernels/repack.cpp's transposes put byte (plane i, row, column byte c) where the kernel reads it: tile,
    block, plane, c within the block, the row's position in the tile (`_ROW_OF_BYTE`)."""
    k, rows, bb = 3, 64, block // 8
    planes = torch.randint(0, 256, (k, rows, bytes_per_row), dtype=torch.uint8)
    out = torch.empty(rows // 32, bytes_per_row // bb, k, bb, 32, dtype=torch.uint8)
    cpu.extension().planes_to_tiles(planes, block, cpu._ROW_OF_BYTE, out)
    tiles = planes.view(k, rows // 32, 32, bytes_per_row // bb, bb)[:, :, cpu._ROW_OF_BYTE]
    assert torch.equal(out, tiles.permute(1, 3, 0, 4, 2))


def test_layouts_from_2mb_start_on_a_huge_page_and_smaller_ones_share_huge_pages(monkeypatch):
    from bitquilt.heap import HUGE_PAGE, advise_huge_pages
    from bitquilt.kernels import huge_pages
    from bitquilt.kernels.huge_pages import layout_empty

    monkeypatch.setattr(huge_pages, "_slabs", huge_pages._Slabs())  # no block left open by earlier tests
    small = [layout_empty(n, dtype) for n, dtype in [(1000, torch.float16), (3, torch.uint8), (50_000, torch.float32)]]
    assert [t.shape for t in small] == [(1000,), (3,), (50_000,)] and small[0].dtype == torch.float16
    blocks = {t.data_ptr() // HUGE_PAGE for t in small}  # cut back to back from one block, 64-byte aligned
    assert len(blocks) == 1 and all(t.data_ptr() % 64 == 0 for t in small)
    assert small[0].untyped_storage().nbytes() >= huge_pages._Slabs.BLOCK  # a view of the shared block
    for t, value in zip(small, (1.0, 2, 3.0)):
        t.fill_(value)
    assert float(small[0].sum()) == 1000 and int(small[1].sum()) == 6 and float(small[2].sum()) == 150_000
    many = [layout_empty(HUGE_PAGE - 64 * i) for i in range(1, 80)]  # more blocks than are kept open
    for i, t in enumerate(many):
        t.fill_(i)
    assert [int(t[-1]) for t in many] == list(range(79)) and len({t.untyped_storage().data_ptr() for t in many}) >= 10
    monkeypatch.setattr(huge_pages, "_slabs", huge_pages._Slabs())
    two = [layout_empty(HUGE_PAGE * 5 // 8) for _ in range(2)]  # 1.25 MB each (qwen2.5-1.5b's q_proj at 4 bits):
    assert two[1].data_ptr() == two[0].data_ptr() + two[0].nbytes  # back to back, across a huge-page boundary
    big = layout_empty(3 * HUGE_PAGE // 4 + 5, torch.float32)
    assert big.shape == (3 * HUGE_PAGE // 4 + 5,) and big.data_ptr() % HUGE_PAGE == 0
    big.fill_(1.5)
    assert float(big.sum()) == 1.5 * big.numel()
    if sys.platform == "linux":  # madvise(MADV_HUGEPAGE) is accepted, whatever the system's THP mode
        assert advise_huge_pages(big.data_ptr(), big.nbytes)
    monkeypatch.setenv("BITQUILT_HUGE_PAGES", "0")  # off: a plain allocation of the size asked
    assert layout_empty(1000).untyped_storage().nbytes() == 1000
    plain = layout_empty(3 * HUGE_PAGE // 4 + 5, torch.float32)
    assert plain.untyped_storage().nbytes() == plain.nbytes
