"""What a solver is asked for, what it is given, and the registry that names solvers.

A solver is a pure function (weight, statistics, spec, options) -> WeightFormat. It knows
nothing about models: the engine collects the statistics and swaps the result in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from bitquilt.formats.base import WeightFormat
from bitquilt.formats.uniform import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES


@dataclass(frozen=True)
class LayerSpec:
    """The target grid of one linear: bit width, group size (-1 = per channel), symmetry."""

    bits: int = 4
    group_size: int = 128
    sym: bool = False

    def validate(self, supported_bits: tuple[int, ...] = SUPPORTED_BITS) -> LayerSpec:
        if self.bits not in supported_bits:
            raise ValueError(f"unsupported weight bits {self.bits}; supported: {', '.join(map(str, supported_bits))}")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(
                f"unsupported group size {self.group_size}; supported: "
                f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))} (-1 = per channel)"
            )
        return self


@dataclass
class LinearStats:
    """Calibration statistics of one linear's input X [tokens, in_features].

    hessian      Σ xxᵀ / n  (fp32), GPTQ's H up to the factor 2; None when only ranges were collected
    act_absmax   max |x| per input channel
    act_absmean  mean |x| per input channel (AWQ's activation salience)
    """

    hessian: torch.Tensor | None
    act_absmax: torch.Tensor
    act_absmean: torch.Tensor
    n_tokens: int

    @classmethod
    def empty(cls, in_features: int, device: torch.device | str = "cpu", hessian: bool = True) -> LinearStats:
        z = torch.zeros(in_features, device=device)
        h = torch.zeros(in_features, in_features, device=device) if hessian else None
        return cls(h, z.clone(), z.clone(), 0)

    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        n = x.shape[0]
        total = self.n_tokens + n
        if self.hessian is not None:
            self.hessian.mul_(self.n_tokens / total).addmm_(x.T, x, alpha=1.0 / total)
        self.act_absmean.mul_(self.n_tokens / total).add_(x.abs().sum(0), alpha=1.0 / total)
        self.act_absmax = torch.maximum(self.act_absmax, x.abs().amax(0))
        self.n_tokens = total


SolverFn = Callable[[torch.Tensor, "LinearStats | None", LayerSpec, Any], WeightFormat]


@dataclass(frozen=True)
class Solver:
    name: str
    fn: SolverFn
    options: type  # a dataclass of this solver's options, all with defaults
    needs_stats: bool = True

    def make_options(self, values: dict[str, Any] | None = None) -> Any:
        values = dict(values or {})
        fields = {f.name for f in dataclasses.fields(self.options)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"solver {self.name!r} has no option(s) {unknown}; it accepts: {sorted(fields)}")
        return self.options(**values)

    def __call__(self, weight, stats, spec: LayerSpec, options=None) -> WeightFormat:
        if self.needs_stats and stats is None:
            raise ValueError(f"solver {self.name!r} needs calibration statistics")
        opts = options if options is not None and not isinstance(options, dict) else self.make_options(options)
        return self.fn(weight.detach().float(), stats, spec, opts)


SOLVERS: dict[str, Solver] = {}


def register_solver(name: str, options: type, needs_stats: bool = True):
    def wrap(fn: SolverFn) -> SolverFn:
        SOLVERS[name] = Solver(name, fn, options, needs_stats)
        return fn

    return wrap


def get_solver(name: str) -> Solver:
    try:
        return SOLVERS[name]
    except KeyError:
        raise ValueError(f"unknown solver {name!r}; known: {', '.join(sorted(SOLVERS))}") from None


@contextmanager
def single_thread():
    """Run a loop of many tiny tensor ops on one thread (OpenMP barriers dominate them otherwise)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def check_finite(weight: torch.Tensor, what: str = "weight") -> None:
    if not torch.isfinite(weight).all():
        bad = (~torch.isfinite(weight)).sum().item()
        raise ValueError(f"{what} contains {bad} NaN/Inf value(s); cannot quantize a non-finite matrix")


def hessian_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr((W − Ŵ) H (W − Ŵ)ᵀ): the layer's expected output error ‖WX − ŴX‖² per token."""
    d = (weight.float() - approx.float())
    return float(torch.einsum("ij,jk,ik->", d, hessian.float(), d))
