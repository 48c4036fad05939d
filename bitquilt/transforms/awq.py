"""AWQ (Lin et al., 2024): activation-aware per-channel scales searched on calibration data.

For each input group, s = mean|x|^α (normalised so √(max·min) = 1) is searched over
α ∈ {0, 1/n, ..., (n−1)/n}, minimising the group's output error after quantizing W·diag(s),

    L(α) = Σ_linears ‖X Wᵀ − X (Q(W diag s) diag s⁻¹)ᵀ‖² = Σ tr(D H Dᵀ),  H = XᵀX / n,

computed through the Hessian instead of stored activations. The best s is folded into the
producer (norm or linear) and the consumers, then the engine's solver quantizes as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bitquilt.calib.capture import collect_stats
from bitquilt.formats.uniform import UniformGrid, resolve_group_size
from bitquilt.models.adapters import Architecture
from bitquilt.solvers.base import LayerSpec
from bitquilt.solvers.rtn import dequantize_groups, quantize_groups
from bitquilt.transforms import register_transform
from bitquilt.transforms.scaling import can_fold, fold_scales


@dataclass(frozen=True)
class AWQOptions:
    grid: int = 20


def fake_quantize(w: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    grid = UniformGrid(spec.bits, spec.sym)
    g = resolve_group_size(spec.group_size, w.shape[1])
    return dequantize_groups(*quantize_groups(w, grid, g), g)


def search_scales(
    weights: list[torch.Tensor], specs: list[LayerSpec], hessian: torch.Tensor, absmean: torch.Tensor, grid: int
) -> tuple[torch.Tensor, list[float]]:
    """The α-grid search; returns the best scales and the loss at every α."""
    x = absmean.clamp(min=1e-8)
    best, best_s, losses = float("inf"), torch.ones_like(x), []
    for i in range(grid):
        s = x.pow(i / grid)
        s = s / (s.max() * s.min()).sqrt()
        loss = 0.0
        for w, spec in zip(weights, specs):
            d = w - fake_quantize(w * s, spec) / s
            loss += float(torch.einsum("ij,jk,ik->", d, hessian, d))
        losses.append(loss)
        if loss < best:
            best, best_s = loss, s
    return best_s, losses


@register_transform("awq", scope="block")
@torch.no_grad()
def awq(block: nn.Module, arch: Architecture, inputs: list[torch.Tensor], kwargs: dict[str, Any],
        spec_for, options: dict[str, Any] | None = None, block_name: str = "") -> dict[str, Any]:
    opts = AWQOptions(**(options or {}))
    groups = [g for g in arch.groups if can_fold(block, g)]
    first = {g.linears[0]: g for g in groups}
    stats = collect_stats(block, list(first), inputs, kwargs)
    report = {}
    for name, group in first.items():
        specs = [spec_for(f"{block_name}.{n}") for n in group.linears]
        if any(s is None for s in specs):
            continue  # a full-precision consumer: nothing to protect
        weights = [block.get_submodule(n).weight.float() for n in group.linears]
        s, losses = search_scales(weights, specs, stats[name].hessian, stats[name].act_absmean, opts.grid)
        fold_scales(block, arch, group, s)
        report[group.prev] = {"alpha": losses.index(min(losses)) / opts.grid, "loss_gain": losses[0] / min(losses)}
    return report
