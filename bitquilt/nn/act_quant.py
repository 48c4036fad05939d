"""Dynamic activation quantizers: the inputs of linears (and, via `kv_quant`, keys and values).

Each group of `group_size` consecutive values of a token (-1: the whole token) gets its own
b-bit grid at run time, from its range shrunk by the clipping ratio c:

  asymmetric   s = c·(max(x, 0) − min(x, 0)) / (2^b − 1),  z = round(−c·min(x, 0) / s),
               x̂ = s·(clamp(round(x/s) + z, 0, 2^b − 1) − z)
  symmetric    s = c·max|x| / (2^(b−1) − 1),  x̂ = s·clamp(round(x/s), −2^(b−1), 2^(b−1) − 1)

With `format="mxint"` the grid is MXINT-b instead (`bitquilt.formats.mxint`: blocks of 32 values
sharing a power-of-two scale, symmetric b-bit elements, no clipping), the format the MXSens recipe
uses for activations and the KV cache; `MXActQuantizer` gives each block of a linear's input the
mantissa width of the weight columns it meets.

The quantize-dequantize above is the only code path: calibration and evaluation run the same
modules. An `ActQuantizer` sits in the `act_quant` slot of a linear (`bitquilt.nn.online`),
after any online rotation of the input; the clipping ratio is decided at calibration
(`bitquilt.policies.act_clip`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from bitquilt.formats import mxint
from bitquilt.formats.base import WeightFormat
from bitquilt.nn.online import register_online

ACT_BITS = (2, 3, 4, 5, 6, 7, 8, 16)  # int grid, activations and KV cache alike; 16: no quantization
ACT_FORMATS = ("int", "mxint")


@dataclass(frozen=True)
class ActQuantConfig:
    bits: int = 16
    sym: bool = False
    group_size: int = -1  # -1: one group per token (per head for keys/values)
    clip_ratio: float | None = 1.0  # None: to be searched on calibration data
    format: str = "int"  # "int": the grids above; "mxint": MXINT-b blocks of 32 (sym, clip and group size unused)

    def validate(self) -> ActQuantConfig:
        if self.format not in ACT_FORMATS:
            raise ValueError(f"unknown activation format {self.format!r}; supported: {', '.join(ACT_FORMATS)}")
        if self.format == "mxint" and self.enabled:
            if self.bits not in mxint.MANTISSA_BITS:
                raise ValueError(f"unsupported MXINT activation bits {self.bits} (--a-bits, or --kv-bits for the KV "
                                 f"cache); supported: {_choices(mxint.MANTISSA_BITS + (16,))}")
            if self.clip_ratio != 1.0:
                raise ValueError("MXINT activations take no clipping ratio (their scales are powers of two fitted "
                                 "to each block's maximum); leave --a-clip at 1")
            return self
        if self.bits not in ACT_BITS:
            raise ValueError(f"unsupported activation bits {self.bits} (--a-bits, or --kv-bits for the KV cache); "
                             f"supported: {_choices(ACT_BITS)}")
        if self.clip_ratio is not None and not 0 < self.clip_ratio <= 1:
            raise ValueError(f"clipping ratio must be in (0, 1], got {self.clip_ratio}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"activation group size must be positive or -1, got {self.group_size}")
        return self

    @property
    def enabled(self) -> bool:
        return self.bits < 16


def _choices(bits: tuple[int, ...]) -> str:
    """'2, 3, 4 or 16 (off)'."""
    on = ", ".join(str(b) for b in bits if b < 16)
    return f"{on} or 16 (off)"


def fake_quantize(x: torch.Tensor, config: ActQuantConfig) -> torch.Tensor:
    """Quantize-dequantize x per group of its last dimension (see the module docstring; an unsearched
    clipping ratio counts as 1). Straight-through when x needs a gradient (block reconstruction trains
    the weights behind quantized activations)."""
    if not config.enabled:
        return x
    out = _fake_quantize(x, config)
    return x + (out - x).detach() if x.requires_grad else out


def _fake_quantize(x: torch.Tensor, config: ActQuantConfig) -> torch.Tensor:
    if config.format == "mxint":
        return mxint.fake_quantize(x, config.bits)
    n = x.shape[-1]
    g = n if config.group_size == -1 or config.group_size >= n else config.group_size
    if n % g:
        raise ValueError(f"activation group size {g} does not divide the width {n}")
    c = 1.0 if config.clip_ratio is None else config.clip_ratio
    xg = x.float().reshape(-1, g)
    if config.sym:
        qmax = 2 ** (config.bits - 1) - 1
        scale = (c * xg.abs().amax(dim=1, keepdim=True) / qmax).clamp(min=1e-8)
        out = scale * torch.clamp(torch.round(xg / scale), -qmax - 1, qmax)
    else:
        qmax = 2**config.bits - 1
        xmin = c * xg.amin(dim=1, keepdim=True).clamp(max=0)
        xmax = c * xg.amax(dim=1, keepdim=True).clamp(min=0)
        scale = ((xmax - xmin) / qmax).clamp(min=1e-8)
        zero = torch.round(-xmin / scale)
        out = scale * (torch.clamp(torch.round(xg / scale) + zero, 0, qmax) - zero)
    return out.reshape(x.shape).to(x.dtype)


class DynamicQuantizer(nn.Module):
    """A dynamic quantizer with a fixed `config` (clipping ratio decided); serialisable."""

    def __init__(self, config: ActQuantConfig | None = None):
        super().__init__()
        self.config = (config or ActQuantConfig()).validate()
        if self.config.clip_ratio is None:
            raise ValueError("a quantizer needs a clipping ratio; search it first (bitquilt.policies.act_clip)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self.config)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """Inverse of `to_dict`: the config's fields, then the subclass's own constructor arguments."""
        d = dict(d)
        config = ActQuantConfig(**{f: d.pop(f) for f in ActQuantConfig.__dataclass_fields__ if f in d})
        return cls(config, **d)

    def extra_repr(self) -> str:
        c = self.config
        g = "" if c.group_size == -1 else f" g{c.group_size}"
        if not c.enabled:
            return "off"
        if c.format == "mxint":
            return f"mxint{c.bits}"
        return f"{c.bits} bits{' sym' if c.sym else ''}{g} clip={c.clip_ratio:g}"


@register_online
class ActQuantizer(DynamicQuantizer):
    """x ↦ Q(x): the input quantizer of one linear (slot `act_quant`). Assign `config` to change its bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize(x, self.config)


