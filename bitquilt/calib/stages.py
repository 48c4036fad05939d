"""Engine stages: the steps a quantization run is made of, and what each step is given.

A run is a list of stages. Each has a scope that says when the engine calls it:

  prepass     once, on the whole model, before anything changes (e.g. a global bit budget)
  model       once, on the whole model (e.g. a rotation of the residual stream)
  block       on each decoder block, with the block's calibration inputs, before its linears
              are solved (e.g. AWQ/SmoothQuant scales, key centres)
  inputs      on each set of linears sharing one input, in order, each seeing the input the
              already-quantized linears before it produce (e.g. activation clipping, then solve)
  post_block  on each block after all its linears are solved, before its outputs feed the next

Within a scope, stages run in the order the recipe lists them. A stage is a function
`fn(ctx, options) -> dict | None`; what it returns is recorded in the quantization report.
Transforms and policies register stages here; the engine only walks the list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from bitquilt.calib.plan import Plan
from bitquilt.models.adapters import Architecture, decoder_layers
from bitquilt.progress import progress_bar
from bitquilt.registry import Registry, make_options

Stream = Callable[[torch.Tensor], torch.Tensor]  # a transform's map of the residual stream
BlockFn = Callable[[int, nn.Module], None]
HeadFn = Callable[[nn.Module], None]


class TransformCheck(Protocol):
    """How a model-scope transform is checked as it reaches each block and the LM head
    (`bitquilt.calib.preserve.ModelCheck`)."""

    def set_stream(self, stream: Stream | None) -> None: ...

    def block(self, fn: BlockFn) -> BlockFn: ...

    def head(self, fn: HeadFn) -> HeadFn: ...

SCOPES = ("prepass", "model", "block", "inputs", "post_block")
KINDS = ("transform", "policy", "solve")


@dataclass(frozen=True)
class NoOptions:
    """For stages without options."""


class BlockSource(Protocol):
    """Decoder blocks kept on disk and read one at a time (streaming quantization, `bitquilt.models.streaming`)."""

    def load(self, index: int) -> None:
        """Read block `index`'s weights, then run the `on_load` transforms on it."""

    def unload(self, index: int) -> None:
        """Drop block `index`'s weights again (after a pre-pass visit), leaving it as before `load`."""

    def release(self, index: int) -> None:
        """Free what block `index` holds in full precision once its linears are quantized."""

    def inputs_captured(self) -> None:
        """Block 0's calibration inputs are taken: what only produced them (the embedding table) may leave memory
        until the end."""

    def on_load(self, fn: Callable[[int, nn.Module], None]) -> None:
        """Run fn(index, block) on every block as it is read, from now on."""

    def on_finish(self, fn: Callable[[nn.Module], None]) -> None:
        """Run fn(model) once the final norm and the LM head are read, after the last block."""


@dataclass
class ModelContext:
    """What prepass and model stages see. `settings` are the recipe's own fields (w_bits, a_bits, ...).

    Under streaming quantization (`blocks` set) the decoder blocks are on disk: a stage touching them goes through
    `each_block` (a transform), `walk_blocks` (a measurement) and `at_end` (the LM head), which work the same on a
    model held whole in memory."""

    model: nn.Module
    arch: Architecture
    plan: Plan
    calib_ids: torch.Tensor | None
    settings: dict[str, Any] = field(default_factory=dict)
    scratch: dict[str, Any] = field(default_factory=dict)  # run-wide state stages share (e.g. warnings given)
    blocks: BlockSource | None = None
    progress: bool = False  # progress bars for passes over the blocks
    check: TransformCheck | None = None  # the function-preservation check of the transform running now

    def each_block(self, fn: Callable[[int, nn.Module], None], stream: Stream | None = None) -> None:
        """Apply fn(index, block) to every decoder block: now, or under streaming as each block is read. `stream` is
        how fn maps the residual stream (QuaRot: x ↦ x Q), which the transform's check applies to the original
        block's input and output to compare them with the block fn made (`bitquilt.calib.preserve`)."""
        if self.check is not None:
            self.check.set_stream(stream)
            fn = self.check.block(fn)
        if self.blocks is not None:
            self.blocks.on_load(fn)
            return
        for i, block in enumerate(decoder_layers(self.model, self.arch)):
            fn(i, block)

    def at_end(self, fn: Callable[[nn.Module], None]) -> None:
        """Apply fn(model) where the LM head is in memory: now, or under streaming after the last block."""
        if self.check is not None:
            fn = self.check.head(fn)
        if self.blocks is not None:
            self.blocks.on_finish(fn)
        else:
            fn(self.model)

    def walk_blocks(self, desc: str, start: int = 0) -> Iterator[tuple[int, nn.Module]]:
        """(index, block) for the decoder blocks from `start` on, in order; under streaming each is read for its
        step and dropped after it (a pre-pass over the blocks)."""
        layers = decoder_layers(self.model, self.arch)
        for i in progress_bar(range(start, len(layers)), desc=desc, unit="block", disable=not self.progress):
            if self.blocks is not None:
                self.blocks.load(i)
            try:
                yield i, layers[i]
            finally:
                if self.blocks is not None:
                    self.blocks.unload(i)


@dataclass
class BlockContext(ModelContext):
    """What block, inputs and post_block stages see: the block, its calibration inputs and kwargs,
    and (scope "inputs") the linears, relative to the block, that share the input being solved."""

    index: int = 0
    block: nn.Module | None = None
    inputs: list[torch.Tensor] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    linears: tuple[str, ...] = ()
    results: list[Any] = field(default_factory=list)  # per-linear reports of the solve stage

    @property
    def prefix(self) -> str:
        return f"{self.arch.layers}.{self.index}"

    def full(self, name: str) -> str:
        """The model-level name of `name` (relative to the block)."""
        return f"{self.prefix}.{name}"


@dataclass(frozen=True)
class Stage:
    name: str
    scope: str
    kind: str
    fn: Callable[[Any, Any], dict[str, Any] | None]
    options: type = NoOptions
    needs_calibration: bool = True
    requires: tuple[str, ...] = ()  # stages a recipe naming this one runs too (e.g. fp_reference)
    streams: bool = False  # a prepass/model stage that reaches the blocks only through ModelContext's block methods
    refuses: Callable[[Architecture], str | None] | None = None  # why the stage cannot run on a family, or None

    def make_options(self, values: dict[str, Any] | None = None) -> Any:
        return make_options(self.options, values, f"{self.kind} {self.name!r}")


STAGES: Registry[Stage] = Registry("stage")


def register_stage(name: str, scope: str, kind: str, options: type = NoOptions, needs_calibration: bool = True,
                   requires: tuple[str, ...] = (), streams: bool = False,
                   refuses: Callable[[Architecture], str | None] | None = None):
    """Decorator registering `fn(ctx, options)` as a stage. A prepass or model stage declares `streams=True` when
    it touches the decoder blocks only through `ModelContext.each_block` / `walk_blocks` / `at_end` (or not at
    all): it then runs under streaming quantization, where the blocks are on disk. `refuses(arch)` says why the stage
    cannot run on the family `arch` describes (None where it can): the run is refused before any work
    (`bitquilt.calib.preserve.check_family`)."""
    if scope not in SCOPES:
        raise ValueError(f"stage scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    if kind not in KINDS:
        raise ValueError(f"stage kind must be one of {', '.join(KINDS)}, not {kind!r}")

    def wrap(fn):
        STAGES.register(name, Stage(name, scope, kind, fn, options, needs_calibration, requires, streams, refuses))
        return fn

    return wrap
