"""MoBiQuant's joint calibration as an engine stage (`--method mobiquant` = mobiroute + mobislice).

`mobiroute` (scope post_block, after the mobislice solver has cut each linear into residual
slices) gives every sliced linear a `SliceRouter` and trains the routers of the whole block (and,
with `train_slices`, the default, the coefficients of the slices up to one bit past the budget,
also on every static prefix, re-cutting the slices above afterwards) on its output error against
the full-precision block plus the bit budget
(`bitquilt.calib.routing`, through the shared block loop `bitquilt.calib.reconstruct.fit_block`),
packs the slices back and leaves each router at its linear's "router" slot with δ = ½. Then one
pass over the first `curve_windows` calibration inputs records each router's bits-per-threshold curve, which
`set_precision` uses to turn an average bit-width into a threshold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bitquilt.calib.capture import run_block
from bitquilt.calib.reconstruct import FitConfig, fit_block
from bitquilt.calib.routing import (
    CurveMeter,
    RoutedSlices,
    budget_penalty,
    prefix_schedule,
    recut,
    refit_count,
    routable,
    temperature_schedule,
)
from bitquilt.calib.stages import BlockContext, register_stage
from bitquilt.formats.composite import CompositeFormat
from bitquilt.nn.online import attach, swap_host
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.nn.slice_router import TAU_GRID, SliceRouter
from bitquilt.pipeline.recon import REFERENCE
from bitquilt.registry import option
from bitquilt.solvers import get_solver


@dataclass(frozen=True)
class RouteOptions:
    target_bits: float = option(3.0, "average bits per weight the routers are trained towards (the budget B)")
    steps: int = option(30, "AdamW steps per block")
    lr: float = option(1e-2, "AdamW step size (router weights; slice coefficients move in units of their step)")
    batch: int = option(2, "calibration windows per step")
    budget_weight: float = option(1.0, "λ: weight of the squared overshoot of the bit budget, relative to the error")
    hidden: int = option(16, "router hidden width")
    t_start: float = option(1.0, "gate temperature at the first step")
    t_end: float = option(0.05, "gate temperature at the last step (near binary)")
    seed: int = option(0, "router initialisation and mini-batch order")
    train_slices: bool = option(True, "also refit the coefficients of the slices up to one bit past the budget, on "
                                "the routed mix and on every static prefix, and cut the slices above again from "
                                "what they leave (off: only the routers learn; every prefix keeps MoBiSlice's "
                                "error)")
    curve_windows: int = option(16, "calibration windows each router's bits-per-threshold curve is measured on")

    def __post_init__(self) -> None:
        if not self.target_bits > 0 or self.hidden < 1 or self.budget_weight < 0:
            raise ValueError(f"mobiroute: needs target_bits > 0, hidden ≥ 1, budget_weight ≥ 0; got "
                             f"{self.target_bits}, {self.hidden}, {self.budget_weight}")
        if self.curve_windows < 1:
            raise ValueError(f"mobiroute: curve_windows must be ≥ 1, got {self.curve_windows}")
        if not 0 < self.t_end <= self.t_start:
            raise ValueError(f"mobiroute: needs 0 < t_end ≤ t_start, got {self.t_end}, {self.t_start}")
        FitConfig(self.steps, self.lr, self.batch, "adam", self.seed, keep_best=False).validate()


def _both(first: Callable[[float], None], second: Callable[[float], None]) -> Callable[[float], None]:
    def run(t: float) -> None:
        first(t)
        second(t)
    return run


@register_stage("mobiroute", scope="post_block", kind="policy", options=RouteOptions, requires=("fp_reference",))
@torch.no_grad()
def mobiroute(ctx: BlockContext, opts: RouteOptions) -> dict[str, Any] | None:
    """Train and attach the block's slice routers (module docstring)."""
    reference = ctx.scratch.get(REFERENCE)
    if reference is None or reference["index"] != ctx.index:
        raise RuntimeError("mobiroute needs the fp_reference stage on the same block")
    torch.manual_seed(opts.seed * 1009 + ctx.index)
    routed: dict[str, RoutedSlices] = {}
    original: dict[str, CompositeFormat] = {}
    for name in ctx.arch.linear_names():
        linear = ctx.block.get_submodule(name)
        if not (isinstance(linear, QuantLinear) and routable(linear.fmt)):
            continue
        router = SliceRouter(linear.in_features, [p.bits for p in linear.fmt.parts.values()], opts.hidden)
        router.init_for(opts.target_bits)
        routed[name] = RoutedSlices(linear.fmt, linear.bias, router)
        original[name] = linear.fmt
        swap_host(ctx.block, name, routed[name])
    if not routed:
        return None
    stand_ins = list(routed.values())
    refit = min(refit_count(s.router.slice_bits, opts.target_bits) for s in stand_ins) if opts.train_slices else 0
    for stand_in in stand_ins:
        stand_in.slices.requires_grad_(False)
        stand_in.slices[:refit].requires_grad_(True)
    config = FitConfig(opts.steps, opts.lr, opts.batch, "adam", opts.seed, keep_best=False, relative=bool(refit))
    slicing = get_solver("mobislice").make_options(ctx.settings.get("options"))  # the re-cut slices as the cut
    anneal = temperature_schedule(stand_ins, opts.t_start, opts.t_end)
    if refit:
        anneal = _both(anneal, prefix_schedule(stand_ins, refit, opts.steps, opts.seed * 1009 + ctx.index))
    result = fit_block(ctx.block, ctx.inputs, reference["targets"], ctx.kwargs,
                       [p for r in stand_ins for p in r.parameters()], config,
                       penalty=budget_penalty(stand_ins, opts.target_bits, opts.budget_weight), anneal=anneal)
    meters = {}
    for name, stand_in in routed.items():
        fmt = stand_in.to_format()
        if refit:
            fmt = recut(original[name], list(fmt.parts.values())[:refit], slicing.grid, slicing.iters)
        linear = QuantLinear(fmt, stand_in.bias).to(ctx.inputs[0].device)
        swap_host(ctx.block, name, linear)
        attach(linear, "router", stand_in.router)
        meters[name] = CurveMeter(stand_in.router)
    hooks = [ctx.block.get_submodule(n).register_forward_pre_hook(lambda _m, args, meter=m: meter.add(args[0]))
             for n, m in meters.items()]
    try:
        run_block(ctx.block, ctx.inputs[: opts.curve_windows], ctx.kwargs)
    finally:
        for h in hooks:
            h.remove()
    numel = {n: float(ctx.block.get_submodule(n).in_features * ctx.block.get_submodule(n).out_features)
             for n in meters}
    zero = int(TAU_GRID.abs().argmin())  # τ = 0: δ = ½
    for meter in meters.values():
        meter.router.curve.copy_(meter.curve())
    at_half = {n: float(m.router.curve[zero]) for n, m in meters.items()}
    avg = sum(numel[n] * at_half[n] for n in meters) / sum(numel.values())
    return {**result.to_dict(), "avg_bits_at_half": round(avg, 3),
            "bits_at_half": {n: round(b, 3) for n, b in at_half.items()}}
