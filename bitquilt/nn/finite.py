"""NaN/Inf checks of weights, what quantizing, streaming and exporting refuse alike, in chunks: `torch.isfinite` on
a whole tensor allocates an fp32 copy (abs) and two boolean masks, a transient of twice an embedding matrix."""

from __future__ import annotations

import torch
from torch import nn


def all_finite(t: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """`torch.isfinite(t).all()` a chunk of elements at a time (True for integer tensors)."""
    if not t.is_floating_point():
        return True
    return all(bool(torch.isfinite(part).all()) for part in t.reshape(-1).split(chunk))


def non_finite_parameter(model: nn.Module) -> str | None:
    """The name of the first parameter of `model` holding NaN or Inf; None when all are finite."""
    return next((name for name, p in model.named_parameters() if not all_finite(p.detach())), None)
