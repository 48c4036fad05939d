"""Per-channel scale migration between a module and the linears that read its output.

For a shared input with producer `prev`, dividing prev's output channel c by s_c and
multiplying column c of every consumer linear by s_c leaves the block's function unchanged.
Full-precision readers of the same input (an MoE router, `SharedInput.fp_readers`) take the same
column scale, so they still compute what they did (exactly, up to rounding) and stay unquantized.
AWQ and SmoothQuant differ only in how they choose s.
"""

from __future__ import annotations

import torch
from torch import nn

from bitquilt.models.adapters import Architecture, SharedInput


def can_fold(block: nn.Module, shared: SharedInput) -> bool:
    """A producer linear must emit exactly the consumers' input channels (not so for GQA v→o)."""
    prev = block.get_submodule(shared.prev)
    width = block.get_submodule(shared.linears[0]).in_features
    return not isinstance(prev, nn.Linear) or prev.out_features == width


@torch.no_grad()
def fold_scales(block: nn.Module, arch: Architecture, shared: SharedInput, s: torch.Tensor) -> None:
    prev = block.get_submodule(shared.prev)
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s.unsqueeze(1).to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    else:  # a norm: y = (offset + w) ⊙ x̂  →  (offset + w) / s = offset + w'
        w = prev.weight
        w.copy_(((arch.norm_offset + w.float()) / s - arch.norm_offset).to(w.dtype))
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    for name in (*shared.linears, *shared.fp_readers):
        lin = block.get_submodule(name)
        lin.weight.mul_(s.unsqueeze(0).to(lin.weight.dtype))
