"""Bit-plane grid (BPDQ): w ≈ C0 + Σ_{i=1..k} C_i·B_i per (row, group), B_i ∈ {0, 1}.

Each (row, group of `group_size` columns) has its own k + 1 coefficients, so its 2^k levels
need not be evenly spaced: a *variable* grid. The uniform grid s·(q − z) is the special case
C_i = s·2^(i−1), C0 = −s·z (see `BitplaneFormat.from_uniform`).

Stored tensors (the layout the LUT kernels read)
  planes  int32 [k, out, in/32]    plane i (0 = least significant, coefficient C_{i+1}): bit j of
                                   word w of row r is B_{i+1}[r, 32·w + j] (`pack(·, 1)` layout)
  coeffs  fp16  [out, G, k + 1]    coeffs[r, g, 0] = C0, coeffs[r, g, i] = C_i
Meta: bits k, group_size, in_features. Column c belongs to group c // group_size; when the size
does not divide the width, the last group of each row is shorter (G = ⌈in/group_size⌉).
Cost: k + 16·(k + 1)·G/in bits per weight (k + 16·(k + 1)/group_size when it divides).
Kernels read the planes through `plane_bytes()`.
"""

from __future__ import annotations

from typing import Any

import torch

from bitquilt.formats.base import WeightFormat, register_format
from bitquilt.formats.packing import WORD_BITS, bit_planes, pack, unpack
from bitquilt.formats.uniform import UniformFormat, n_groups


def combine(coeffs: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """C0 + C1·B1 + … + Ck·Bk in fp32, summed in plane order.

    coeffs [..., k + 1] broadcasts against each plane of planes [k, ...]. Solver and format
    both evaluate levels through this one function, so a weight dequantizes to bit-for-bit
    the level the solver chose.
    """
    c = coeffs.float()
    out = c[..., 0]
    for i in range(planes.shape[0]):
        out = out + c[..., i + 1] * planes[i].float()
    return out


def combine_groups(coeffs: torch.Tensor, planes: torch.Tensor, group_size: int) -> torch.Tensor:
    """Ŵ [rows, in] from per-(row, group) coefficients [rows, G, k + 1] and planes [k, rows, in]: the levels of
    each whole group by broadcasting its coefficients over its columns (`combine`; no per-column copy of them,
    forward or backward), then the shorter last group when the size does not divide the width."""
    k, rows, cols = planes.shape
    full = cols // group_size * group_size
    whole = planes[..., :full].reshape(k, rows, full // group_size, group_size)
    out = combine(coeffs[:, : full // group_size].unsqueeze(2), whole).reshape(rows, full)
    if full == cols:
        return out
    return torch.cat([out, combine(coeffs[:, -1:], planes[..., full:])], dim=1)


@register_format
class BitplaneFormat(WeightFormat):
    name = "bitplane"
    supported_bits = (2, 3, 4)  # what a recipe may ask of a bit-plane grid
    plane_counts = (1, 2, 3, 4)  # what the format holds: 1-plane weights are slices of multi-part weights
    supported_group_sizes = UniformFormat.supported_group_sizes

    def __init__(self, planes: torch.Tensor, coeffs: torch.Tensor, bits: int, group_size: int, in_features: int):
        if bits not in self.plane_counts:
            raise ValueError(f"unsupported bit-plane count {bits}; supported: {self.plane_counts}")
        if group_size <= 0:
            raise ValueError(f"bit-planes need a positive group size, got {group_size}")
        self.check_width(in_features)
        out = coeffs.shape[0]
        want_planes = (bits, out, in_features // WORD_BITS)
        want_coeffs = (out, n_groups(in_features, group_size), bits + 1)
        if tuple(planes.shape) != want_planes or tuple(coeffs.shape) != want_coeffs:
            raise ValueError(
                f"bitplane tensors have shapes planes {tuple(planes.shape)}, coeffs {tuple(coeffs.shape)}; "
                f"expected {want_planes} and {want_coeffs}"
            )
        self.planes, self.coeffs = planes, coeffs
        self.bits, self.group_size = bits, group_size
        self.out_features, self.in_features = out, in_features

    @staticmethod
    def check_width(in_features: int) -> None:
        """Raise unless `in_features` columns can be packed as bit-planes."""
        if in_features % WORD_BITS:
            raise ValueError(f"bit-planes need in_features divisible by {WORD_BITS}, got {in_features}")

    @classmethod
    def from_codes(cls, codes: torch.Tensor, coeffs: torch.Tensor, bits: int, group_size: int) -> BitplaneFormat:
        """Pack codes [out, in] in [0, 2^bits) (bit i = plane i) with coefficients [out, G, bits + 1]."""
        codes = codes.to(torch.int64)
        return cls(
            planes=torch.stack([pack((codes >> i) & 1, 1) for i in range(bits)]),
            coeffs=coeffs.to(torch.float16).contiguous(),
            bits=bits,
            group_size=group_size,
            in_features=codes.shape[1],
        )

    @classmethod
    def from_uniform(cls, u: UniformFormat) -> BitplaneFormat:
        """The uniform grid s·(q − z) as bit-planes: B = the bits of q, C_i = s·2^(i−1), C0 = −s·z.

        The planes and C_1..C_k are exact (s is fp16; times a power of two). C0 = −s·z is stored
        in fp16, which is exact for symmetric grids (z = 2^(k−1)) and whenever s·z has at most 11
        significant bits; otherwise it is rounded to nearest, so each group is shifted by at most
        half an fp16 ulp of s·z (≤ z·2^−11 of a step).
        """
        if u.g_idx is not None:
            raise ValueError("cannot express an act-order (g_idx) uniform format as contiguous bit-plane groups")
        scale, zero = u.scale_zero()
        steps = scale.unsqueeze(-1) * 2.0 ** torch.arange(u.bits, dtype=torch.float32, device=scale.device)
        coeffs = torch.cat([(-scale * zero).unsqueeze(-1), steps], dim=-1)
        return cls.from_codes(u.codes(), coeffs, u.bits, u.group_size)

    def unpacked_planes(self) -> torch.Tensor:
        """B as uint8 [k, out, in]."""
        return unpack(self.planes, 1, self.in_features)

    def plane_bytes(self, rows: slice = slice(None)) -> torch.Tensor:
        """B of `rows` (all by default) 8 columns a byte, uint8 [k, rows, in/8]: bit j of byte p of plane i is
        B_{i+1}[:, 8p + j]."""
        return bit_planes(self.planes[:, rows], 1, self.in_features)[0]

    def dequantize(self, selector: Any = None) -> torch.Tensor:
        return combine_groups(self.coeffs, self.unpacked_planes(), self.group_size)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"planes": self.planes, "coeffs": self.coeffs}

    def meta(self) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size, "in_features": self.in_features}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> BitplaneFormat:
        return cls(
            planes=tensors["planes"],
            coeffs=tensors["coeffs"],
            bits=int(meta["bits"]),
            group_size=int(meta["group_size"]),
            in_features=int(meta["in_features"]),
        )

    def describe(self) -> str:
        g = "per-channel" if self.group_size == self.in_features else f"g{self.group_size}"
        return f"bitplane w{self.bits} {g}"
