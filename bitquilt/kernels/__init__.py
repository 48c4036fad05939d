"""Fast paths for `QuantLinear`: `quant_matmul(fmt, x, ctx)` runs x @ Ŵᵀ through the first kernel registered for
the format that accepts the call, or returns None and the format's torch reference runs.

- `registry`: the kernel table and the checks every kernel shares;
- `layouts`: the layouts kernels keep per format (`LayoutCache`), and `huge_pages` the memory they live in;
- `options`: what kernels may do where they are called (`using(enabled=False)`, `using(int8_activations=True)`);
- the built-in kernels, registered on the first call: `cpu` (the compiled extension: bit-plane lookup tables and
  dequantize + sgemm for uniform and bit-plane weights), `q4_int8` and `uniform8` (4/2-bit and 8-bit weights on int8
  activations, 8-bit GEMV), `mxint`, `mosaic` (dense base + sparse residual), `composite` (multi-part weights through
  their parts' kernels); `hadamard` and `router` are helpers the online modules call directly.
"""

from __future__ import annotations

import torch

from bitquilt.formats.base import MatmulContext, WeightFormat
from bitquilt.kernels.layouts import kernel_layout_bytes
from bitquilt.kernels.options import KernelOptions, options, using
from bitquilt.kernels.registry import dispatch, kernels_for, register_kernel, set_builtins

__all__ = ["KernelOptions", "kernel_layout_bytes", "kernels_for", "options", "quant_matmul", "register_kernel",
           "using"]

_builtin_loaded = False


def _load_builtin() -> None:
    """Register the built-in kernels once, on the first call (importing `cpu` loads the compiled extension; a
    missing one leaves the torch reference path with one warning). Each module's `register` says where its
    kernels go: a specialised kernel ahead of a generic one (`before=`)."""
    global _builtin_loaded
    if not _builtin_loaded:
        _builtin_loaded = True
        from bitquilt.kernels import composite, cpu, mosaic, mxint, q4_int8, uniform8

        for module in (composite, cpu, mosaic, mxint, q4_int8, uniform8):
            module.register()


set_builtins(_load_builtin)


def quant_matmul(fmt: WeightFormat, x: torch.Tensor, ctx: MatmulContext | None = None) -> torch.Tensor | None:
    """x [tokens, in] @ Ŵᵀ through the first registered kernel that accepts the call, else None (also while
    `options().enabled` is off)."""
    return dispatch(fmt, x, ctx) if options().enabled else None
