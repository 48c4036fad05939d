"""AWQ (Lin et al., 2024): activation-aware per-channel scales searched on calibration data.

For each shared input, s = mean|x|^α (normalised so √(max·min) = 1) is searched over
α ∈ {0, 1/n, ..., (n−1)/n}, minimising the output error of its linears after quantizing W·diag(s),

    L(α) = Σ_linears ‖X Wᵀ − X (Q(W diag s) diag s⁻¹)ᵀ‖² = Σ tr(D H Dᵀ),  H = XᵀX / n,

computed through the Hessian instead of stored activations. The best s is folded into the
producer (norm or linear) and the consumers, then the engine's solver quantizes as usual.
Q is RTN on each layer's grid, or on `bits` when set: a MoBiQuant layer holds every slice (8 bits of
residual slices), where the search would protect nothing, so `awq+mobiquant` searches at the width the
checkpoint is meant to run at.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from bitquilt.calib.capture import collect_stats
from bitquilt.calib.compute import compute_dtype
from bitquilt.calib.stages import BlockContext, register_stage
from bitquilt.formats.uniform import UniformFormat
from bitquilt.registry import option
from bitquilt.solvers.base import LayerSpec, hessian_error
from bitquilt.solvers.rtn import fake_quantize
from bitquilt.transforms.scaling import can_fold, fold_scales


@dataclass(frozen=True)
class AWQOptions:
    grid: int = option(20, "number of α values searched in [0, 1)")
    bits: int = option(0, "weight width the search quantizes at (0: each layer's own; e.g. 4 with awq+mobiquant, "
                       "whose layers hold 8 bits of slices)")

    def __post_init__(self) -> None:
        if self.bits and self.bits not in UniformFormat.supported_bits:
            raise ValueError(f"awq: bits must be 0 (each layer's own) or one of "
                             f"{', '.join(map(str, UniformFormat.supported_bits))}; got {self.bits}")


def search_scales(
    weights: list[torch.Tensor], specs: list[LayerSpec], hessian: torch.Tensor, absmean: torch.Tensor, grid: int,
    products: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, list[float]]:
    """The α-grid search; returns the best scales and the loss at every α (its products in `products`)."""
    if products != torch.float32:
        hessian = hessian.to(products)  # once, not at every α
    x = absmean.clamp(min=1e-8)
    best, best_s, losses = float("inf"), torch.ones_like(x), []
    for i in range(grid):
        s = x.pow(i / grid)
        s = s / (s.max() * s.min()).sqrt()
        loss = 0.0
        for w, spec in zip(weights, specs):
            loss += hessian_error(w, fake_quantize(w * s, spec) / s, hessian, products)
        losses.append(loss)
        if loss < best:
            best, best_s = loss, s
    return best_s, losses


@register_stage("awq", scope="block", kind="transform", options=AWQOptions)
@torch.no_grad()
def awq(ctx: BlockContext, opts: AWQOptions) -> dict[str, Any]:
    block = ctx.block
    foldable = [g for g in ctx.arch.shared_inputs if can_fold(block, g)]
    first = {g.linears[0]: g for g in foldable}
    stats = collect_stats(block, list(first), ctx.inputs, ctx.kwargs)
    report = {}
    for name, shared in first.items():
        specs = [ctx.plan.weight(ctx.full(n)) for n in shared.linears]
        if any(s is None for s in specs):
            continue  # a full-precision consumer: nothing to protect
        if opts.bits:
            specs = [replace(s, bits=opts.bits) for s in specs]
        weights = [block.get_submodule(n).weight.float() for n in shared.linears]
        s, losses = search_scales(weights, specs, stats[name].hessian, stats[name].act_absmean, opts.grid,
                                  compute_dtype())
        fold_scales(block, ctx.arch, shared, s)
        report[shared.prev] = {"alpha": losses.index(min(losses)) / opts.grid, "loss_gain": losses[0] / min(losses)}
    return report
