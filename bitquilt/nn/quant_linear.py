"""`QuantLinear`: a drop-in `nn.Linear` that stores a packed weight format and computes with it."""

from __future__ import annotations

import torch
from torch import nn

from bitquilt import kernels
from bitquilt.formats.base import MatmulContext, WeightFormat, buffer_name, split_buffers
from bitquilt.nn.online import get


class QuantLinear(nn.Module):
    """y = x Ŵᵀ + b, with Ŵ held packed in `fmt`.

    The format's tensors are buffers named by `formats.base.buffer_name`. The forward asks the
    kernel registry first; if no kernel takes the call it falls back to the format's torch
    reference (`fmt.reference_matmul`). The dequantized matrix is cached on first use by the
    reference path (`cache_dequantized=False` trades speed for memory). A module at the online
    slot "router" (`bitquilt.nn.slice_router`) maps the input to a per-token `MatmulContext` (how
    many slices of a multi-part weight each token uses) that the matmul honours; a static slice
    count (`set_slices`) overrides it. Online modules at its input slots (`bitquilt.nn.online`:
    rotation, activation quantizer) run in a pre-hook.
    """

    def __init__(self, fmt: WeightFormat, bias: torch.Tensor | None = None, cache_dequantized: bool = True):
        super().__init__()
        self.fmt = fmt
        self.in_features, self.out_features = fmt.in_features, fmt.out_features
        for name, t in fmt.tensors().items():
            self.register_buffer(buffer_name(name), t)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.cache_dequantized = cache_dequantized
        self._dequantized: torch.Tensor | None = None
        self.slices: int | None = None  # static precision: leading parts of a multi-part weight every token uses

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (fp32), for code that inspects `.weight`."""
        return self.dequantized()

    def set_slices(self, k: int | None) -> None:
        """Give every token the first k parts of a multi-part weight (None: all of them). The reference path
        dequantizes those parts when it first needs them; the kernels never do."""
        if k is not None and hasattr(self.fmt, "leading_parts"):
            self.fmt.leading_parts(k)  # raises for a count outside [0, number of parts]
        self.slices, self._dequantized = k, None

    def dequantized(self) -> torch.Tensor:
        if self._dequantized is not None:
            return self._dequantized
        w = self.fmt.dequantize(self.slices)
        if self.cache_dequantized:
            self._dequantized = w
        return w

    def __getstate__(self) -> dict:
        """Pickled (a resumable run's saved blocks) without the dequantized cache, which is rebuilt on use."""
        return {**self.__dict__, "_dequantized": None}

    def _apply(self, fn, recurse=True):
        # keep the format's tensors the same objects as the buffers after .to()/.cuda()
        super()._apply(fn, recurse)
        self.rebuild_format()
        return self

    def rebuild_format(self) -> None:
        """Make the format's tensors the module's buffers again, after they were moved or replaced (e.g. by views
        of a file the same bytes were written to)."""
        tensors = split_buffers(dict(self.named_buffers(recurse=False)))
        self.fmt = type(self.fmt).from_tensors(tensors, self.fmt.meta())
        self._dequantized = None

    def context_for(self, x: torch.Tensor) -> MatmulContext | None:
        """The run-time context of input x [..., in]: the router's, one entry per row of the 2-D x; None
        without a router or with a static slice count."""
        router = get(self, "router")
        return None if router is None or self.slices is not None else router(x).flat()

    def matmul(self, x: torch.Tensor, ctx: MatmulContext | None = None) -> torch.Tensor:
        """x [tokens, in] @ Ŵᵀ (no bias): a kernel if one takes the call, else the format's reference.

        A static slice count reaches kernels as the same count for every token; the format's
        reference then uses the cached weight (the first `slices` parts), which serves only calls
        without a context.
        """
        kernel_ctx = ctx
        if ctx is None and self.slices is not None:
            kernel_ctx = MatmulContext(slices=torch.full((x.shape[0],), self.slices, dtype=torch.int64))
        y = kernels.quant_matmul(self.fmt, x, kernel_ctx)
        if y is None:
            y = self.fmt.reference_matmul(x, ctx, self.dequantized() if ctx is None else None)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # run on every call of every linear (210 per decoded token on smollm2): direct dict reads, no no-op casts
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = self.matmul(rows, self.context_for(rows))
        if rows is not x:
            y = y.view(*x.shape[:-1], self.out_features)
        bias = self._parameters.get("bias")  # None when there is no bias (then a plain attribute)
        return y if bias is None else y + (bias if bias.dtype == y.dtype else bias.to(y.dtype))

    def extra_repr(self) -> str:
        bpw = self.fmt.bits_per_weight()
        return f"in={self.in_features}, out={self.out_features}, {self.fmt.describe()}, {bpw:.3f} bpw"


def multi_part_linears(model: nn.Module) -> dict[str, QuantLinear]:
    """The QuantLinears of `model` whose weight has several parts (slices)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and hasattr(m.fmt, "parts")}


def set_slices(model: nn.Module, k: int | None) -> float:
    """Static precision: every token uses the first k slices of every multi-part weight (None: all).
    Returns the element bits per weight then in use (Σ of the used slices' widths, averaged over weights)."""
    linears = multi_part_linears(model)
    if not linears:
        raise ValueError("the model has no multi-part (sliced) weights; quantize it with --method mobislice")
    used = total = 0
    for linear in linears.values():
        linear.set_slices(k)
        parts = list(linear.fmt.parts.values())[:k]
        numel = linear.in_features * linear.out_features
        used += numel * sum(p.bits for p in parts)
        total += numel
    return used / total
