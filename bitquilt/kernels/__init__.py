"""Kernel registry: fast paths for `QuantLinear`, keyed by format name.

A kernel is `fn(fmt, x2d) -> y2d` computing x @ Ŵᵀ for x of shape [tokens, in_features]
(bias is added by the caller). It may return None to decline (shape, dtype or device it
does not handle), in which case the torch reference is used. The reference,
dequantize-then-matmul, is always available and is the oracle the kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bitquilt.formats.base import WeightFormat

KernelFn = Callable[[WeightFormat, torch.Tensor], "torch.Tensor | None"]
_KERNELS: dict[str, list[tuple[str, KernelFn]]] = {}
_enabled = True
_builtin_loaded = False


def _load_builtin() -> None:
    """Register the compiled CPU kernels on first use (builds them if `make kernels` did not)."""
    global _builtin_loaded
    if not _builtin_loaded:
        _builtin_loaded = True
        import bitquilt.kernels.cpu  # noqa: F401  (registers on import; warns once if unavailable)


def register_kernel(format_name: str, kernel_name: str, fn: KernelFn) -> None:
    _KERNELS.setdefault(format_name, []).append((kernel_name, fn))


def set_kernels_enabled(enabled: bool) -> None:
    """Force the torch reference everywhere (for debugging and for the tests' oracle)."""
    global _enabled
    _enabled = enabled


def kernels_for(format_name: str) -> list[str]:
    return [name for name, _ in _KERNELS.get(format_name, [])]


def reference_matmul(fmt: WeightFormat, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    w = fmt.dequantize() if weight is None else weight
    return x @ w.to(x.dtype).T


def quant_matmul(fmt: WeightFormat, x: torch.Tensor) -> torch.Tensor | None:
    """x [tokens, in] @ Ŵᵀ through the first registered kernel that accepts the call, else None."""
    if not _enabled:
        return None
    _load_builtin()
    for _, fn in _KERNELS.get(fmt.name, []):
        y = fn(fmt, x)
        if y is not None:
            return y
    return None
