"""CPU kernels for MosaicQuant weights: a dense low-bit base plus a sparse 4-bit residual in one pass.

A MosaicQuant weight is `CompositeFormat({"base": B, "residual": S})`, B a `UniformFormat` or
`BitplaneFormat`, S a `SparseBlockFormat` of r×c tiles. Two kernels, registered when the C++
extension of `bitquilt.kernels.cpu` loads:

- "fused" for "composite" (the "ZipperEngine"): x @ (B + S)ᵀ by B's bit-plane kernel with S added
  inside it, tile by tile (csrc/kernels/lut_matmul.cpp): on the lookup-table path each 32-row output tile's
  residual segments go into the tile's accumulators after its base blocks, before the copy-out; on
  the sgemm path into the tile's dequantized fp32 rows before at::mm. y is written once and the
  activations of a tile are still in cache, so the residual costs its own bytes and FMAs and no
  second pass over y. It takes exactly: 2-D fp CPU x without grad, no per-token context, no perm,
  parts "base" (with a `cpu.packed` layout) and "residual" (c % 32 == 0); anything else it
  declines, and the generic "by_parts" kernel (`bitquilt.kernels.composite`) runs. It is
  registered ahead of "by_parts".
- "cpu_sparse" for "sparse_blocks": x @ Sᵀ alone (`sparse_residual_add_` into zeros), the
  residual's kernel when a composite goes through "by_parts".

Layout (built on first use from `SparseBlockFormat.codes()`, `scales`, `index`, kept in a
`LayoutCache` while the format lives; about 0.6 byte per stored weight): every stored tile is
split into r·(c/32) segments of 32 consecutive columns of one row, each with its absolute row
(int32), first column (int32), the tile's scale (fp32) and 16 bytes of codes, byte j holding
q_j + 8 in its low nibble and q_{j+16} + 8 in its high nibble (one 128-bit load, two masks:
all 32 codes). Segments are sorted by 32-row output tile, then row, then column, with a CSR index
`tile_ptr` [tiles + 1], so each tile of the base kernel finds its residual in one contiguous run.
Segments, not whole r×c tiles, because the base kernel's unit of work is a 32-row tile and every
residual shape with c % 32 == 0 (1×32, 16×32, 1×64, ...) maps onto them without a special case.

`fused_matmul`, `two_pass_matmul` (the base kernel, then `sparse_residual_add_` over y) and
`dense_matmul` (the base alone) run one composite each way, for `bench/mosaic_kernels.py`.
Tested against `CompositeFormat.reference_matmul` in tests/test_mosaic_kernels.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitquilt.formats.base import MatmulContext, WeightFormat
from bitquilt.formats.composite import CompositeFormat
from bitquilt.formats.sparse_blocks import QMIN, SparseBlockFormat
from bitquilt.kernels import cpu
from bitquilt.kernels.layouts import LayoutCache
from bitquilt.kernels.registry import fp32_rows, like, register_kernel, takes

SEGMENT = 32  # columns per residual segment
PARTS = ("base", "residual")


@dataclass(frozen=True)
class Segments:
    """A `SparseBlockFormat` in the kernels' 1×32 segment layout (module docstring)."""

    tile_ptr: torch.Tensor  # int32 [tiles + 1]
    rows: torch.Tensor  # int32 [n]
    cols: torch.Tensor  # int32 [n]
    scales: torch.Tensor  # fp32 [n]
    codes: torch.Tensor  # uint8 [n, 16]
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.segments())

    def segments(self) -> list[torch.Tensor]:
        return [self.tile_ptr, self.rows, self.cols, self.scales, self.codes]


