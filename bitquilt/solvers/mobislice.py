"""MoBiSlice (MoBiQuant, 2026): one stored weight that serves many precisions, as residual bit slices.

    R₁ = W,   W_e = Q_{b_e}(R_e),   R_{e+1} = R_e − W_e,   e = 1..E
    W^(k) = Σ_{e ≤ k} W_e   uses the first k slices: b₁ + … + b_k bits per weight

Each slice quantizes what the slices before it left over, so W^(k) approaches W as k grows and
no weight is stored twice: one checkpoint, E precisions (`dequantize(selector=k)`; per token
with `MatmulContext.slices`). Q_b works per (row, group of `group_size` columns) on the residual's
range [lo, hi], on one of two grids:

  nested (default)  the mid-rise grid: 2^b equal cells of width Δ = (hi − lo)/2^b, level i at the
                    centre of cell i, lo + (i + ½)·Δ. Every residual left is within ±Δ/2, so the next
                    slice's cells split these: W^(k) is a uniform grid of Σ b_e bits and the error
                    falls about 4× per added bit, at every prefix.
  lloyd             the min-max grid lo + i·(hi − lo)/(2^b − 1), then `iters` alternations of a
                    least-squares refit of the b + 1 coefficients (planes fixed) and a reassignment
                    of every weight to its nearest level (for a 1-bit slice, 2-means). The lowest error
                    for one slice alone, but its unequal cells leave residuals the slices after it refine
                    poorly, so the error falls less per added bit than the nested grid's
                    (docs/methods/mobiquant.md).

A slice holds its levels as b bit-planes with coefficients C₀ (the lowest level) and C_i = Δ·2^(i−1)
(`formats.bitplane`), so the bit-plane kernels run it; the weight is a `CompositeFormat` of slices
`s1..sE`. Storage: Σ_e (b_e + 16·(b_e + 1)/group_size) bits per weight (fp16 coefficients).

`--w-bits` is the full precision Σ b_e; the default slices are a 2-bit base and 1-bit slices
(w_bits 8: 2,1,1,1,1,1,1, the paper's configuration).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitquilt.formats.bitplane import BitplaneFormat
from bitquilt.formats.composite import CompositeFormat
from bitquilt.formats.uniform import resolve_group_size, row_groups
from bitquilt.registry import option
from bitquilt.solvers.base import LayerSpec, LinearStats, check_finite, register_solver
from bitquilt.solvers.bpdq import bit_patterns, code_planes, fit_coeffs

TOTAL_BITS = (2, 3, 4, 5, 6, 7, 8)
GRIDS = ("nested", "lloyd")


@dataclass(frozen=True)
class MoBiSliceOptions:
    slices: tuple[int, ...] = option((), "bits of each slice, most significant first, summing to --w-bits "
                                     "(default: a 2-bit base, then 1-bit slices)")
    grid: str = option("nested", "each slice's grid: nested (mid-rise cells that the next slice halves; error "
                       "≈ 4× lower per bit at every precision) or lloyd (min-max grid refitted `iters` times: "
                       "lowest error for the first slice, poor refinement after it)")
    iters: int = option(3, "lloyd grid: least-squares refits of each slice's coefficients, with the weights "
                        "reassigned to the nearest level between them (0: the plain min-max grid)")

    def __post_init__(self) -> None:
        bad = [b for b in self.slices if b not in BitplaneFormat.plane_counts]
        if bad:
            raise ValueError(f"mobislice: slice widths must be in {BitplaneFormat.plane_counts}, "
                             f"got {list(self.slices)}")
        if self.grid not in GRIDS:
            raise ValueError(f"mobislice: grid must be one of {', '.join(GRIDS)}, got {self.grid!r}")
        if self.iters < 0:
            raise ValueError(f"mobislice: iters must be ≥ 0, got {self.iters}")


def slice_bits(total: int, slices: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The slice widths for a full precision of `total` bits (given ones are checked against it)."""
    if not slices:
        return (2,) + (1,) * (total - 2)
    if sum(slices) != total:
        raise ValueError(f"mobislice: slices {list(slices)} sum to {sum(slices)} bits, but the weight has "
                         f"{total} (--w-bits must equal the sum of --slices)")
    return tuple(slices)


def _nested_groups(flat: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [n, g] and coefficients [n, bits + 1] of the rows of flat [n, g] on the mid-rise grid (nested)."""
    lo, hi = flat.min(dim=1, keepdim=True).values, flat.max(dim=1, keepdim=True).values
    step = ((hi - lo) / 2**bits).clamp(min=1e-12)
    codes = torch.floor((flat - lo) / step).clamp(0, 2**bits - 1).to(torch.int64)
    powers = 2.0 ** torch.arange(bits, dtype=torch.float32, device=flat.device)
    coeffs = torch.cat([lo + step / 2, step * powers], dim=1)
    return codes, coeffs


def _lloyd_groups(flat: torch.Tensor, bits: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [n, g] and coefficients [n, bits + 1] of the rows of flat [n, g], each one group (lloyd)."""
    lo, hi = flat.min(dim=1, keepdim=True).values, flat.max(dim=1, keepdim=True).values
    step = ((hi - lo) / (2**bits - 1)).clamp(min=1e-12)
    codes = torch.round((flat - lo) / step).to(torch.int64)  # the min-max grid lo + i·step
    coeffs = torch.cat([lo, step * 2.0 ** torch.arange(bits, dtype=torch.float32, device=flat.device)], dim=1)
    patterns = torch.cat([torch.ones(1, 2**bits), bit_patterns(bits)]).to(flat.device)  # [k + 1, 2^k]
    for i in range(iters):
        coeffs = fit_coeffs(flat, code_planes(codes, bits), None, ridge=1e-6)
        if i < iters - 1:  # Lloyd step: every weight to its group's nearest level
            codes = (flat.unsqueeze(-1) - (coeffs @ patterns).unsqueeze(1)).abs().argmin(dim=-1)
    return codes, coeffs


def quantize_slice(residual: torch.Tensor, bits: int, group_size: int, grid: str = "nested",
                   iters: int = 3) -> BitplaneFormat:
    """Q_b of the module docstring on residual [out, in] on `grid` (nested or lloyd with `iters` refits),
    groups of `group_size` contiguous columns (the last group of a row shorter when the size does not
    divide the width)."""
    rows = residual.shape[0]
    fitted = [_nested_groups(part, bits) if grid == "nested" else _lloyd_groups(part, bits, iters)
              for part in row_groups(residual, group_size)]
    codes = torch.cat([c.reshape(rows, -1) for c, _ in fitted], dim=1)
    coeffs = torch.cat([k.reshape(rows, -1, bits + 1) for _, k in fitted], dim=1)
    return BitplaneFormat.from_codes(codes, coeffs, bits, group_size)


@register_solver("mobislice", MoBiSliceOptions, needs_stats=False, produces=BitplaneFormat, bits=TOTAL_BITS)
def mobislice(weight: torch.Tensor, stats: LinearStats | None, spec: LayerSpec,
              opts: MoBiSliceOptions) -> CompositeFormat:
    """The slices of one linear (module docstring); statistics are not used."""
    check_finite(weight)
    rows, cols = weight.shape
    BitplaneFormat.check_width(cols)
    g = resolve_group_size(spec.group_size, cols)
    residual, parts = weight, {}
    for e, bits in enumerate(slice_bits(spec.bits, opts.slices), start=1):
        part = quantize_slice(residual, bits, g, opts.grid, opts.iters)
        parts[f"s{e}"] = part
        residual = residual - part.dequantize()
    return CompositeFormat(parts)
