"""AWQ (Lin et al., 2024): activation-aware per-channel scales searched on calibration data.

For each shared input, s = mean|x|^α (normalised so √(max·min) = 1) is searched over
α ∈ {0, 1/n, ..., (n−1)/n}, minimising the output error of its linears after quantizing W·diag(s),

    L(α) = Σ_linears ‖X Wᵀ − X (Q(W diag s) diag s⁻¹)ᵀ‖² = Σ tr(D H Dᵀ),  H = XᵀX / n,

computed through the Hessian instead of stored activations. Each product D·H costs rows × inputs², so on wide
layers (an 8B model's MLP) the search scores α > 0 on a sample of each linear's output rows (`rows`): L is a sum
over rows, whose errors at α = 0 are heavy-tailed, so the sample is the heaviest half plus an even sample of the
rest in error order, each standing for the rows it skipped (a stratified estimate of L). The best `REFINED`
estimates are then scored on every row and the best of those is taken. The best s is folded into the producer
(norm or linear) and the consumers, then the engine's solver quantizes as usual.
Q is RTN on each layer's grid, or on `bits` when set: a MoBiQuant layer holds every slice (8 bits of
residual slices), where the search would protect nothing, so `awq+mobiquant` searches at the width the
checkpoint is meant to run at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from bitquilt.calib.capture import collect_stats
from bitquilt.calib.compute import compute_dtype
from bitquilt.calib.stages import BlockContext, register_stage
from bitquilt.formats.uniform import UniformFormat
from bitquilt.registry import option
from bitquilt.solvers.base import LayerSpec, row_errors
from bitquilt.solvers.rtn import fake_quantize
from bitquilt.transforms.scaling import can_fold, fold_scales


@dataclass(frozen=True)
class AWQOptions:
    grid: int = option(20, "number of α values searched in [0, 1)")
    rows: int = option(512, "output rows per linear that estimate the loss at α > 0 (the heaviest half and an even "
                       "sample of the rest); the best 3 estimates are scored on all rows (0: all rows at every α)")
    bits: int = option(0, "weight width the search quantizes at (0: each layer's own; e.g. 4 with awq+mobiquant, "
                       "whose layers hold 8 bits of slices)")

    def __post_init__(self) -> None:
        if self.rows < 0:
            raise ValueError(f"awq: rows must be ≥ 0 (output rows per linear scored at each α; 0: all), "
                             f"got {self.rows}")
        if self.bits and self.bits not in UniformFormat.supported_bits:
            raise ValueError(f"awq: bits must be 0 (each layer's own) or one of "
                             f"{', '.join(map(str, UniformFormat.supported_bits))}; got {self.bits}")


REFINED = 3  # the best estimated α values scored again on every row


def search_scales(
    weights: list[torch.Tensor], specs: list[LayerSpec], hessian: torch.Tensor, absmean: torch.Tensor, grid: int,
    products: torch.dtype = torch.float32, rows: int = 0,
) -> tuple[torch.Tensor, int, float]:
    """The α-grid search (module docstring): (best scales, index of the best α, L(0) / L(best)), products in
    `products`, α > 0 estimated on `rows` output rows per linear when some linear has more (0: never)."""
    if products != torch.float32:
        hessian = hessian.to(products)  # once, not at every α
    x = absmean.clamp(min=1e-8)
    candidates = [normalised(x.pow(i / grid)) for i in range(grid)]

    def errors(i: int, w: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
        s = candidates[i]
        return row_errors(w, fake_quantize(w * s, spec) / s, hessian, products)

    def loss(i: int) -> float:
        return sum(float(errors(i, w, spec).sum()) for w, spec in zip(weights, specs))

    if not rows or all(w.shape[0] <= rows for w in weights):
        exact = {i: loss(i) for i in range(grid)}
    else:
        at_zero = [errors(0, w, spec) for w, spec in zip(weights, specs)]
        exact = {0: sum(float(e.sum()) for e in at_zero)}
        samples = [stratified_rows(e, rows) for e in at_zero]
        estimate = [sum(float((e[idx] * weight).sum()) for e, (idx, weight) in zip(at_zero, samples))]
        estimate += [sum(float((errors(i, w[idx], spec) * weight).sum())
                         for w, spec, (idx, weight) in zip(weights, specs, samples)) for i in range(1, grid)]
        for i in sorted(range(grid), key=estimate.__getitem__)[:REFINED]:
            exact.setdefault(i, loss(i))
    best = min(exact, key=exact.__getitem__)
    return candidates[best], best, exact[0] / max(exact[best], 1e-30)


def normalised(s: torch.Tensor) -> torch.Tensor:
    return s / (s.max() * s.min()).sqrt()


def stratified_rows(errors: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row indices, weights): of rows with these errors, the heaviest rows//2 (weight 1) and the middle row of each
    even stride through the rest in decreasing error, weighted by the rows it stands for; all rows (weight 1) when
    there are ≤ `rows`."""
    n = errors.numel()
    if n <= rows:
        return torch.arange(n, device=errors.device), torch.ones(n, device=errors.device)
    order = torch.argsort(errors, descending=True)
    heavy, rest = order[: rows // 2], order[rows // 2:]
    step = math.ceil(rest.numel() / (rows - rows // 2))
    sample = rest[step // 2:: step]  # the middle row of each stride of `step`
    weight = torch.cat([torch.ones(heavy.numel(), device=errors.device),
                        torch.full((sample.numel(),), rest.numel() / sample.numel(), device=errors.device)])
    return torch.cat([heavy, sample]), weight


@register_stage("awq", scope="block", kind="transform", options=AWQOptions)
@torch.no_grad()
def awq(ctx: BlockContext, opts: AWQOptions) -> dict[str, Any]:
    block = ctx.block
    foldable = [g for g in ctx.arch.shared_inputs if can_fold(block, g)]
    first = {g.dense_reader(): g for g in foldable}  # an MoE's router: every token
    stats = collect_stats(block, list(first), ctx.inputs, ctx.kwargs)
    report = {}
    for name, shared in first.items():
        specs = [ctx.plan.weight(ctx.full(n)) for n in shared.linears]
        if any(s is None for s in specs):
            continue  # a full-precision consumer: nothing to protect
        if opts.bits:
            specs = [replace(s, bits=opts.bits) for s in specs]
        weights = [block.get_submodule(n).weight.float() for n in shared.linears]
        s, best, gain = search_scales(weights, specs, stats[name].hessian, stats[name].act_absmean, opts.grid,
                                      compute_dtype(), opts.rows)
        fold_scales(block, ctx.arch, shared, s)
        report[shared.prev] = {"alpha": best / opts.grid, "loss_gain": gain}
    return report