def build_segments(fmt: SparseBlockFormat) -> Segments | None:
    """The segment layout of `fmt`; None if its tiles are not whole 32-column segments (c % 32 ≠ 0)."""
    r, c = fmt.block
    if c % SEGMENT:
        return None
    per_row = c // SEGMENT
    n = fmt.index.numel()
    ids = fmt.index.long()
    tile_row, tile_col = ids // (fmt.in_features // c), ids % (fmt.in_features // c)
    # segment (tile k, row a, part s): row R·r + a, columns C·c + 32·s ..
    rows = (tile_row[:, None, None] * r + torch.arange(r)[None, :, None]).expand(n, r, per_row).reshape(-1)
    cols = (tile_col[:, None, None] * c + SEGMENT * torch.arange(per_row)[None, None, :]).expand(n, r, per_row)
    cols = cols.reshape(-1)
    q = (fmt.codes() - QMIN).to(torch.uint8).reshape(-1, SEGMENT)  # q + 8, tiles row-major: [n·r·c/32, 32]
    codes = q[:, :16] | (q[:, 16:] << 4)
    scales = fmt.scales.float().repeat_interleave(r * per_row)
    order = torch.argsort(rows * fmt.in_features + cols)  # by row (hence tile), then column
    tiles = -(-fmt.out_features // cpu.TILE)
    counts = torch.bincount(rows // cpu.TILE, minlength=tiles)
    tile_ptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return Segments(tile_ptr.to(torch.int32), rows[order].to(torch.int32).contiguous(),
                    cols[order].to(torch.int32).contiguous(), scales[order].contiguous(), codes[order].contiguous(),
                    fmt.out_features, fmt.in_features)


_SEGMENTS: LayoutCache[Segments] = LayoutCache(
    lambda fmt: build_segments(fmt) if isinstance(fmt, SparseBlockFormat) else None)


def segments(fmt: WeightFormat) -> Segments | None:
    """The segment layout of a `SparseBlockFormat`, built on first call and cached while `fmt` lives.

    None if the tiles are not whole segments or the extension is unavailable.
    """
    return None if cpu.extension() is None else _SEGMENTS.get(fmt)


def _parts(fmt: WeightFormat) -> tuple[cpu.Packed, Segments] | None:
    """The base's packed layout and the residual's segments of a MosaicQuant composite, else None."""
    if not isinstance(fmt, CompositeFormat) or fmt.perm is not None or sorted(fmt.parts) != sorted(PARTS):
        return None
    base, residual = fmt.parts["base"], fmt.parts["residual"]
    if base.name not in ("uniform", "bitplane") or not isinstance(residual, SparseBlockFormat):
        return None
    p = cpu.packed(base)
    s = None if p is None else segments(residual)
    return None if s is None else (p, s)


def sparse_matmul(fmt: WeightFormat, x: torch.Tensor, ctx: MatmulContext | None = None) -> torch.Tensor | None:
    """x [T, in] @ Sᵀ for a `SparseBlockFormat` with c % 32 == 0; None to decline."""
    if not (takes(x, ctx) and x.is_floating_point()):
        return None
    s = segments(fmt)
    if s is None:
        return None
    xf = fp32_rows(x)
    y = xf.new_zeros(x.shape[0], fmt.out_features)
    cpu.extension().sparse_residual_add_(y, xf, s.segments())
    return like(y, x)


def matmul(fmt: WeightFormat, x: torch.Tensor, ctx: MatmulContext | None = None) -> torch.Tensor | None:
    """x [T, in] @ (B + S)ᵀ of a MosaicQuant composite in one fused kernel; None to decline."""
    if not (takes(x, ctx) and x.is_floating_point()):
        return None
    parts = _parts(fmt)
    if parts is None:
        return None
    p, s = parts
    return like(p.matmul(fp32_rows(x), s), x)


def _require(fmt: WeightFormat) -> tuple[cpu.Packed, Segments]:
    parts = _parts(fmt)
    if parts is None:
        raise ValueError(f"not a MosaicQuant composite the CPU kernels run: {fmt.describe()}")
    return parts


def fused_matmul(fmt: CompositeFormat, x: torch.Tensor) -> torch.Tensor:
    """x [T, in] fp32 contiguous @ (B + S)ᵀ: the residual inside the base kernel."""
    p, s = _require(fmt)
    return p.matmul(x, s)


def two_pass_matmul(fmt: CompositeFormat, x: torch.Tensor) -> torch.Tensor:
    """x @ (B + S)ᵀ in two kernels: y = x @ Bᵀ, then y += x @ Sᵀ in place."""
    p, s = _require(fmt)
    y = p.matmul(x)
    cpu.extension().sparse_residual_add_(y, x, s.segments())
    return y


def dense_matmul(fmt: CompositeFormat, x: torch.Tensor) -> torch.Tensor:
    """x @ Bᵀ, the base alone: the cost without a residual."""
    p, _ = _require(fmt)
    return p.matmul(x)


def register() -> bool:
    """Register the kernels if the extension loads ("fused" ahead of "by_parts"); False otherwise."""
    if cpu.extension() is None:
        return False
    register_kernel("composite", "fused", matmul, before="by_parts")
    register_kernel("sparse_blocks", "cpu_sparse", sparse_matmul)
    return True
