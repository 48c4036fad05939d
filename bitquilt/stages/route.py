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

Per-prefix streams (`prefix_streams`, the default with full-precision targets B(x_fp)): the engine hands block i the
inputs x_q the blocks before produce *routed at the budget*, and a block trained to map them onto B(x_fp)
learns to undo that trajectory's drift, which is the wrong correction when the blocks before run at another
precision. With the option, each refitted prefix k keeps its own stream x_q^(k) (every block before run with
its first k slices, `set_slices`), and the static-prefix steps of block i train on x_q^(k): the drift each
precision brings is the one its own slices learn to undo. Costs one forward of the block per refitted prefix
and one copy of the calibration activations per prefix (smollm2, budget 3: +31% calibration time; static 3 / 4
bits 46.11 / 45.83 → 44.37 / 34.97, routed 3 bits 43.53 → 42.40: docs/benchmarks.md, MoBiQuant).
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
from bitquilt.nn.quant_linear import QuantLinear, set_slices
from bitquilt.nn.slice_router import TAU_GRID, SliceRouter
from bitquilt.registry import option
from bitquilt.solvers import get_solver
from bitquilt.stages.recon import REFERENCE


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
    prefix_streams: bool = option(True, "with train_slices and full-precision targets (fp_reference.stream=fp): "
                                  "train each static prefix k on the inputs the blocks before give at their own "
                                  "first k slices (off: every step on the routed stream)")

    def __post_init__(self) -> None:
        if not self.target_bits > 0 or self.hidden < 1 or self.budget_weight < 0:
            raise ValueError(f"mobiroute: needs target_bits > 0, hidden ≥ 1, budget_weight ≥ 0; got "
                             f"{self.target_bits}, {self.hidden}, {self.budget_weight}")
        if self.curve_windows < 1:
            raise ValueError(f"mobiroute: curve_windows must be ≥ 1, got {self.curve_windows}")
        if not 0 < self.t_end <= self.t_start:
            raise ValueError(f"mobiroute: needs 0 < t_end ≤ t_start, got {self.t_end}, {self.t_start}")
        FitConfig(self.steps, self.lr, self.batch, "adam", self.seed, keep_best=False).validate()


PREFIX_STREAMS = "mobiroute_streams"  # ctx.scratch key: {"index", "streams": {k: block inputs at prefix k}}


def uses_prefix_streams(opts: RouteOptions, refit: int, reference_stream: str) -> bool:
    """Per-prefix streams apply when slices are refitted towards the full-precision model's outputs: the quantized
    and mixed targets B(x_q) follow the routed stream, which a prefix's own stream would not match."""
    return opts.prefix_streams and refit > 0 and reference_stream == "fp"


def prefix_inputs(ctx: BlockContext, prefixes: int) -> dict[int, list[torch.Tensor]]:
    """Block i's inputs x_q^(k) for k = 1..prefixes: what the previous block's stage left, else (block 0, whose
    embeddings are the same at every precision, or after a block that was not routed) the routed stream."""
    previous = ctx.scratch.get(PREFIX_STREAMS)
    if previous is not None and previous["index"] == ctx.index - 1 and len(previous["streams"]) == prefixes:
        return previous["streams"]
    return {k: ctx.inputs for k in range(1, prefixes + 1)}


def advance_streams(ctx: BlockContext, streams: dict[int, list[torch.Tensor]]) -> None:
    """Run the quantized block at each prefix k on x_q^(k): block i + 1's streams, kept in ctx.scratch."""
    nxt = {}
    for k, inputs in streams.items():
        set_slices(ctx.block, k)
        nxt[k] = run_block(ctx.block, inputs, ctx.kwargs)
    set_slices(ctx.block, None)  # routed again, as the engine runs it for the next block's x_q
    ctx.scratch[PREFIX_STREAMS] = {"index": ctx.index, "streams": nxt}


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
    streams = prefix_inputs(ctx, refit) if uses_prefix_streams(opts, refit, reference["stream"]) else None
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
                       penalty=budget_penalty(stand_ins, opts.target_bits, opts.budget_weight), anneal=anneal,
                       step_inputs=None if streams is None else lambda: streams.get(stand_ins[0].forced, ctx.inputs))
    meters = {}
    for name, stand_in in routed.items():
        fmt = stand_in.to_format()
        if refit:
            fmt = recut(original[name], list(fmt.parts.values())[:refit], slicing.grid, slicing.iters)
        linear = QuantLinear(fmt, stand_in.bias).to(ctx.inputs[0].device)
        swap_host(ctx.block, name, linear)
        attach(linear, "router", stand_in.router)
        meters[name] = CurveMeter(stand_in.router)
    if streams is not None:
        advance_streams(ctx, streams)
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
