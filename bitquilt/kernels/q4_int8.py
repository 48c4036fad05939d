"""4- and 2-bit `UniformFormat` times int8-rounded activations (csrc/q4_int8.cpp), when int8 activations are enabled.

The lookup-table kernel (`bitquilt.kernels.cpu`) keeps activations exact to 2^-21; this kernel rounds each
token's activations to int8 per block of 32 columns (scale max|x| / 127, as llama.cpp's Q8 activations) and
multiplies the 4-bit (or 2-bit) codes with them in vpmaddubsw, one pass over the codes for decode and a widened int8
copy of each 4-row tile shared by every token for prefill. The result is exactly x̂ @ Ŵᵀ for the rounded x̂,
so the only error is the activations' rounding (≤ d/2 per value); that trade is opt-in,
`bitquilt.kernels.set_int8_activations(True)` (CLI `--int8-activations`), and its perplexity cost is
measured in docs/benchmarks.md. Registered as "cpu_q4_int8" ahead of cpu_lut (the 8-bit kernel takes no
4- or 2-bit call); it declines every call while the switch is off, and formats with act-order (g_idx) or
widths/groups not multiples of 64. 2-bit codes have a layout of their own (csrc/q2_int8.cpp): 32-row tiles whose
bytes hold two rows' codes of two columns, so one 64-byte load becomes four vectors of codes, one per row and 4
columns in each lane, met by 4 activations broadcast to every lane; that loop costs half the instructions of
widening 2-bit codes row by row, and reads the stream at the memory's rate rather than the instructions'.
Per format it keeps its own layout in a `LayoutCache` (the codes two or four per byte, fp16 s and uint8 z per row
group).

Two paths, the same layout and exact integer dot products: AVX2 (vpmaddubsw) and, where the CPU has AVX-512 with
VNNI, one vpdpbusd per 64 codes (csrc/q4_int8_vnni.cpp); they differ only in fp32 summation order. The widest runs
by default, in this kernel and inside the fused decode step; `set_isa` or `BITQUILT_ISA=avx2` picks one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bitquilt.formats.base import MatmulContext, WeightFormat
from bitquilt.formats.uniform import UniformFormat, resolve_group_size
from bitquilt.isa import INT8_ISAS as ISAS
from bitquilt.isa import choose
from bitquilt.kernels import (
    PACK_ROWS,
    LayoutCache,
    cpu,
    fp16_grid,
    fp32_rows,
    grid_chunks,
    int8_activations,
    kernels_for,
    layout_empty,
    like,
    register_kernel,
    takes,
)
from bitquilt.mapped import release_chunk

PAIR = 64  # columns per packed row chunk at 4 bits (csrc/q4_int8.h)
TILE_ROWS = {4: 4, 2: 32}  # output rows per tile by code width (csrc/q4_int8.h, Weight)


def supported_isas() -> tuple[str, ...]:
    """The kernel paths this CPU runs (empty without the extension)."""
    ext = cpu.extension()
    return () if ext is None else ISAS if ext.q4_int8_has_vnni() else ISAS[:1]


def set_isa(isa: str | None = None) -> str | None:
    """Route every call (also those of the fused decode step) to `isa`, or to `$BITQUILT_ISA` / the widest
    supported when None; returns the path now taken (None without the extension)."""
    chosen = choose("int8-activation", supported_isas(), isa)
    if chosen is not None:
        cpu.extension().q4_int8_set_vnni(chosen == "avx512")
    return chosen


def active_isa() -> str | None:
    """The path calls take now."""
    ext = cpu.extension()
    return None if ext is None else ISAS[int(ext.q4_int8_vnni_enabled())]


BITS = (4, 2)  # code widths the kernel runs


@dataclass(frozen=True)
class Q4Layout:
    """At 4 bits the weight panel by panel (a panel: the most whole groups within 4,096 columns, csrc/q4_int8.h),
    each panel's tiles of 4 rows in turn: codes uint8 [panels][tiles, cols/64, 4, 32] (a row's 64 codes of two
    blocks; byte j < 16 holds columns j and 16 + j, byte 16 + j columns 32 + j and 48 + j, low nibble first). At 2
    bits one panel of 32-row tiles: codes uint8 [tiles, K/8, 64] (step c's byte 4l + j holds rows l and 16 + l at
    columns 8c + j and 8c + 4 + j, csrc/q2_int8.cpp). Scales uint8 [panels][tiles, groups, 3 · rows] (the tile's
    rows' scales as fp16, then their zeros as uint8: 3 bytes per row and group). All flat."""

    codes: torch.Tensor
    scales: torch.Tensor
    group: int
    bits: int

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


def _rows_to_tiles(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[N, ...] -> [tiles, rows, ...], zero rows appended."""
    pad = -t.shape[0] % rows
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, rows, *t.shape[1:])


def _panels(flat: torch.Tensor, tiles: int, bounds: list[tuple[int, int]], per_unit: tuple[int, ...]) -> list:
    """Views [tiles, units, *per_unit] of `flat` for panels of units [u0, u1), one after another."""
    size = tiles * math.prod(per_unit)
    return [flat[size * u0:size * u1].view(tiles, u1 - u0, *per_unit) for u0, u1 in bounds]


def _layout(fmt: WeightFormat) -> Q4Layout | None:
    if not isinstance(fmt, UniformFormat) or fmt.bits not in BITS or fmt.g_idx is not None:
        return None
    group = resolve_group_size(fmt.group_size, fmt.in_features)
    if fmt.in_features % PAIR or group % PAIR:
        return None
    n, k = fmt.out_features, fmt.in_features
    bits, rows = fmt.bits, TILE_ROWS[fmt.bits]
    tiles = -(-n // rows)
    width = cpu.extension().q4_int8_panel_columns(group) if bits == 4 else k  # 2 bits: one panel
    columns = [(c0, min(k, c0 + width)) for c0 in range(0, k, width)]
    scales = _scale_panels(fmt, tiles, rows, [(c0 // group, -(-c1 // group)) for c0, c1 in columns])
    if scales is None:
        return None
    codes = layout_empty(tiles * rows * k * bits // 8)
    if n % rows or bits == 2:
        codes.zero_()  # pad rows 0; 2-bit rows are OR-ed in
    for r0 in range(0, n, PACK_ROWS):  # csrc/repack.cpp writes each row's chunks into their panels
        chunk = fmt.qweight[r0:r0 + PACK_ROWS]
        cpu.extension().q4_int8_pack_codes(chunk, r0, bits, k, width // PAIR, tiles, codes)
        release_chunk(r0 // PACK_ROWS, [chunk])  # these rows' file pages, as cpu.pack_planes does
    return Q4Layout(codes, scales, group, bits)


def _scale_panels(fmt: UniformFormat, tiles: int, rows: int,
                  group_bounds: list[tuple[int, int]]) -> torch.Tensor | None:
    """The scales and zeros of `Q4Layout`, PACK_ROWS rows at a time (the whole head's temporaries at once were
    ≈ 30 MB above the layout on Qwen); None unless every scale is an fp16 value and every zero a byte (what `pack`
    stores, and what the layout keeps)."""
    scales = layout_empty(tiles * fmt.scales.shape[1] * 3 * rows)
    panels = _panels(scales, tiles, group_bounds, (3 * rows,))
    for r0, scale, zero in grid_chunks(fmt, PACK_ROWS):
        grid = fp16_grid(scale, zero)
        if grid is None:
            return None
        scale16, zero8 = grid
        per_group = torch.cat([_rows_to_tiles(scale16, rows).transpose(1, 2).contiguous().view(torch.uint8),
                               _rows_to_tiles(zero8, rows).transpose(1, 2)], dim=-1)  # [tiles, G, rows · 2 + rows]
        t0 = r0 // rows
        for view, (g0, g1) in zip(panels, group_bounds, strict=True):
            view[t0:t0 + per_group.shape[0]].copy_(per_group[:, g0:g1])
    return scales


_LAYOUTS: LayoutCache[Q4Layout] = LayoutCache(_layout)


def layout(fmt: WeightFormat) -> Q4Layout | None:
    """The kernel layout of a 4- or 2-bit uniform format, None if it does not qualify or the extension is
    unavailable."""
    return None if cpu.extension() is None else _LAYOUTS.get(fmt)


def matmul(fmt: WeightFormat, x: torch.Tensor, ctx: MatmulContext | None = None) -> torch.Tensor | None:
    """x̂ [T, in] @ Ŵᵀ for a 4- or 2-bit `UniformFormat` while int8 activations are on; None to decline."""
    if not int8_activations() or getattr(fmt, "bits", None) not in BITS or not takes(x, ctx):
        return None
    lay = layout(fmt)
    if lay is None:
        return None
    return like(cpu.extension().q4_int8_matmul(fp32_rows(x), lay.codes, lay.scales, fmt.out_features, lay.group,
                                               lay.bits), x)


set_isa()  # $BITQUILT_ISA, else the widest
if cpu.extension() is not None and "cpu_q4_int8" not in kernels_for("uniform"):
    register_kernel("uniform", "cpu_q4_int8", matmul, before="cpu_lut")  # cpu_lut is registered by importing cpu
