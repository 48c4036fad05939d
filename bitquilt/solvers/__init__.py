"""Solvers: (weight, statistics, spec, options) -> packed format. Importing registers them all."""

from bitquilt.solvers import bpdq, ggml, gptq, mobislice, mxint, rtn  # noqa: F401  (registration)
from bitquilt.solvers.base import SOLVERS, LayerSpec, LinearStats, Solver, get_solver, hessian_error

__all__ = ["SOLVERS", "LayerSpec", "LinearStats", "Solver", "get_solver", "hessian_error"]
