"""MoBiRoute: per-token choice of how many residual slices of a multi-part weight a token uses.

A `SliceRouter` sits at the "router" slot of a `QuantLinear` whose weight is E cumulative slices
(`--method mobiquant`). For the linear's input x_t it computes E − 1 logits, one per optional slice
(slice 1 is always used), by a small MLP on the token's direction and log magnitude:

    f_t = [x_t / rms(x_t), log rms(x_t)],   h_t = W₂·relu(W₁ f_t + c₁) + c₂   ∈ R^(E−1)
    l_{t,1} = h_{t,1},   l_{t,j} = l_{t,j−1} − softplus(h_{t,j})   (j = 2..E−1)

so the logits fall with j and "slice j + 1 on" implies every slice before it is on. At run time
slice j + 1 is used when σ(l_{t,j}) > δ, i.e. l_{t,j} > τ = logit(δ), and the token uses
k_t = 1 + #{j : l_{t,j} > τ} slices: b₁ + … + b_{k_t} bits per weight. A larger τ gives every
token fewer (or as many) slices, so the realised average bits fall monotonically with τ.

The one global knob: `set_precision(model, avg_bits)` sets τ in every router so that the model's
weight-averaged bits per token hit avg_bits. Each router holds `curve`, its mean bits per token
over calibration tokens at each τ of `TAU_GRID` (measured when it was calibrated); the model's
curve is their average weighted by weight count, and τ is interpolated on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from bitquilt.flag_checks import in_routed_range
from bitquilt.formats.base import MatmulContext
from bitquilt.kernels import router as router_kernel
from bitquilt.nn.online import get, register_online
from bitquilt.nn.quant_linear import QuantLinear, multi_part_linears

TAU_GRID = torch.linspace(-12.0, 12.0, 193)  # logit thresholds the calibration curves are measured at


def prefix_bits(widths: tuple[int, ...] | list[int]) -> torch.Tensor:
    """[0, b₁, b₁ + b₂, …]: entry k is the bits per weight of a token using the first k slices."""
    return torch.tensor([0, *widths]).cumsum(0)


@register_online
class SliceRouter(nn.Module):
    """Per-token slice counts for one linear (module docstring)."""

    def __init__(self, in_features: int, slice_bits: tuple[int, ...] | list[int], hidden: int = 16):
        super().__init__()
        if len(slice_bits) < 2:
            raise ValueError(f"a router needs at least 2 slices to choose between, got {list(slice_bits)}")
        self.in_features, self.slice_bits, self.hidden = in_features, tuple(int(b) for b in slice_bits), hidden
        self.fc1 = nn.Linear(in_features + 1, hidden)
        self.fc2 = nn.Linear(hidden, len(slice_bits) - 1)
        self.register_buffer("threshold", torch.zeros(()))  # τ = logit(δ)
        self.register_buffer("curve", torch.full((len(TAU_GRID),), float("nan")))  # mean bits at each τ

    def init_for(self, target_bits: float) -> None:
        """Start near "every token uses the slices that fit `target_bits`": l_j = 2·(k* − ½ − j)."""
        k = max(1, int((prefix_bits(self.slice_bits)[1:] <= target_bits + 1e-6).sum()))
        with torch.no_grad():
            self.fc2.weight.mul_(0.1)
            self.fc2.bias[0] = 2.0 * (k - 1.5)
            self.fc2.bias[1:] = math.log(math.e**2 - 1)  # softplus⁻¹(2): logits 2 apart

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """l [..., E − 1], falling along the last dim, for inputs x [..., in]."""
        x = x.float()
        rms = x.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()
        h = self.fc2(F.relu(self.fc1(torch.cat([x / rms, rms.log()], dim=-1))))
        return torch.cat([h[..., :1], -F.softplus(h[..., 1:])], dim=-1).cumsum(-1)

    def counts(self, x: torch.Tensor) -> torch.Tensor:
        """k_t int64 [...]: slices each token uses at the current threshold (one compiled call when
        the CPU kernels load, else the reference below)."""
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        fast = router_kernel.slice_counts(rows, self.fc1, self.fc2, self.threshold.item())
        if fast is not None:
            return fast if rows is x else fast.reshape(x.shape[:-1])
        with torch.no_grad():
            return 1 + (self.logits(x) > self.threshold).sum(-1)

    def bits_of(self, counts: torch.Tensor) -> torch.Tensor:
        """b₁ + … + b_k for slice counts k."""
        return prefix_bits(self.slice_bits).to(counts.device)[counts].float()

    def forward(self, x: torch.Tensor) -> MatmulContext:
        return MatmulContext(slices=self.counts(x))

    def to_dict(self) -> dict[str, Any]:
        return {"in_features": self.in_features, "slice_bits": list(self.slice_bits), "hidden": self.hidden}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SliceRouter:
        return cls(d["in_features"], d["slice_bits"], d["hidden"])

    def extra_repr(self) -> str:
        return f"slices={list(self.slice_bits)}, hidden={self.hidden}, δ={torch.sigmoid(self.threshold):.3f}"


def routed_linears(model: nn.Module) -> dict[str, tuple[QuantLinear, SliceRouter]]:
    """{name: (linear, router)} of every sliced linear with a router."""
    return {n: (m, r) for n, m in multi_part_linears(model).items() if isinstance(r := get(m, "router"), SliceRouter)}


def has_routers(model: nn.Module) -> bool:
    return bool(routed_linears(model))


def model_curve(model: nn.Module) -> torch.Tensor:
    """Mean bits per weight at each τ of TAU_GRID: the routers' curves averaged by weight count."""
    routed = routed_linears(model)
    if not routed:
        raise ValueError("the model has no slice routers; quantize it with --method mobiquant")
    weights = torch.tensor([float(m.in_features * m.out_features) for m, _ in routed.values()])
    curves = torch.stack([r.curve.float().cpu() for _, r in routed.values()])
    if curves.isnan().any():
        raise ValueError("the model's slice routers were never calibrated (no bits-per-threshold curve)")
    return weights @ curves / weights.sum()


