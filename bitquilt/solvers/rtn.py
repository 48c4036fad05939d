"""Round-to-nearest: each group on its own min-max (or MSE-searched) uniform grid."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitquilt.formats.uniform import UniformFormat, UniformGrid, expand_groups, resolve_group_size, row_groups
from bitquilt.registry import option
from bitquilt.solvers.base import LayerSpec, LinearStats, check_finite, register_solver


@dataclass(frozen=True)
class RTNOptions:
    mse: bool = option(False, "search a shrunk range per group for the least error instead of plain min-max")


def quantize_groups(w: torch.Tensor, grid: UniformGrid, group_size: int, mse: bool = False):
    """Codes [out, in], scales and zeros [out, G] for contiguous groups of `group_size` columns
    (the last group of a row is shorter when the size does not divide the width)."""
    rows = w.shape[0]
    codes, scales, zeros = [], [], []
    for part in row_groups(w, group_size):
        scale, zero = grid.fit_mse(part) if mse else grid.fit(part)
        codes.append(grid.quantize(part, scale, zero).reshape(rows, -1))
        scales.append(scale.reshape(rows, -1))
        zeros.append(zero.reshape(rows, -1))
    return torch.cat(codes, dim=1), torch.cat(scales, dim=1), torch.cat(zeros, dim=1)


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    cols = q.shape[1]
    return expand_groups(scale, group_size, cols) * (q - expand_groups(zero, group_size, cols))


def fake_quantize(w: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """w quantized and dequantized by RTN on `spec`'s grid (min-max ranges): the cheap weight
    quantizer scale searches (AWQ, SmoothQuant) evaluate their candidates with."""
    grid = UniformGrid(spec.bits, spec.sym)
    g = resolve_group_size(spec.group_size, w.shape[1])
    return dequantize_groups(*quantize_groups(w, grid, g), g)


@register_solver("rtn", RTNOptions, needs_stats=False)
def rtn(weight: torch.Tensor, stats: LinearStats | None, spec: LayerSpec, opts: RTNOptions) -> UniformFormat:
    check_finite(weight)
    g = resolve_group_size(spec.group_size, weight.shape[1])
    grid = UniformGrid(spec.bits, spec.sym)
    q, scale, zero = quantize_groups(weight, grid, g, opts.mse)
    return UniformFormat.from_codes(q, scale, zero, grid, g)
