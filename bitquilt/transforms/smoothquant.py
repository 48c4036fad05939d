"""SmoothQuant (Xiao et al., 2023): migrate activation outliers into the weights, per input channel.

For a shared input with producer `prev` and consumer weights W_i, input channel j is scaled by

    s_j = max|X_j|^α / max_i max|W_i[:, j]|^(1−α),    X ← X diag(s)⁻¹,  W_i ← W_i diag(s)

(`scaling.fold_scales` folds diag(s)⁻¹ into the producer). α is fixed, or searched per shared input,
minimising the output error of its linears with activations and weights quantized as the recipe will,

    L(α) = Σ_i ‖Q_a,i(X diag(s)⁻¹) Q_w,i(W_i diag(s))ᵀ − X W_iᵀ‖²   on sampled calibration tokens,

against L without smoothing (s = 1), which wins if no α helps. Groups whose consumers apply an
online Hadamard to their input (after QuaRot) are left alone: scales cannot cross it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bitquilt.calib.capture import collect_stats, sample_inputs
from bitquilt.calib.stages import BlockContext, register_stage
from bitquilt.models.adapters import SharedInput
from bitquilt.nn.act_quant import ActQuantConfig, fake_quantize
from bitquilt.nn.online import has_input_transform
from bitquilt.registry import option
from bitquilt.solvers.base import LayerSpec
from bitquilt.solvers.rtn import fake_quantize as fake_quantize_weight
from bitquilt.transforms.scaling import can_fold, fold_scales


@dataclass(frozen=True)
class SmoothQuantOptions:
    alpha: float | None = option(None, "migration strength; None: searched per shared input over `alphas`")
    alphas: tuple[float, ...] = option((0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9), "candidates of the search")
    max_tokens: int = option(512, "calibration tokens sampled for the search")


def smoothing_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    s = act_absmax.clamp(min=1e-5).pow(alpha) / weight_absmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


def shared_input_loss(x: torch.Tensor, weights: list[torch.Tensor], specs: list[LayerSpec],
               acts: list[ActQuantConfig | None], s: torch.Tensor, refs: list[torch.Tensor]) -> float:
    """L for scales s (s = 1: no smoothing) on sampled inputs x [tokens, in]; refs[i] = x W_iᵀ."""
    loss = 0.0
    xs = x / s
    for w, spec, act, ref in zip(weights, specs, acts, refs):
        xq = fake_quantize(xs, act) if act is not None else xs
        loss += float((xq @ fake_quantize_weight(w * s, spec).T - ref).pow(2).sum())
    return loss


def search_alpha(x, weights, specs, acts, act_absmax, weight_absmax, alphas) -> tuple[float | None, dict]:
    """The best α (None: no smoothing) and the loss of each candidate."""
    refs = [x @ w.T for w in weights]
    losses = {None: shared_input_loss(x, weights, specs, acts, torch.ones_like(act_absmax), refs)}
    for a in alphas:
        losses[a] = shared_input_loss(x, weights, specs, acts, smoothing_scales(act_absmax, weight_absmax, a), refs)
    return min(losses, key=losses.get), losses


def _crosses_online_transform(block: nn.Module, shared: SharedInput) -> bool:
    return any(has_input_transform(block.get_submodule(n)) for n in shared.linears)


@register_stage("smoothquant", scope="block", kind="transform", options=SmoothQuantOptions)
@torch.no_grad()
def smoothquant(ctx: BlockContext, opts: SmoothQuantOptions) -> dict[str, Any]:
    block, inputs, kwargs = ctx.block, ctx.inputs, ctx.kwargs
    foldable = [g for g in ctx.arch.shared_inputs if can_fold(block, g) and not _crosses_online_transform(block, g)]
    first = {g.dense_reader(): g for g in foldable}  # an MoE's router: every token
    stats = collect_stats(block, list(first), inputs, kwargs, hessian=False)  # ranges only
    samples = sample_inputs(block, list(first), inputs, kwargs, opts.max_tokens) if opts.alpha is None else {}
    report = {}
    for name, shared in first.items():
        full = [ctx.full(n) for n in shared.linears]
        specs = [ctx.plan.weight(f) for f in full]
        if any(s is None for s in specs):
            continue  # a full-precision consumer
        weights = [block.get_submodule(n).weight.float() for n in shared.linears]
        weight_absmax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
        act_absmax = stats[name].act_absmax
        alpha, gain = opts.alpha, None
        if alpha is None:
            acts = [ctx.plan.act(f) for f in full]
            alpha, losses = search_alpha(samples[name], weights, specs, acts, act_absmax, weight_absmax, opts.alphas)
            gain = losses[None] / losses[alpha]
        if alpha is not None:
            fold_scales(block, ctx.arch, shared, smoothing_scales(act_absmax, weight_absmax, alpha))
        report[shared.prev] = {"alpha": alpha, "loss_gain": gain}
    return report
