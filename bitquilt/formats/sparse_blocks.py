"""Sparse blocks of 4-bit integers: a weight matrix that is zero except in a chosen set of r×c tiles.

The matrix [out, in] is cut into block_rows × block_cols tiles; tile (R, C) covers rows
R·r .. R·r + r − 1 and columns C·c .. C·c + c − 1 and has block id R · (in / c) + C. The stored
tiles hold symmetric 4-bit integers with one fp16 scale each:

    W[R·r + a, C·c + b] = s_k · q_k[a·c + b],   q ∈ [−8, 7],   for tile k with id index[k]

and every other entry is 0. This is the residual branch of MosaicQuant (`bitquilt.solvers.mosaic`):
Ŵ = base + residual as a `CompositeFormat`, so the residual shares the base's 4-bit activations.

Stored tensors
  index    int32 [n]              block ids, strictly increasing
  qweight  int32 [n, r·c/8]       q + 8 ∈ [0, 16) of each tile, row-major, bit-stream packed (`formats.packing`)
  scales   fp16  [n]              one scale per tile

Bits: 4 + (32 + 16)/(r·c) per stored weight; over the whole matrix, n·(4·r·c + 48)/(out·in).
"""

from __future__ import annotations

from typing import Any

import torch

from bitquilt.formats.base import WeightFormat, register_format
from bitquilt.formats.packing import pack, unpack
from bitquilt.formats.uniform import check_shapes

BITS = 4
QMIN, QMAX = -(2 ** (BITS - 1)), 2 ** (BITS - 1) - 1  # −8, 7


def check_block_shape(out_features: int, in_features: int, block: tuple[int, int]) -> None:
    """Raise ValueError unless r×c tiles cover [out, in] exactly and hold a whole number of packed words."""
    r, c = block
    if r <= 0 or c <= 0 or out_features % r or in_features % c:
        raise ValueError(f"residual blocks of {r}×{c} do not tile a {out_features}×{in_features} weight; "
                         f"rows must divide {out_features} and columns {in_features}")
    if r * c % 32:
        raise ValueError(f"residual blocks of {r}×{c} hold {r * c} values; use a multiple of 32 (e.g. 1×32, 16×32)")


def to_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [out, in] -> [n_blocks, r·c], block id order (row-major over tiles), each tile row-major."""
    r, c = block
    out, inp = w.shape
    return w.reshape(out // r, r, inp // c, c).permute(0, 2, 1, 3).reshape(-1, r * c)


def from_blocks(tiles: torch.Tensor, block: tuple[int, int], out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of `to_blocks`."""
    r, c = block
    t = tiles.reshape(out_features // r, in_features // c, r, c).permute(0, 2, 1, 3)
    return t.reshape(out_features, in_features)


def quantize_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 4-bit codes q [n, r·c] and fp16-representable scales [n] of tiles [n, r·c].

    s = max(max(t)/7, −min(t)/8) uses all 16 levels: the larger side of the tile sets the step."""
    s = torch.maximum(tiles.amax(dim=1).clamp(min=0) / QMAX, tiles.amin(dim=1).clamp(max=0) / QMIN)
    s = s.to(torch.float16).float().clamp(min=2**-24)
    q = torch.clamp(torch.round(tiles / s[:, None]), QMIN, QMAX)
    return q, s


@register_format
class SparseBlockFormat(WeightFormat):
    name = "sparse_blocks"
    supported_bits = (BITS,)
    supported_group_sizes = ()

    def __init__(self, index: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, out_features: int,
                 in_features: int, block: tuple[int, int]):
        self.block = (int(block[0]), int(block[1]))
        check_block_shape(out_features, in_features, self.block)
        n = index.shape[0] if index.dim() == 1 else -1
        check_shapes({"index": index, "qweight": qweight, "scales": scales},
                     {"index": (n,), "qweight": (n, self.block[0] * self.block[1] * BITS // 32), "scales": (n,)},
                     f"{self.block[0]}×{self.block[1]} blocks of a {out_features}×{in_features} weight")
        if n and (index.min() < 0 or index.max() >= self.n_blocks_of(out_features, in_features)
                  or (index[1:] <= index[:-1]).any()):
            raise ValueError("residual block ids must be strictly increasing and inside the weight")
        self.index, self.qweight, self.scales = index, qweight, scales
        self.out_features, self.in_features = out_features, in_features

    def n_blocks_of(self, out_features: int, in_features: int) -> int:
        return out_features // self.block[0] * (in_features // self.block[1])

    @property
    def n_blocks(self) -> int:
        """Tiles in the whole matrix (stored or not)."""
        return self.n_blocks_of(self.out_features, self.in_features)

    @property
    def density(self) -> float:
        """Fraction of the matrix's tiles that are stored."""
        return self.index.numel() / self.n_blocks

    @classmethod
    def from_codes(cls, index: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int,
                   in_features: int, block: tuple[int, int]) -> SparseBlockFormat:
        """Tiles `index` (any order) holding codes [n, r·c] ∈ [−8, 7] (tile-local row-major) and scales [n]."""
        index, order = torch.sort(index.to(torch.int64))
        words = pack((codes[order].to(torch.int64) - QMIN).reshape(len(index), block[0] * block[1]), BITS)
        return cls(index.to(torch.int32), words, scales[order].to(torch.float16), out_features, in_features, block)

    @classmethod
    def from_dense(cls, w: torch.Tensor, index: torch.Tensor, block: tuple[int, int]) -> SparseBlockFormat:
        """The tiles `index` of w [out, in], each quantized on its own symmetric 4-bit grid."""
        check_block_shape(*w.shape, block)
        q, s = quantize_tiles(to_blocks(w.float(), block)[index.to(torch.int64)])
        return cls.from_codes(index, q, s, *w.shape, block)

    def codes(self) -> torch.Tensor:
        """q ∈ [−8, 7] of the stored tiles, int [n, r·c]."""
        return unpack(self.qweight, BITS, self.block[0] * self.block[1]).to(torch.int32) + QMIN

    def tiles(self) -> torch.Tensor:
        """The stored tiles dequantized, fp32 [n, r·c]."""
        return self.codes().float() * self.scales.float()[:, None]

    def dequantize(self, selector: Any = None) -> torch.Tensor:
        dense = torch.zeros(self.n_blocks, self.block[0] * self.block[1], device=self.index.device)
        dense[self.index.long()] = self.tiles()
        return from_blocks(dense, self.block, self.out_features, self.in_features)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"index": self.index, "qweight": self.qweight, "scales": self.scales}

    def meta(self) -> dict[str, Any]:
        return {"out_features": self.out_features, "in_features": self.in_features, "block": list(self.block)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> SparseBlockFormat:
        return cls(tensors["index"], tensors["qweight"], tensors["scales"], int(meta["out_features"]),
                   int(meta["in_features"]), tuple(meta["block"]))

    def describe(self) -> str:
        return f"sparse int4 {self.block[0]}x{self.block[1]} blocks {100 * self.density:.1f}%"
