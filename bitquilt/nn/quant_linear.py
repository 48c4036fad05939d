"""`QuantLinear`: a drop-in `nn.Linear` that stores a packed weight format and computes with it."""

from __future__ import annotations

import torch
from torch import nn

from bitquilt import kernels
from bitquilt.formats.base import WeightFormat


class QuantLinear(nn.Module):
    """y = x Ŵᵀ + b, with Ŵ held packed in `fmt`.

    The forward asks the kernel registry first; if no kernel takes the call it falls back to
    the torch reference (dequantize, then matmul). The dequantized matrix is cached on first
    use by the reference path (`cache_dequantized=False` trades speed for memory). An optional
    `act_quant` (`bitquilt.nn.act_quant.ActQuantizer`) transforms/quantizes x before the matmul.
    """

    def __init__(self, fmt: WeightFormat, bias: torch.Tensor | None = None, cache_dequantized: bool = True,
                 act_quant: nn.Module | None = None):
        super().__init__()
        self.fmt = fmt
        self.in_features, self.out_features = fmt.in_features, fmt.out_features
        for name, t in fmt.tensors().items():
            self.register_buffer(f"packed_{name}", t)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.cache_dequantized = cache_dequantized
        self._dequantized: torch.Tensor | None = None
        self.act_quant = act_quant

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (fp32), for code that inspects `.weight`."""
        return self.dequantized()

    def dequantized(self) -> torch.Tensor:
        if self._dequantized is not None:
            return self._dequantized
        w = self.fmt.dequantize()
        if self.cache_dequantized:
            self._dequantized = w
        return w

    def _apply(self, fn, recurse=True):
        # keep the format's tensors the same objects as the buffers after .to()/.cuda()
        super()._apply(fn, recurse)
        tensors = {name[len("packed_"):]: buf for name, buf in self.named_buffers(recurse=False)}
        self.fmt = type(self.fmt).from_tensors(tensors, self.fmt.meta())
        self._dequantized = None
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_quant is not None:
            x = self.act_quant(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = kernels.quant_matmul(self.fmt, x2)
        if y is None:
            y = kernels.reference_matmul(self.fmt, x2, self.dequantized())
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        bpw = self.fmt.bits_per_weight()
        return f"in={self.in_features}, out={self.out_features}, {self.fmt.describe()}, {bpw:.3f} bpw"
