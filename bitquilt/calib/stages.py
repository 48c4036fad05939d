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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from bitquilt.calib.plan import Plan
from bitquilt.models.adapters import Architecture
from bitquilt.registry import Registry, make_options

SCOPES = ("prepass", "model", "block", "inputs", "post_block")
KINDS = ("transform", "policy", "solve")


@dataclass(frozen=True)
class NoOptions:
    """For stages without options."""


@dataclass
class ModelContext:
    """What prepass and model stages see. `settings` are the recipe's own fields (w_bits, a_bits, ...)."""

    model: nn.Module
    arch: Architecture
    plan: Plan
    calib_ids: torch.Tensor | None
    settings: dict[str, Any] = field(default_factory=dict)
    scratch: dict[str, Any] = field(default_factory=dict)  # run-wide state stages share (e.g. warnings given)


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

    def make_options(self, values: dict[str, Any] | None = None) -> Any:
        return make_options(self.options, values, f"{self.kind} {self.name!r}")


STAGES: Registry[Stage] = Registry("stage")


def register_stage(name: str, scope: str, kind: str, options: type = NoOptions, needs_calibration: bool = True,
                   requires: tuple[str, ...] = ()):
    """Decorator registering `fn(ctx, options)` as a stage."""
    if scope not in SCOPES:
        raise ValueError(f"stage scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    if kind not in KINDS:
        raise ValueError(f"stage kind must be one of {', '.join(KINDS)}, not {kind!r}")

    def wrap(fn):
        STAGES.register(name, Stage(name, scope, kind, fn, options, needs_calibration, requires))
        return fn

    return wrap