def precision_range(model: nn.Module) -> tuple[float, float]:
    """The lowest and highest average bits the routers reach."""
    curve = model_curve(model)
    return float(curve.min()), float(curve.max())


def threshold_for(model: nn.Module, avg_bits: float) -> float:
    """τ at which the model's routers use `avg_bits` bits per weight on average (module docstring); ValueError
    outside the checkpoint's range (csrc/runtime/standalone.cpp's threshold_for computes it alike)."""
    curve = model_curve(model)  # falls with τ
    low, high = float(curve.min()), float(curve.max())
    if not in_routed_range(avg_bits, low, high):
        raise ValueError(f"average bits {avg_bits:g} are out of this checkpoint's routed range "
                         f"[{low:.2f}, {high:.2f}]; use set_slices / --slices-static for fixed widths")
    return float(np.interp(avg_bits, curve.flip(0).numpy(), TAU_GRID.flip(0).numpy()))  # bits rise as τ falls


def set_precision(model: nn.Module, avg_bits: float) -> float:
    """Route every token so the model uses `avg_bits` bits per weight on average (module docstring);
    returns δ = σ(τ). Clears any static slice count (`set_slices`)."""
    tau = threshold_for(model, avg_bits)
    for linear, router in routed_linears(model).values():
        linear.set_slices(None)
        router.threshold.fill_(tau)
    return float(torch.sigmoid(torch.tensor(tau)))


@contextmanager
def routed_at(model: nn.Module, threshold: float | None) -> Iterator[None]:
    """Every router of `model` at `threshold` (a τ of `threshold_for`) while inside, their own ones restored on exit;
    None: as they are."""
    routers = [r for _, r in routed_linears(model).values()] if threshold is not None else []
    saved = [r.threshold.clone() for r in routers]
    for r in routers:
        r.threshold.fill_(threshold)
    try:
        yield
    finally:
        for r, tau in zip(routers, saved):
            r.threshold.copy_(tau)


@contextmanager
def realised_bits(model: nn.Module) -> Iterator[dict[str, float]]:
    """Measure the bits per weight the model really used while inside: {"avg_bits": …} on exit,
    averaged over tokens and weighted by each sliced linear's weight count (static counts included)."""
    linears = multi_part_linears(model)
    sums = {"bits": 0.0, "weights": 0.0}
    result: dict[str, float] = {}

    def hook(module: QuantLinear, args: tuple) -> None:
        x = args[0]
        tokens = x.numel() // x.shape[-1]
        widths = [p.bits for p in module.fmt.parts.values()]
        ctx = module.context_for(x)
        if ctx is not None:
            per_token = float(prefix_bits(widths)[ctx.slices.cpu()].sum())
        else:
            per_token = tokens * float(sum(widths[: module.slices]))
        numel = module.in_features * module.out_features
        sums["bits"] += numel * per_token
        sums["weights"] += numel * tokens

    handles = [m.register_forward_pre_hook(hook) for m in linears.values()]
    try:
        yield result
    finally:
        for h in handles:
            h.remove()
        result["avg_bits"] = sums["bits"] / sums["weights"] if sums["weights"] else float("nan")
