"""Function preservation: every transform stage checks itself on the model at hand.

A transform (a stage of kind "transform": QuaRot's norm fusion and rotations, SmoothQuant's and AWQ's scales, folded
permutations) must leave the full-precision function unchanged. Where one cannot serve a family, it says so
(`Stage.refuses`, reading the family's adapter) and the run is refused before any work (`check_family`). Whether it
holds otherwise depends on the family and on the weights, which tiny random test models do not have, so each one is
checked where it is applied, on one window: the first calibration window, or `PROBE_TOKENS` fixed random token ids
when the recipe reads no calibration data.

  block, post_block   the block's output on its calibration input, before and after the stage (`checked_block_stage`)
  model (QuaRot)      each block as the stage reaches it (`ModelContext.each_block`, so also under streaming): the
                      block before the stage on its input x against the block after it on stream(x), `stream` being
                      the transform's map of the residual stream (x ↦ x Q); then the embedding's output, and the LM
                      head's on the last `HEAD_TOKENS` positions (`ModelCheck`)

The measure is the relative error of what the block adds to the residual stream (its output minus its input), not of
its output: the residual stream of real models carries a few massive channels that would hide a broken branch. Beyond
TOLERANCE the run stops with one line naming the transform, the family, the place and the difference (`NotPreserved`,
a UserError: exit code 2 on the command line, before anything is written).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from bitquilt.calib.capture import block_output, capture_block_inputs
from bitquilt.calib.stages import BlockContext, ModelContext, Stage, Stream
from bitquilt.errors import UserError
from bitquilt.models.adapters import Architecture
from bitquilt.nn.online import attach, get

# Largest relative error a transform may cause. Exact transforms differ from the original only by fp32 rounding (the
# measured worst case over the packaged models and recipes is in bench/results/preservation.md); a transform that
# does not hold on a family changes a block's update by tens of percent.
TOLERANCE = 1e-3
PROBE_TOKENS = 128  # random token ids of the probe window when the recipe reads no calibration data
HEAD_TOKENS = 16  # positions whose logits check the LM head (a 262k-word head makes all of them costly)

QUANTIZER_SLOTS = ("act_quant", "kv_quant")  # online quantizers, off while a check runs: it compares the fp function


class NotPreserved(UserError):
    """A transform changed the model's function beyond TOLERANCE."""


class StagedRecipe(Protocol):
    """What `check_family` reads of a recipe (`bitquilt.recipes.Recipe`, a floor above this one)."""

    def stages(self) -> list[tuple[Stage, Any]]: ...


def check_family(recipe: StagedRecipe, arch: Architecture) -> None:
    """Raise UserError if a stage of `recipe` refuses the family `arch` describes (`Stage.refuses`)."""
    for stage, _options in recipe.stages():
        why = None if stage.refuses is None else stage.refuses(arch)
        if why is not None:
            raise UserError(f"{stage.name} cannot run on {arch.name} models: {why}; quantize without {stage.name}")


def probe_ids(calib_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """The window transforms are checked on [1, seqlen]: the first calibration window, else fixed random ids."""
    if calib_ids is not None:
        return calib_ids[:1]
    return torch.randint(0, vocab_size, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))


