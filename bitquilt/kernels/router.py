"""MoBiRoute per-token slice counts through the compiled CPU extension (csrc/kernels/slice_router.cpp).

`SliceRouter.counts` (bitquilt.nn.slice_router) asks here first: one C++ call per linear instead
of the ~15 eager torch ops of its reference `logits`, which at batch-1 decode cost about a third
of a routed step. Same math, fp32 sums in another order; tested against the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from bitquilt.kernels.options import options
from bitquilt.kernels.registry import fp32_rows


def slice_counts(x: torch.Tensor, fc1: nn.Linear, fc2: nn.Linear, threshold: float) -> torch.Tensor | None:
    """k_t for the rows of x [T, in] (1 + number of logits above `threshold`); None to decline
    (kernels disabled, extension unavailable, or not a CPU tensor)."""
    if not options().enabled or not x.is_cpu or x.dim() != 2:
        return None
    from bitquilt.kernels import cpu  # builds the extension on first use, like every kernel

    ext = cpu.extension()
    if ext is None:
        return None
    with torch.no_grad():
        return ext.slice_router_counts(fp32_rows(x), fp32_rows(fc1.weight), fp32_rows(fc1.bias),
                                       fp32_rows(fc2.weight), fp32_rows(fc2.bias), threshold)
