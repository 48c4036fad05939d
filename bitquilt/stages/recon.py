"""Block-wise reconstruction as engine stages: learned rounding and clipping after any solver.

`fp_reference` (scope block, after the block's transforms, before its linears are solved) keeps
the block's full-precision weights and the outputs the full-precision block B gives: on the
full-precision model's own hidden states x_fp (stream "fp", as AutoRound: the quantized model is
pulled back towards the original trajectory), on the inputs x_q the quantized blocks before
produce (stream "quantized": each block only repairs its own error), or a blend (stream "mixed":
targets m·B(x_fp) + (1 − m)·B(x_q), which minimises m·‖Q − B(x_fp)‖² + (1 − m)·‖Q − B(x_q)‖² up
to a constant). KV-cache quantizers are off for that pass. `recon` (scope post_block) swaps each
solved linear for its learnable stand-in (`bitquilt.calib.learnable`), trains them all together
on the block's output error (`bitquilt.calib.reconstruct`), and packs them back into the format
the solver chose. Linears whose format has no learnable stand-in (e.g. MXINT) keep the solver's
result.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from bitquilt.calib.capture import run_block
from bitquilt.calib.learnable import LearnableLinear, learnable
from bitquilt.calib.reconstruct import FitConfig, fit_block
from bitquilt.calib.stages import BlockContext, register_stage
from bitquilt.nn.online import attach, get, swap_host
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.registry import option

REFERENCE = "fp_reference"  # ctx.scratch key: {"index", "stream", "weights", "targets", "fp_outputs"}
STREAMS = ("fp", "quantized", "mixed")


@dataclass(frozen=True)
class ReferenceOptions:
    stream: str = option("fp", "inputs of the full-precision targets: fp (the original model's own hidden states) "
                         "quantized (what the quantized blocks before produce) or mixed (a blend of both "
                         "targets)")
    mix: float = option(0.5, "stream=mixed: the fp-stream target's share m of the blend, in (0, 1)")

    def __post_init__(self) -> None:
        if self.stream not in STREAMS:
            raise ValueError(f"fp_reference: stream must be {', '.join(STREAMS[:-1])} or {STREAMS[-1]}, "
                             f"got {self.stream!r}")
        if not 0 < self.mix < 1:
            raise ValueError(f"fp_reference: mix must lie strictly between 0 and 1, got {self.mix}")


@dataclass(frozen=True)
class ReconOptions:
    steps: int = option(0, "optimisation steps per block (0: off)")
    lr: float | None = option(None, "step size; default 1/steps for signsgd, 1e-3 for adam (decays linearly to 0)")
    batch: int = option(8, "calibration windows per step")
    optimizer: str = option("signsgd", "signsgd (SignRound) or adam")
    clip: bool = option(True, "learn each group's clipping range (scale and zero) as well as the rounding")
    seed: int = option(0, "mini-batch order")
    keep_best: bool = option(True, "keep the parameters of the step with the lowest mini-batch loss")

    def __post_init__(self) -> None:
        self.fit_config().validate()

    def fit_config(self) -> FitConfig:
        return FitConfig(self.steps, self.lr, self.batch, self.optimizer, self.seed, self.keep_best)


@contextmanager
def kv_quant_off(ctx: BlockContext):
    """The block's attention without its KV-cache quantizer for the duration."""
    attention = ctx.block.get_submodule(ctx.arch.attention)
    quantizer = get(attention, "kv_quant")
    if quantizer is not None:
        attach(attention, "kv_quant", None)
    try:
        yield
    finally:
        if quantizer is not None:
            attach(attention, "kv_quant", quantizer)


@register_stage("fp_reference", scope="block", kind="policy", options=ReferenceOptions)
@torch.no_grad()
def fp_reference(ctx: BlockContext, opts: ReferenceOptions) -> None:
    """Keep this block's full-precision weights and outputs for the post-block stages that fit to them."""
    previous = ctx.scratch.get(REFERENCE)
    fp_inputs = previous["fp_outputs"] if previous is not None and previous["fp_outputs"] is not None else ctx.inputs
    with kv_quant_off(ctx):
        fp_outputs = run_block(ctx.block, fp_inputs, ctx.kwargs) if opts.stream != "quantized" else None
        own = run_block(ctx.block, ctx.inputs, ctx.kwargs) if opts.stream != "fp" else None
    if opts.stream == "mixed":
        targets = [opts.mix * a + (1 - opts.mix) * b for a, b in zip(fp_outputs, own)]
    else:
        targets = own if fp_outputs is None else fp_outputs
    names = [n for n in ctx.arch.linear_names() if ctx.plan.weight(ctx.full(n)) is not None]
    weights = {n: ctx.block.get_submodule(n).weight.detach().float().clone() for n in names}
    ctx.scratch[REFERENCE] = {"index": ctx.index, "stream": opts.stream, "weights": weights, "targets": targets,
                              "fp_outputs": fp_outputs}


@register_stage("recon", scope="post_block", kind="solve", options=ReconOptions)
@torch.no_grad()
def recon(ctx: BlockContext, opts: ReconOptions) -> dict[str, Any] | None:
    """Train the block's learnable stand-ins on its output error and pack them back (module docstring)."""
    config = opts.fit_config()
    if config.steps == 0:
        return None
    reference = ctx.scratch.get(REFERENCE)
    if reference is None or reference["index"] != ctx.index:
        raise RuntimeError("the recon stage needs the fp_reference stage on the same block (recipes add it with "
                           "recon_steps > 0)")
    learned, kept = {}, []
    for name, weight in reference["weights"].items():
        linear = ctx.block.get_submodule(name)
        stand_in = learnable(weight, linear.fmt, opts.clip) if isinstance(linear, QuantLinear) else None
        if stand_in is None:
            kept.append(name)
            continue
        swap_host(ctx.block, name, LearnableLinear(stand_in.to(weight.device), linear.bias))
        learned[name] = stand_in
    params = [p for stand_in in learned.values() for p in stand_in.parameters()]
    result = fit_block(ctx.block, ctx.inputs, reference["targets"], ctx.kwargs, params, config,
                       project=lambda: [s.project_() for s in learned.values()])
    for name, stand_in in learned.items():
        swap_host(ctx.block, name, QuantLinear(stand_in.to_format(), ctx.block.get_submodule(name).bias)
                  .to(reference["weights"][name].device))
    del reference["weights"]
    out = result.to_dict()
    if kept:
        out["kept_as_solved"] = kept
    return out

