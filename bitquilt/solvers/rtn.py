"""Round-to-nearest: each group on its own min-max (or MSE-searched) uniform grid."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitquilt.formats.uniform import UniformFormat, UniformGrid, resolve_group_size
from bitquilt.solvers.base import LayerSpec, LinearStats, check_finite, register_solver


@dataclass(frozen=True)
class RTNOptions:
    mse: bool = False  # search a shrunk range per group instead of plain min-max


def quantize_groups(w: torch.Tensor, grid: UniformGrid, group_size: int, mse: bool = False):
    """Codes [out, in], scales and zeros [out, G] for contiguous groups of `group_size` columns."""
    rows, cols = w.shape
    groups = w.reshape(rows * cols // group_size, group_size)
    scale, zero = grid.fit_mse(groups) if mse else grid.fit(groups)
    q = grid.quantize(groups, scale, zero).reshape(rows, cols)
    n_groups = cols // group_size
    return q, scale.reshape(rows, n_groups), zero.reshape(rows, n_groups)


@register_solver("rtn", RTNOptions, needs_stats=False)
def rtn(weight: torch.Tensor, stats: LinearStats | None, spec: LayerSpec, opts: RTNOptions) -> UniformFormat:
    check_finite(weight)
    g = resolve_group_size(spec.group_size, weight.shape[1])
    grid = UniformGrid(spec.bits, spec.sym)
    q, scale, zero = quantize_groups(weight, grid, g, opts.mse)
    return UniformFormat.from_codes(q, scale, zero, grid, g)