@register_online
class MXActQuantizer(ActQuantizer):
    """MXINT input quantizer mirroring an MXINT weight's column classes: x is taken in the weight's
    stored column order (`perm`), each class of `columns[c]` values is quantized to MXINT with
    max(config.bits, widths[c]) bits (the weight columns' width, or more), and put back in place."""

    def __init__(self, config: ActQuantConfig, widths: list[int], columns: list[int],
                 perm: torch.Tensor | None = None, perm_size: int | None = None):
        super().__init__(config)
        if config.format != "mxint":
            raise ValueError(f"MXActQuantizer needs an mxint activation config, got format {config.format!r}")
        self.widths, self.columns = list(widths), list(columns)
        if perm is None and perm_size is not None:  # restored: the permutation loads as a saved tensor
            perm = torch.zeros(perm_size, dtype=torch.int64)
        self.register_buffer("perm", None if perm is None else perm.long())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xp = x if self.perm is None else x[..., self.perm]
        parts = torch.split(xp, self.columns, dim=-1)
        out = torch.cat([mxint.fake_quantize(p, max(self.config.bits, m)) for p, m in zip(parts, self.widths)], -1)
        if self.perm is None:
            return out
        y = torch.empty_like(out)
        y[..., self.perm] = out
        return y

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "widths": self.widths, "columns": self.columns,
                "perm_size": None if self.perm is None else self.perm.numel()}

    def extra_repr(self) -> str:
        return f"mxint{self.config.bits} over " + "/".join(f"{m}:{n}" for m, n in zip(self.widths, self.columns))


def input_quantizer(config: ActQuantConfig, weight: WeightFormat) -> ActQuantizer:
    """The quantizer of a linear's input: an MXActQuantizer following the classes of an MXINT `weight`
    when the config is mxint, else an ActQuantizer."""
    if config.format == "mxint" and isinstance(weight, mxint.MXIntFormat):
        return MXActQuantizer(config, weight.widths, weight.columns, weight.perm)
    return ActQuantizer(config)
