"""The kernel registry: fast paths for `QuantLinear`, keyed by format name, and the checks every kernel shares.

A kernel is `fn(fmt, x2d, ctx) -> y2d` computing x @ Ŵᵀ for x of shape [tokens, in_features]
(bias is added by the caller), ctx the call's `MatmulContext` or None. It may return None to
decline (shape, dtype or device it does not handle, or per-token context it does not read), in
which case the format's torch reference (`WeightFormat.reference_matmul`) runs; that reference
is the oracle the kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bitquilt.formats.base import MatmulContext, WeightFormat

KernelFn = Callable[[WeightFormat, torch.Tensor, "MatmulContext | None"], "torch.Tensor | None"]
_KERNELS: dict[str, list[tuple[str, KernelFn]]] = {}
_builtins: Callable[[], None] | None = None  # registers the built-in kernels once; set by `bitquilt.kernels`


def set_builtins(load: Callable[[], None]) -> None:
    """`load` registers the built-in kernels; lookups call it first (it must make its second call cost nothing)."""
    global _builtins
    _builtins = load


def _table() -> dict[str, list[tuple[str, KernelFn]]]:
    """The kernels by format, the built-in ones registered first."""
    if _builtins is not None:
        _builtins()
    return _KERNELS


def register_kernel(format_name: str, kernel_name: str, fn: KernelFn, before: str | None = None) -> None:
    """Add a kernel for `format_name`, tried after those already registered; or, with `before`, ahead of
    that kernel if it is registered (a specialised kernel ahead of a generic one whatever the order)."""
    kernels = _KERNELS.setdefault(format_name, [])
    at = next((i for i, (name, _) in enumerate(kernels) if name == before), len(kernels))
    kernels.insert(at, (kernel_name, fn))


def kernels_for(format_name: str) -> list[str]:
    """The names of the kernels registered for `format_name`, in the order they are tried."""
    return [name for name, _ in _table().get(format_name, [])]


def dispatch(fmt: WeightFormat, x: torch.Tensor, ctx: MatmulContext | None = None) -> torch.Tensor | None:
    """x [tokens, in] @ Ŵᵀ through the first registered kernel that accepts the call, else None."""
    for _, fn in _table().get(fmt.name, []):
        y = fn(fmt, x, ctx)
        if y is not None:
            return y
    return None


def takes(x: torch.Tensor, ctx: MatmulContext | None = None) -> bool:
    """Whether a CPU kernel may take x: a 2-D CPU tensor, no gradient wanted, no per-token context (the
    checks every kernel makes first; cheap attribute reads, since they run on every call)."""
    return x.is_cpu and x.dim() == 2 and not (x.requires_grad and torch.is_grad_enabled()) \
        and (ctx is None or not ctx.per_token())


def fp32_rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous fp32 (x itself when it already is), the layout the compiled kernels read."""
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A kernel's fp32 result y in x's dtype (y itself when they match)."""
    return y if y.dtype == x.dtype else y.to(x.dtype)
