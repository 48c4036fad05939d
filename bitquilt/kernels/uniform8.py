"""8-bit `UniformFormat` at decode batch sizes: codes widened to fp32 in registers (csrc/kernels/uniform8_gemv.cpp).

The bit-plane lookup-table kernel (`bitquilt.kernels.cpu`) costs time in proportion to the planes, so an
8-bit weight (an 8-bit LM head, W8 linears) runs 8 planes' lookups; this kernel reads each code once (1 byte
per weight, straight from the format's packed words, no extra layout) and multiplies it in fp32 FMAs. It
takes calls of up to `MAX_TOKENS` tokens, registered as "cpu_uniform8" ahead of "cpu_lut"; larger batches go
on to cpu_lut, whose dequantize + sgemm path serves them. Per format it keeps the fp32 scales and
scale × zero per (row, group) in a `LayoutCache` (8 bytes per group). Exact up to fp32 summation order;
with `kernels.using(int8_activations=True)` it rounds each token to int8 per block of 32 and multiplies in integer
instructions (vpmaddubsw on the codes shifted to signed), exactly x̂ @ Ŵᵀ for the rounded x̂.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from bitquilt.formats.base import MatmulContext, WeightFormat
from bitquilt.formats.uniform import UniformFormat, resolve_group_size
from bitquilt.kernels import cpu
from bitquilt.kernels.layouts import LayoutCache
from bitquilt.kernels.options import options
from bitquilt.kernels.registry import fp32_rows, like, register_kernel, takes

# the GEMV beats the lookup tables up to here (bench/kernel_speed.py --uniform8, bench/results/uniform8_kernel_*.md);
# beyond: cpu_lut
MAX_TOKENS = 16


@dataclass(frozen=True)
class Groups:
    """Per (row, group) fp32 scale and scale × zero of an 8-bit uniform format."""

    scale: torch.Tensor
    scale_zero: torch.Tensor
    group: int

    def nbytes(self) -> int:
        return self.scale.nbytes + self.scale_zero.nbytes


def _groups(fmt: WeightFormat) -> Groups | None:
    if not isinstance(fmt, UniformFormat) or fmt.bits != 8 or fmt.g_idx is not None or sys.byteorder != "little":
        return None
    group = resolve_group_size(fmt.group_size, fmt.in_features)
    if fmt.in_features % 32 or group % 32:
        return None
    scale, zero = fmt.scale_zero()
    return Groups(scale.contiguous(), (scale * zero).contiguous(), group)


_LAYOUTS: LayoutCache[Groups] = LayoutCache(_groups)


def operands(fmt: WeightFormat) -> tuple[torch.Tensor, Groups] | None:
    """The kernel's codes uint8 [N, K] (the format's own words, no copy) and per-group terms of an 8-bit uniform
    format; None if it does not qualify or the extension is unavailable."""
    if getattr(fmt, "bits", None) != 8 or cpu.extension() is None:
        return None
    groups = _LAYOUTS.get(fmt)
    if groups is None:
        return None
    return fmt.qweight.contiguous().view(torch.uint8), groups  # 4 codes per little-endian int32 word: row by row


def matmul(fmt: WeightFormat, x: torch.Tensor, ctx: MatmulContext | None = None) -> torch.Tensor | None:
    """x [T, in] @ Ŵᵀ for an 8-bit `UniformFormat` and T ≤ MAX_TOKENS; None to decline."""
    if getattr(fmt, "bits", None) != 8 or not takes(x, ctx) or x.shape[0] > MAX_TOKENS:
        return None  # the bits first: this kernel sits ahead of cpu_lut on every uniform call
    found = operands(fmt)
    if found is None:
        return None
    codes, groups = found
    y = cpu.extension().uniform8_gemv(fp32_rows(x), codes, groups.scale, groups.scale_zero, groups.group,
                                      int8=options().int8_activations)
    return like(y, x)


def register() -> bool:
    """Register the 8-bit GEMV ahead of cpu_lut if the extension loads; False otherwise."""
    if cpu.extension() is None:
        return False
    register_kernel("uniform", "cpu_uniform8", matmul, before="cpu_lut")
    return True
