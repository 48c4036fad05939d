"""4- and 2-bit `UniformFormat` times int8-rounded activations (csrc/kernels/q4_int8.cpp), with int8 activations on.

The lookup-table kernel (`bitquilt.kernels.cpu`) keeps activations exact to 2^-21; this kernel rounds each
token's activations to int8 per block of 32 columns (scale max|x| / 127, as llama.cpp's Q8 activations) and
multiplies the 4- or 2-bit codes with them in integer instructions. The result is exactly x̂ @ Ŵᵀ for the rounded
x̂, so the only error is the activations' rounding (≤ d/2 per value); that trade is opt-in,
`bitquilt.kernels.using(int8_activations=True)` (CLI `--int8-activations`), and its perplexity cost is in
docs/accuracy.md (bench/results/int8_activations.md). Registered as "cpu_q4_int8" ahead of cpu_lut (the 8-bit
kernel takes no 4- or 2-bit call); it declines every call while the option is off, and formats with act-order (g_idx) or
widths/groups not multiples of 64. The layout (`Q4Layout`): tiles of 32 rows whose bytes hold two rows' codes, so
one 64-byte load becomes vectors of codes with 4 columns of one row in each lane, met by those 4 activations
broadcast to every lane; a token reads the codes once, in order. Prefill runs two tokens a pass on VNNI, and on
AVX2 decodes a block of codes once for up to 16 tokens; a prompt's rows equal one-token calls bit for bit. Per
format it keeps its own layout in a `LayoutCache`.

Three paths, the same layout and exact integer dot products: AVX2 (vpmaddubsw); AVX-VNNI, 256-bit vpdpbusd where the CPU
has it without AVX-512 (csrc/kernels/avxvnni/q4_int8.cpp); AVX-512 VNNI (csrc/kernels/avx512/q4_int8.cpp). They differ
only in fp32 summation order. The widest runs by default, in this kernel and inside the fused decode step; `set_isa` or
`BITQUILT_ISA=avx2` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitquilt.formats.base import MatmulContext, WeightFormat
from bitquilt.formats.uniform import UniformFormat, resolve_group_size
from bitquilt.isa import INT8_ISAS as ISAS
from bitquilt.isa import choose, int8_supported
from bitquilt.kernels import cpu
from bitquilt.kernels.huge_pages import layout_empty
from bitquilt.kernels.layouts import PACK_ROWS, LayoutCache, fp16_grid, grid_chunks
from bitquilt.kernels.options import options
from bitquilt.kernels.registry import fp32_rows, like, register_kernel, takes
from bitquilt.mapped import release_chunk

ROWS = 32  # output rows per tile (csrc/kernels/q4_int8.h, Weight)


def supported_isas() -> tuple[str, ...]:
    """The kernel paths this CPU runs (empty without the extension)."""
    ext = cpu.extension()
    return () if ext is None else int8_supported(ext.q4_int8_isa_supported)


def set_isa(isa: str | None = None) -> str | None:
    """Route every call (also those of the fused decode step) to `isa`, or to `$BITQUILT_ISA` / the widest
    supported when None; returns the path now taken (None without the extension)."""
    chosen = choose("int8-activation", supported_isas(), isa)
    if chosen is not None:
        cpu.extension().q4_int8_set_isa(ISAS.index(chosen))
    return chosen


def active_isa() -> str | None:
    """The path calls take now."""
    ext = cpu.extension()
    return None if ext is None else ISAS[ext.q4_int8_active_isa()]


BITS = (4, 2)  # code widths the kernel runs


@dataclass(frozen=True)
class Q4Layout:
    """Tiles of 32 rows (the last padded with zero rows), each a run of 64-byte steps: codes uint8 [tiles, K·bits/16,
    64], byte 4l + j of step c holding rows l and 16 + l (at 4 bits column 4c + j, low nibble first; at 2 bits
    columns 8c + j in bits 0-3 and 8c + 4 + j in bits 4-7, row l first), and scales uint8 [tiles, groups, 96] (the
    tile's 32 scales as fp16, then its 32 zeros as uint8). Both flat."""

    codes: torch.Tensor
    scales: torch.Tensor
    group: int
    bits: int

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


def _rows_to_tiles(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [tiles, 32, ...], zero rows appended."""
    pad = -t.shape[0] % ROWS
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, ROWS, *t.shape[1:])


def _layout(fmt: WeightFormat) -> Q4Layout | None:
    if not isinstance(fmt, UniformFormat) or fmt.bits not in BITS or fmt.g_idx is not None:
        return None
    group = resolve_group_size(fmt.group_size, fmt.in_features)
    if fmt.in_features % 64 or group % 64:
        return None
    n, k, bits = fmt.out_features, fmt.in_features, fmt.bits
    tiles = -(-n // ROWS)
    scales = _scales(fmt, tiles)
    if scales is None:
        return None
    codes = layout_empty(tiles * ROWS * k * bits // 8).zero_()  # rows OR-ed in, pad rows 0
    for r0 in range(0, n, PACK_ROWS):  # csrc/kernels/repack.cpp writes each row's codes into its tile
        chunk = fmt.qweight[r0:r0 + PACK_ROWS]
        cpu.extension().q4_int8_pack_codes(chunk, r0, bits, k, tiles, codes)
        release_chunk(r0 // PACK_ROWS, [chunk])  # these rows' file pages, as cpu.pack_planes does
    return Q4Layout(codes, scales, group, bits)


def _scales(fmt: UniformFormat, tiles: int) -> torch.Tensor | None:
    """The scales and zeros of `Q4Layout`, PACK_ROWS rows at a time (the whole head's fp32 temporaries at once were
    ≈ 30 MB above the layout on Qwen); None unless every scale is an fp16 value and every zero a byte (what `pack`
    stores, and what the layout keeps). Every chunk is checked, in its 3-byte form, before the layout's room is taken:
    a layout cut from a shared huge-page block keeps its room, so a refused format must take none."""
    chunks = []
    for r0, scale, zero in grid_chunks(fmt, PACK_ROWS):
        grid = fp16_grid(scale, zero)
        if grid is None:
            return None
        scale16, zero8 = grid
        chunks.append((r0, torch.cat([_rows_to_tiles(scale16).transpose(1, 2).contiguous().view(torch.uint8),
                                      _rows_to_tiles(zero8).transpose(1, 2)], dim=-1)))  # [tiles, G, 32 · 2 + 32]
    groups = fmt.scales.shape[1]
    scales = layout_empty(tiles * groups * 3 * ROWS).view(tiles, groups, 3 * ROWS)
    for r0, per_group in chunks:
        scales[r0 // ROWS:r0 // ROWS + per_group.shape[0]].copy_(per_group)
    return scales.view(-1)


_LAYOUTS: LayoutCache[Q4Layout] = LayoutCache(_layout)


def layout(fmt: WeightFormat) -> Q4Layout | None:
    """The kernel layout of a 4- or 2-bit uniform format, None if it does not qualify or the extension is
    unavailable."""
    return None if cpu.extension() is None else _LAYOUTS.get(fmt)


def matmul(fmt: WeightFormat, x: torch.Tensor, ctx: MatmulContext | None = None) -> torch.Tensor | None:
    """x̂ [T, in] @ Ŵᵀ for a 4- or 2-bit `UniformFormat` while int8 activations are on; None to decline."""
    if not options().int8_activations or getattr(fmt, "bits", None) not in BITS or not takes(x, ctx):
        return None
    lay = layout(fmt)
    if lay is None:
        return None
    return like(cpu.extension().q4_int8_matmul(fp32_rows(x), lay.codes, lay.scales, fmt.out_features, lay.group,
                                               lay.bits), x)


def register() -> bool:
    """Register the int8-activation kernel ahead of cpu_lut if the extension loads; False otherwise."""
    if cpu.extension() is None:
        return False
    register_kernel("uniform", "cpu_q4_int8", matmul, before="cpu_lut")
    return True


set_isa()  # $BITQUILT_ISA, else the widest