def relative_error(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> float:
    """‖got − want‖ / ‖scale‖, in float64."""
    return float((got.double() - want.double()).norm() / scale.double().norm().clamp(min=1e-30))


def verify(transform: str, family: str, where: str, error: float) -> None:
    """Raise NotPreserved if `error` (a relative error, NaN included) exceeds TOLERANCE."""
    if not error <= TOLERANCE:
        raise NotPreserved(f"{transform} does not preserve the function of this {family} model: {where} changed by "
                           f"{error:.3g} (relative error on one calibration window; tolerance {TOLERANCE:g}); "
                           f"quantize it without {transform}")


@contextmanager
def quantizers_off(block: nn.Module) -> Iterator[None]:
    """`block` without its activation and KV-cache quantizers for the duration (a model stage reaches a block under
    streaming after the KV quantizers are attached; a post_block stage, after the activation quantizers)."""
    held = [(m, slot, q) for m in block.modules() for slot in QUANTIZER_SLOTS if (q := get(m, slot)) is not None]
    for m, slot, _q in held:
        attach(m, slot, None)
    try:
        yield
    finally:
        for m, slot, q in held:
            attach(m, slot, q)


def fp_block_output(block: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """`block`'s output for x in full precision (its online quantizers off)."""
    with quantizers_off(block):
        return block_output(block, x, kwargs)


@torch.no_grad()
def update_error(block: nn.Module, x: torch.Tensor, kwargs: dict[str, Any], want: torch.Tensor,
                 stream: Stream | None = None) -> float:
    """The relative error of `block`'s update on stream(x) against the update `want` − x (in the original basis)."""
    mapped = (lambda t: t) if stream is None else stream
    got = fp_block_output(block, mapped(x), kwargs)
    return relative_error(got, mapped(want), want - x)


def checked_block_stage(stage: Stage, ctx: BlockContext, options: Any, window: list[torch.Tensor],
                        kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Run a block or post_block stage on `ctx`; a transform is checked on the block's input of the probe window
    (`window`: [it], with the block's `kwargs` for it; a run with no block transform has none), its relative error
    recorded in what the stage returns (`preservation_error`)."""
    if stage.kind != "transform":
        return stage.fn(ctx, options)
    x = window[0]
    with torch.no_grad():
        want = fp_block_output(ctx.block, x, kwargs)
    result = stage.fn(ctx, options)
    error = update_error(ctx.block, x, kwargs, want)
    verify(stage.name, ctx.model.config.model_type, f"block {ctx.index}'s update", error)
    return {**(result or {}), "preservation_error": error}


class ModelCheck:
    """The check of one model-scope transform, as it reaches each block and then the LM head.

    Made before the stage runs, it keeps the block-0 input of the probe window and a copy of the final norm;
    each block is checked on the first visit of its index, in order (a later pre-pass over the blocks reads them
    again), and the input of the next block is this block's original output."""

    def __init__(self, transform: str, model: nn.Module, arch: Architecture, ids: torch.Tensor):
        self.transform, self.family, self.model, self.arch, self.ids = (transform, model.config.model_type, model,
                                                                        arch, ids)
        self.stream: Stream | None = None
        inputs, self.kwargs = capture_block_inputs(model, arch, ids)
        self.embedded = self.hidden = inputs[0]
        self.final_norm = copy.deepcopy(model.get_submodule(arch.final_norm))
        self.next = 0  # the block whose first visit comes next
        self.worst = 0.0
        self.record: dict[str, Any] | None = None  # what the stage returned, where the worst error is kept

    def _check(self, where: str, error: float) -> None:
        verify(self.transform, self.family, where, error)
        self.worst = max(self.worst, error)
        self.report_to(self.record)

    def report_to(self, record: dict[str, Any] | None) -> None:
        """Keep the worst relative error so far in `record` (the stage's report), now and as more parts are checked
        (under streaming, blocks are checked as they are read, after the stage returned)."""
        self.record = record
        if record is not None:
            record["preservation_error"] = self.worst

    def set_stream(self, stream: Stream | None) -> None:
        self.stream = stream

    def block(self, fn: Callable[[int, nn.Module], None]) -> Callable[[int, nn.Module], None]:
        """`fn(index, block)`, checked on each block's first visit."""

        @torch.no_grad()
        def checked(index: int, block: nn.Module) -> None:
            if index != self.next:
                fn(index, block)
                return
            x, kwargs = self.hidden, self.kwargs[index]
            want = fp_block_output(block, x, kwargs)
            fn(index, block)
            self._check(f"block {index}'s update", update_error(block, x, kwargs, want, self.stream))
            self.hidden, self.next = want, index + 1

        return checked

    def head(self, fn: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
        """`fn(model)` on the LM head, checked on the logits of the last positions (once every block was checked)."""

        @torch.no_grad()
        def checked(model: nn.Module) -> None:
            if self.next < len(self.kwargs):
                fn(model)
                return
            head, norm = model.get_submodule(self.arch.lm_head), model.get_submodule(self.arch.final_norm)
            x = self.hidden[:, -HEAD_TOKENS:]
            want = head(self.final_norm(x))
            fn(model)
            got = head(norm(x if self.stream is None else self.stream(x)))
            self._check("the LM head's logits", relative_error(got, want, want))

        return checked

    @torch.no_grad()
    def embedding(self) -> None:
        """Check the embedding's output on the probe window against the block-0 input before the stage."""
        inputs, _ = capture_block_inputs(self.model, self.arch, self.ids)
        want = self.embedded if self.stream is None else self.stream(self.embedded)
        self._check("the embedding's output", relative_error(inputs[0], want, want))


def checked_model_stage(stage: Stage, ctx: ModelContext, options: Any) -> Any:
    """Run a prepass or model stage on `ctx`; a transform is checked through a `ModelCheck`."""
    if stage.kind != "transform":
        return stage.fn(ctx, options)
    ctx.check = ModelCheck(stage.name, ctx.model, ctx.arch, probe_ids(ctx.calib_ids, ctx.model.config.vocab_size))
    try:
        result = stage.fn(ctx, options)
        ctx.check.report_to(result)
        ctx.check.embedding()
    finally:
        ctx.check = None
    return result
