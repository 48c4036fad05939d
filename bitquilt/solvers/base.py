"""What a solver is asked for, what it is given, and the registry that names solvers.

A solver is a pure function (weight, statistics, spec, options) -> WeightFormat. It knows
nothing about models: the engine collects the statistics and swaps the result in.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from bitquilt.formats.base import WeightFormat
from bitquilt.formats.uniform import UniformFormat
from bitquilt.registry import Registry, make_options


@dataclass(frozen=True)
class LayerSpec:
    """The target grid of one linear: bit width, group size (-1 = per channel), symmetry."""

    bits: int = 4
    group_size: int = 128
    sym: bool = False

    def validate(self, fmt: type[WeightFormat] = UniformFormat, who: str = "",
                 bits: tuple[int, ...] | None = None) -> LayerSpec:
        """Check the grid against what format `fmt` can hold (`who`: the solver, for the message; `bits`:
        the widths it accepts when they are not the format's, e.g. a total over several parts)."""
        by = f" by {who}" if who else ""
        allowed = fmt.supported_bits if bits is None else bits
        if self.bits not in allowed:
            raise ValueError(f"unsupported weight bits {self.bits}{by}; supported: {', '.join(map(str, allowed))}")
        if self.group_size not in fmt.supported_group_sizes:
            raise ValueError(f"unsupported group size {self.group_size}{by}; supported: "
                             f"{', '.join(map(str, fmt.supported_group_sizes))} (-1 = per channel)")
        return self


@dataclass
class LinearStats:
    """Calibration statistics of one linear's input X [tokens, in_features].

    hessian      Σ xxᵀ / n  (fp32), GPTQ's H up to the factor 2; None when only ranges were collected
    act_absmax   max |x| per input channel
    act_absmean  mean |x| per input channel (AWQ's activation salience)
    products     dtype each update's XᵀX is multiplied in (bf16: one bf16 rounding per update, summed in fp32)
    """

    hessian: torch.Tensor | None
    act_absmax: torch.Tensor
    act_absmean: torch.Tensor
    n_tokens: int
    products: torch.dtype = torch.float32

    @classmethod
    def empty(cls, in_features: int, device: torch.device | str = "cpu", hessian: bool = True,
              products: torch.dtype = torch.float32) -> LinearStats:
        z = torch.zeros(in_features, device=device)
        h = torch.zeros(in_features, in_features, device=device) if hessian else None
        return cls(h, z.clone(), z.clone(), 0, products)

    def update(self, x: torch.Tensor) -> None:
        """Add the tokens of x [..., in_features] (called from inside calibration passes: autocast is set aside, the
        products are in `products`)."""
        with torch.autocast(x.device.type, enabled=False):
            self._add(x.reshape(-1, x.shape[-1]))

    def _add(self, x: torch.Tensor) -> None:
        n = x.shape[0]
        total = self.n_tokens + n
        x32 = x.float()
        if self.hessian is not None:
            self.hessian.mul_(self.n_tokens / total)
            products = gram(x32) if self.products == torch.float32 else low_precision_gram(x, x32, self.products)
            self.hessian.add_(products, alpha=1.0 / total)
        x = x32
        self.act_absmean.mul_(self.n_tokens / total).add_(x.abs().sum(0), alpha=1.0 / total)
        self.act_absmax = torch.maximum(self.act_absmax, x.abs().amax(0))
        self.n_tokens = total


PANEL_WIDTH = 256  # rows of XᵀX per panel (products narrower than this lose more to GEMM overhead than they save)
MAX_PANELS = 16


def gram(x: torch.Tensor) -> torch.Tensor:
    """XᵀX (fp32) of x [tokens, d], multiplied in x's dtype, from its upper block rows only.

    XᵀX is symmetric: split into p panels of rows, panel i is multiplied against the columns from its diagonal
    block on and mirrored below it, (p + 1) / 2p of the full product's work.
    """
    d = x.shape[1]
    panels = max(1, min(MAX_PANELS, d // PANEL_WIDTH))
    if panels == 1:
        return (x.T @ x).float()
    out = torch.empty(d, d, device=x.device)
    edges = [d * i // panels for i in range(panels + 1)]
    for lo, hi in zip(edges, edges[1:]):
        rows = (x[:, lo:hi].T @ x[:, lo:]).float()
        out[lo:hi, lo:] = rows
        out[hi:, lo:hi] = rows[:, hi - lo:].T
    return out


OUTLIER_RATIO = 16.0  # a channel whose Σx² exceeds this many times the median channel's is an outlier
MAX_OUTLIER_FRACTION = 8  # at most 1/8 of the channels are taken as outliers


def low_precision_gram(x: torch.Tensor, x32: torch.Tensor, products: torch.dtype) -> torch.Tensor:
    """XᵀX (fp32) of x [tokens, d] multiplied in `products` (bf16), the rows and columns of outlier channels in fp32.

    A bf16 product is rounded to bf16 (torch has no CPU matmul from bf16 into fp32), an error relative to each
    entry: on the rows of a channel whose activations are hundreds of times the others', that error is larger than
    GPTQ's dampening and can make the Hessian indefinite. Those few channels' rows (`OUTLIER_RATIO`) are multiplied
    from `x32` (x in fp32) instead.
    """
    result = gram(x.to(products))
    energy = x32.pow(2).sum(0)
    outliers = torch.nonzero(energy > OUTLIER_RATIO * energy.median()).flatten()
    if outliers.numel() > x.shape[1] // MAX_OUTLIER_FRACTION:
        outliers = energy.topk(x.shape[1] // MAX_OUTLIER_FRACTION).indices
    if outliers.numel():
        rows = x32[:, outliers].T @ x32
        result[outliers] = rows
        result[:, outliers] = rows.T
    return result


SolverFn = Callable[[torch.Tensor, "LinearStats | None", LayerSpec, Any], WeightFormat]


@dataclass(frozen=True)
class Solver:
    """A registered solver: its function, options dataclass and the format it produces."""

    name: str
    fn: SolverFn
    options: type  # a dataclass of this solver's options, all with defaults
    produces: type[WeightFormat] = UniformFormat  # declares the bits and group sizes it can reach
    needs_stats: bool | Callable[[Any], bool] = True  # or a function of the options (e.g. only some need a Hessian)
    bits: tuple[int, ...] | None = None  # the weight widths it takes, if not `produces.supported_bits`

    def make_options(self, values: dict[str, Any] | None = None) -> Any:
        return make_options(self.options, values, f"solver {self.name!r}")

    def validate(self, spec: LayerSpec) -> LayerSpec:
        return spec.validate(self.produces, f"solver {self.name!r}", self.bits)

    def wants_stats(self, options: Any = None) -> bool:
        """Whether solving with `options` (an options object or dict) needs calibration statistics."""
        if not callable(self.needs_stats):
            return self.needs_stats
        return self.needs_stats(options if options is not None and not isinstance(options, dict)
                                else self.make_options(options))

    def __call__(self, weight, stats, spec: LayerSpec, options=None) -> WeightFormat:
        opts = options if options is not None and not isinstance(options, dict) else self.make_options(options)
        if stats is None and self.wants_stats(opts):
            raise ValueError(f"solver {self.name!r} needs calibration statistics")
        return self.fn(weight.detach().float(), stats, spec, opts)


SOLVERS: Registry[Solver] = Registry("solver")


def register_solver(name: str, options: type, needs_stats: bool | Callable[[Any], bool] = True,
                    produces: type[WeightFormat] = UniformFormat, bits: tuple[int, ...] | None = None):
    def wrap(fn: SolverFn) -> SolverFn:
        SOLVERS.register(name, Solver(name, fn, options, produces, needs_stats, bits))
        return fn

    return wrap


def get_solver(name: str) -> Solver:
    return SOLVERS.get(name)


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


def hessian_error(weight: torch.Tensor, approx: torch.Tensor | None, hessian: torch.Tensor,
                  products: torch.dtype = torch.float32) -> float:
    """tr(D H Dᵀ), D = W − Ŵ (D = W if `approx` is None): the layer's output error ‖WX − ŴX‖² per token. `products`:
    the dtype D·H is multiplied in (bf16: one rounding of each product, summed in fp32)."""
    if products == torch.float32:
        d = weight.float() if approx is None else weight.float() - approx.float()
        return float(torch.einsum("ij,jk,ik->", d, hessian.float(), d))
    return float(row_errors(weight, approx, hessian, products).sum())


def row_errors(weight: torch.Tensor, approx: torch.Tensor | None, hessian: torch.Tensor,
               products: torch.dtype = torch.float32) -> torch.Tensor:
    """d_r H d_rᵀ for each row r of D = W − Ŵ (D = W if `approx` is None): each output channel's share of
    `hessian_error` (fp32)."""
    d = weight.float() if approx is None else weight.float() - approx.float()
    return ((d.to(products) @ hessian.to(products)).float() * d).sum(dim=1)


def relative_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor,
                   products: torch.dtype = torch.float32) -> float:
    """tr(D H Dᵀ) / tr(W H Wᵀ): the relative output error on calibration data (products as in `hessian_error`)."""
    return hessian_error(weight, approx, hessian, products) / max(hessian_error(weight, None, hessian, products),
                                                                  1e-30)
