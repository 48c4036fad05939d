"""Orthonormal Hadamard transform of fp32 rows, each row in one pass while it sits in L1 (csrc/kernels/hadamard.cpp).

QuaRot's online rotations (the down projection's input, the per-head query/key rotation) run on every forward
of calibration, evaluation and decode; the torch path (`bitquilt.nn.hadamard`) runs one pass over the whole
tensor per butterfly stage, as long as the down projection's matmul itself at 1536 columns. This kernel gives
the same y = (x ⊙ s) M_n to fp32 rounding; `bitquilt.nn.hadamard.hadamard_transform` calls it and falls back to
torch when it declines (not fp32, not on the CPU, a gradient wanted, kernels off or unavailable).
"""

from __future__ import annotations

import torch

from bitquilt.kernels.options import options


def transform(x: torch.Tensor, signs: torch.Tensor | None, factor: torch.Tensor) -> torch.Tensor | None:
    """(x ⊙ signs) M_n along the last dimension, M_n = F ⊗ H_k with `factor` = F / √k (fp32 [p, p]); None to
    decline."""
    if not options().enabled or x.dtype != torch.float32 or not x.is_cpu or x.numel() == 0 \
            or (x.requires_grad and torch.is_grad_enabled()):
        return None
    from bitquilt.kernels import cpu  # here, not at import: importing it builds the extension, and the command
    # lines import this module before they check their arguments (a bad flag answers at once, not after a build)

    ext = cpu.extension()
    if ext is None:
        return None
    n = x.shape[-1]
    s = None if signs is None else signs.to(device=x.device, dtype=torch.float32).contiguous()
    return ext.hadamard_rows(x.reshape(-1, n).contiguous(), s, factor).view(x.shape)
