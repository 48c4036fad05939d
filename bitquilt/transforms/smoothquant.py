"""SmoothQuant (Xiao et al., 2023): migrate activation outliers into the weights, per input channel.

For an input group with producer `prev` and consumer weights W_i, input channel j is scaled by

    s_j = max|X_j|^α / max_i max|W_i[:, j]|^(1−α),    X ← X diag(s)⁻¹,  W_i ← W_i diag(s)

(`scaling.fold_scales` folds diag(s)⁻¹ into the producer). α is fixed, or searched per group,
minimising the group's output error with activations and weights quantized as the recipe will,

    L(α) = Σ_i ‖Q_a,i(X diag(s)⁻¹) Q_w,i(W_i diag(s))ᵀ − X W_iᵀ‖²   on sampled calibration tokens,

against L without smoothing (s = 1), which wins if no α helps. Groups whose consumers apply an
online Hadamard to their input (after QuaRot) are left alone: scales cannot cross it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bitquilt.calib.capture import collect_stats, sample_inputs
from bitquilt.models.adapters import Architecture, InputGroup
from bitquilt.nn.act_quant import ActQuantConfig, fake_quantize
from bitquilt.solvers.base import LayerSpec
from bitquilt.transforms import register_transform
from bitquilt.transforms.awq import fake_quantize as fake_quantize_weight
from bitquilt.transforms.scaling import can_fold, fold_scales


@dataclass(frozen=True)
class SmoothQuantOptions:
    alpha: float | None = None  # migration strength; None: searched per group over `alphas`
    alphas: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    max_tokens: int = 512  # calibration tokens sampled for the search
    act_config_for: Callable[[str], ActQuantConfig | None] | None = None  # the recipe's, per linear


def smoothing_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    s = act_absmax.clamp(min=1e-5).pow(alpha) / weight_absmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


def group_loss(x: torch.Tensor, weights: list[torch.Tensor], specs: list[LayerSpec],
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
    losses = {None: group_loss(x, weights, specs, acts, torch.ones_like(act_absmax), refs)}
    for a in alphas:
        losses[a] = group_loss(x, weights, specs, acts, smoothing_scales(act_absmax, weight_absmax, a), refs)
    return min(losses, key=losses.get), losses


def _crosses_online_transform(block: nn.Module, group: InputGroup) -> bool:
    return any(getattr(getattr(block.get_submodule(n), "act_quant", None), "hadamard", False) for n in group.linears)


@register_transform("smoothquant", scope="block", recipe_fields=("act_config_for",))
@torch.no_grad()
def smoothquant(block: nn.Module, arch: Architecture, inputs: list[torch.Tensor], kwargs: dict[str, Any],
                spec_for, options: dict[str, Any] | None = None, block_name: str = "") -> dict[str, Any]:
    opts = SmoothQuantOptions(**(options or {}))
    groups = [g for g in arch.groups if can_fold(block, g) and not _crosses_online_transform(block, g)]
    first = {g.linears[0]: g for g in groups}
    stats = collect_stats(block, list(first), inputs, kwargs, hessian=False)  # ranges only
    samples = sample_inputs(block, list(first), inputs, kwargs, opts.max_tokens) if opts.alpha is None else {}
    report = {}
    for name, group in first.items():
        full = [f"{block_name}.{n}" for n in group.linears]
        specs = [spec_for(f) for f in full]
        if any(s is None for s in specs):
            continue  # a full-precision consumer
        weights = [block.get_submodule(n).weight.float() for n in group.linears]
        weight_absmax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
        act_absmax = stats[name].act_absmax
        alpha, gain = opts.alpha, None
        if alpha is None:
            acts = [opts.act_config_for(f) if opts.act_config_for else None for f in full]
            alpha, losses = search_alpha(samples[name], weights, specs, acts, act_absmax, weight_absmax, opts.alphas)
            gain = losses[None] / losses[alpha]
        if alpha is not None:
            fold_scales(block, arch, group, smoothing_scales(act_absmax, weight_absmax, alpha))
        report[group.prev] = {"alpha": alpha, "loss_gain": gain}
    return report
