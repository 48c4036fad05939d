"""Uniform integer grid: w ≈ s·(q − z) per (row, group), q packed b bits per weight.

Stored tensors
  qweight  int32 [out, in·b/32]   bit-stream packed q ∈ [0, 2^b), see `formats.packing`
  scales   fp16  [out, G]         one scale per row and group of `group_size` columns
  zeros    uint8 [out, G]         asymmetric only; symmetric grids use z = 2^(b−1)
  g_idx    int32 [in]             only for GPTQ act-order with dynamic groups: group of each column

The constructor checks these shapes against the meta (bits, group_size, in_features).
Kernels cut `qweight` into their own layouts and read the grid through `scale_zero()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bitquilt.formats.base import WeightFormat, register_format
from bitquilt.formats.packing import pack, packed_words, unpack


def resolve_group_size(group_size: int, in_features: int) -> int:
    """Concrete group size for a layer: -1 (or anything ≥ the width) means the whole row.

    A size that does not divide the width leaves a shorter last group in each row, as the
    GPTQ reference does (smollm2's width 576 at g128: four groups of 128 and one of 64).
    """
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"group size must be positive or -1 (per channel), got {group_size}")
    return in_features if group_size == -1 else min(group_size, in_features)


def n_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def expand_groups(t: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """[rows, G, ...] per-group values -> [rows, in_features, ...] per-column values (a broadcast: cheap
    forward and backward)."""
    rows, groups, rest = t.shape[0], t.shape[1], t.shape[2:]
    wide = t.unsqueeze(2).expand(rows, groups, group_size, *rest)
    return wide.reshape(rows, groups * group_size, *rest)[:, :in_features]


def row_groups(w: torch.Tensor, group_size: int) -> list[torch.Tensor]:
    """w [rows, in] as one matrix of whole groups [rows·G, group_size], then the shorter last group of
    each row [rows, in mod group_size] when the size does not divide the width."""
    full = w.shape[1] // group_size * group_size
    return [w[:, :full].reshape(-1, group_size)] + ([w[:, full:]] if full < w.shape[1] else [])


def check_shapes(tensors: dict[str, torch.Tensor | None], want: dict[str, tuple[int, ...]], given: str) -> None:
    """Raise ValueError naming each present tensor whose shape is not `want[name]` for the meta `given`: a saved
    layer whose meta was edited (or whose tensors were swapped) is refused instead of dequantizing wrongly."""
    bad = [f"{k} has shape {tuple(t.shape)}, expected {want[k]}" for k, t in tensors.items()
           if t is not None and tuple(t.shape) != want[k]]
    if bad:
        raise ValueError(f"{', '.join(bad)} for {given}")


@dataclass(frozen=True)
class UniformGrid:
    """The b-bit uniform quantizer (GPTQ's min-max convention), scales rounded to fp16."""

    bits: int
    sym: bool = False

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    def fit(self, w: torch.Tensor, shrink: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero for each row of `w` [rows, n] from its range (shrunk by `shrink`)."""
        xmin = w.min(dim=1).values.clamp(max=0) * shrink
        xmax = w.max(dim=1).values.clamp(min=0) * shrink
        if self.sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        flat = (xmin == 0) & (xmax == 0)
        xmin = torch.where(flat, -torch.ones_like(xmin), xmin)
        xmax = torch.where(flat, torch.ones_like(xmax), xmax)
        scale = ((xmax - xmin) / self.maxq).to(torch.float16).float().clamp(min=2**-24)
        if self.sym:
            zero = torch.full_like(scale, (self.maxq + 1) // 2)
        else:
            zero = torch.round(-xmin / scale).clamp(0, self.maxq)
        return scale, zero

    def fit_mse(self, w: torch.Tensor, grid: int = 20, max_shrink: float = 0.2, norm: float = 2.4):
        """Range shrink searched per row to minimise Σ|w − ŵ|^norm (GPTQ's `mse` option)."""
        best_scale, best_zero = self.fit(w)
        best_err = self.error(w, best_scale, best_zero, norm)
        for i in range(1, int(grid * max_shrink) + 1):
            scale, zero = self.fit(w, 1 - i / grid)
            err = self.error(w, scale, zero, norm)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)
        return best_scale, best_zero

    def error(self, w, scale, zero, norm: float = 2.0) -> torch.Tensor:
        return (self.fake(w, scale, zero) - w).abs().pow(norm).sum(dim=1)

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Integer codes q ∈ [0, maxq]; scale/zero broadcast against the last dim of `w`."""
        return torch.clamp(torch.round(w / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, self.maxq)

    def fake(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Quantize-dequantize `w` on this grid."""
        return scale.unsqueeze(-1) * (self.quantize(w, scale, zero) - zero.unsqueeze(-1))


@register_format
class UniformFormat(WeightFormat):
    name = "uniform"
    supported_bits = (2, 3, 4, 8)
    supported_group_sizes = (32, 64, 128, 256, -1)

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        bits: int,
        group_size: int,
        in_features: int,
        g_idx: torch.Tensor | None = None,
    ):
        if bits not in self.supported_bits:
            raise ValueError(f"unsupported bit width {bits}; supported: {self.supported_bits}")
        if group_size <= 0:
            raise ValueError(f"uniform group size must be positive, got {group_size}")
        out, groups = qweight.shape[0], n_groups(in_features, group_size)
        check_shapes({"qweight": qweight, "scales": scales, "zeros": zeros, "g_idx": g_idx},
                     {"qweight": (out, packed_words(in_features, bits)), "scales": (out, groups),
                      "zeros": (out, groups), "g_idx": (in_features,)},
                     f"{bits} bits, group size {group_size}, in_features {in_features}")
        self.qweight, self.scales, self.zeros, self.g_idx = qweight, scales, zeros, g_idx
        self.bits, self.group_size = bits, group_size
        self.out_features, self.in_features = out, in_features

    @property
    def sym(self) -> bool:
        return self.zeros is None

    @classmethod
    def from_codes(
        cls,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        grid: UniformGrid,
        group_size: int,
        g_idx: torch.Tensor | None = None,
    ) -> UniformFormat:
        """Pack integer codes q [out, in] with per-(row, group) scales/zeros [out, G]."""
        return cls(
            qweight=pack(q.to(torch.int64), grid.bits),
            scales=scales.to(torch.float16).contiguous(),
            zeros=None if grid.sym else zeros.to(torch.uint8).contiguous(),
            bits=grid.bits,
            group_size=group_size,
            in_features=q.shape[1],
            g_idx=None if g_idx is None else g_idx.to(torch.int32).contiguous(),
        )

    def codes(self) -> torch.Tensor:
        """q as uint8 [out, in]."""
        return unpack(self.qweight, self.bits, self.in_features)

    def scale_zero(self, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero per (row, group) of `rows` (all by default), each fp32 [rows, G]; a symmetric grid's zero
        is 2^(b−1)."""
        scales = self.scales[rows].float()
        zeros = self.zeros[rows].float() if self.zeros is not None else torch.full_like(scales, 2 ** (self.bits - 1))
        return scales, zeros

    def column_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero of every weight, each [out, in] fp32."""
        scales, zeros = self.scale_zero()
        if self.g_idx is not None:
            idx = self.g_idx.long()
            return scales[:, idx], zeros[:, idx]
        g, n = self.group_size, self.in_features
        return expand_groups(scales, g, n), expand_groups(zeros, g, n)

    def dequantize(self, selector: Any = None) -> torch.Tensor:
        scale, zero = self.column_params()
        return scale * (self.codes().float() - zero)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (integer indices of any shape) of `dequantize()`, shape [*rows.shape, in]: only those rows
        are unpacked (rows are packed apart), with the same arithmetic, so the values are bit-identical."""
        flat = rows.reshape(-1)
        part = UniformFormat(self.qweight[flat], self.scales[flat], None if self.zeros is None else self.zeros[flat],
                             self.bits, self.group_size, self.in_features, self.g_idx)
        return part.dequantize().reshape(*rows.shape, self.in_features)

    @property
    def rows_apart(self) -> bool:
        return self.g_idx is None  # a g_idx is per column

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"qweight": self.qweight, "scales": self.scales}
        if self.zeros is not None:
            out["zeros"] = self.zeros
        if self.g_idx is not None:
            out["g_idx"] = self.g_idx
        return out

    def meta(self) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size, "in_features": self.in_features}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> UniformFormat:
        return cls(
            qweight=tensors["qweight"],
            scales=tensors["scales"],
            zeros=tensors.get("zeros"),
            bits=int(meta["bits"]),
            group_size=int(meta["group_size"]),
            in_features=int(meta["in_features"]),
            g_idx=tensors.get("g_idx"),
        )

    def describe(self) -> str:
        g = "per-channel" if self.group_size == self.in_features else f"g{self.group_size}"
        order = " act-order" if self.g_idx is not None else ""
        return f"uniform w{self.bits} {g} {'sym' if self.sym else 'asym'}{order}"
