"""The stages that carry the plan out: KV-cache quantizers on attention, and solving the linears."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from bitquilt.calib.capture import collect_stats
from bitquilt.calib.compute import compute_dtype
from bitquilt.calib.experts import fill_rare
from bitquilt.calib.report import LinearReport
from bitquilt.calib.stages import BlockContext, ModelContext, register_stage
from bitquilt.heap import return_free_memory
from bitquilt.models.adapters import decoder_layers
from bitquilt.nn.act_quant import input_quantizer
from bitquilt.nn.kv_quant import KVQuantizer
from bitquilt.nn.online import attach, enable_attention_site, swap_host
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.registry import option
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LinearStats, relative_error
from bitquilt.solvers.mosaic import RESIDUALS

log = logging.getLogger(__name__)


@register_stage("kv_quant", scope="model", kind="policy", needs_calibration=False, streams=True)
def kv_quant(ctx: ModelContext, _options: Any) -> dict[str, Any] | None:
    """Attach the planned KV-cache quantizer to each attention module."""
    if not ctx.plan.kv:
        return None
    for i in range(len(decoder_layers(ctx.model, ctx.arch))):
        name = f"{ctx.arch.layers}.{i}.{ctx.arch.attention}"
        if name in ctx.plan.kv:
            attach(ctx.model.get_submodule(name), "kv_quant", KVQuantizer(ctx.plan.kv[name]))
    enable_attention_site(ctx.model)
    return {"attention_modules": len(ctx.plan.kv)}


@dataclass(frozen=True)
class SolveOptions:
    solver: str = option("rtn", "registered solver name")
    options: dict[str, Any] = option({}, "the solver's options")
    residual: str | None = option(None, "a residual added to each solved linear (mosaic), None: none")
    residual_options: dict[str, Any] = option({}, "the residual's options")

    def residual_method(self) -> tuple[Any, Any] | None:
        """(the registered residual, its options), None without one."""
        if self.residual is None:
            return None
        method = RESIDUALS.get(self.residual)
        return method, method.make_options(self.residual_options)


def warn_if_underdetermined(stats: dict[str, LinearStats], prefix: str, warned: set[int]) -> None:
    """Warn (once per input width) when a Hessian has fewer calibration tokens than inputs: it is then
    rank-deficient and Hessian-based solvers fit the calibration text instead of the layer."""
    for name, s in stats.items():
        width = s.act_absmax.numel()
        if s.n_tokens < width and width not in warned:
            warned.add(width)
            log.warning("%s.%s: %d calibration tokens for %d inputs, so its Hessian is rank-deficient and the "
                        "solver may overfit the calibration text; use at least %d tokens (--calib-samples × "
                        "--calib-seqlen) or a larger --damp", prefix, name, s.n_tokens, width, width)


def solve_linear(ctx: BlockContext, name: str, solver, options, stats: LinearStats | None,
                 residual: tuple[Any, Any] | None = None) -> LinearReport:
    """Solve linear `name` of the block on its planned grid (plus the `residual` method's branch, if given) and
    swap in a QuantLinear that keeps the linear's online input modules and takes the planned activation quantizer."""
    t0 = time.perf_counter()
    plan = ctx.plan[ctx.full(name)]
    lin = ctx.block.get_submodule(name)
    w = lin.weight.detach().float()
    spec = solver.validate(plan.weight)
    base_error = None
    if residual is None:
        fmt = solver(w, stats, spec, options)
    else:
        method, residual_options = residual
        fmt, plain = method.fn(w, stats, spec, solver, options, residual_options)
        if stats is not None:
            base_error = relative_error(w, plain.dequantize(), stats.hessian, compute_dtype())
    qlin = QuantLinear(fmt, lin.bias).to(lin.weight.device)
    swap_host(ctx.block, name, qlin)
    if plan.act is not None and plan.act.enabled:
        attach(qlin, "act_quant", input_quantizer(plan.act, fmt))
    # not qlin.dequantized(): that would cache an fp32 copy of every quantized weight (2× peak memory)
    err = relative_error(w, fmt.dequantize(), stats.hessian, compute_dtype()) if stats is not None else None
    return LinearReport(ctx.full(name), fmt.describe(), fmt.bits_per_weight(), fmt.nbytes(),
                        time.perf_counter() - t0, err, base_error)


@register_stage("solve", scope="inputs", kind="solve", options=SolveOptions, needs_calibration=False)
@torch.no_grad()
def solve(ctx: BlockContext, opts: SolveOptions) -> dict[str, Any] | None:
    """Collect the shared input's statistics once (if any linear's solver options need them) and solve
    each planned linear reading it, with the recipe's solver options updated by the linear's plan params. MoE
    expert linears that saw fewer tokens than their inputs get blended statistics (`bitquilt.calib.experts`),
    reported as {name: tokens it saw} (the report's stages["solve"][block])."""
    names = [n for n in ctx.linears if ctx.plan.weight(ctx.full(n)) is not None]
    if not names:
        return
    solver = get_solver(opts.solver)
    options = {n: solver.make_options({**opts.options, **ctx.plan[ctx.full(n)].params}) for n in names}
    residual = opts.residual_method()
    wanted = (any(solver.wants_stats(o) for o in options.values())
              or (residual is not None and residual[1].needs_hessian))
    experts = expert_linears(ctx, names) if wanted else {}
    dense = next((g.dense_reader() for g in ctx.arch.shared_inputs if g.linears == ctx.linears and g.fp_readers),
                 None) if experts else None
    stats = collect_stats(ctx.block, names + [dense] * (dense is not None), ctx.inputs, ctx.kwargs) if wanted else {}
    # the passes' per-window buffers (below glibc's mmap threshold) stay in the heap once freed: give them back
    # before the solver makes its n × n copies of the Hessian (docs/memory.md)
    return_free_memory()
    rare = fill_rare(stats, experts, stats.pop(dense, None)) if experts else {}
    warn_if_underdetermined({n: s for n, s in stats.items() if n not in rare}, ctx.prefix,
                            ctx.scratch.setdefault("underdetermined_widths", set()))
    if rare and not ctx.scratch.get("rare_experts_warned"):
        ctx.scratch["rare_experts_warned"] = True
        name, tokens = next(iter(rare.items()))
        log.warning("%s.%s saw %d calibration tokens, fewer than its inputs: its statistics, and those of every expert "
                    "linear that saw too few, are blended with a prior (docs/families.md#mixture-of-experts); the "
                    "run's summary counts them", ctx.prefix, name, tokens)
    for n in names:
        ctx.results.append(solve_linear(ctx, n, solver, options[n], stats.get(n), residual))
    return rare or None


def expert_linears(ctx: BlockContext, names: list[str]) -> dict[str, int]:
    """{name: in_features} of the linears of `names` that belong to an MoE expert (`Architecture.experts`)."""
    if ctx.arch.experts is None:
        return {}
    inside = f"{ctx.arch.experts.module}."
    return {n: ctx.block.get_submodule(n).in_features for n in names if n.startswith(inside)}
