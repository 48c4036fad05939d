"""Dynamic activation quantizers: the inputs of linears (and, via `kv_quant`, keys and values).

Each group of `group_size` consecutive values of a token (-1: the whole token) gets its own
b-bit grid at run time, from its range shrunk by the clipping ratio c:

  asymmetric   s = c·(max(x, 0) − min(x, 0)) / (2^b − 1),  z = round(−c·min(x, 0) / s),
               x̂ = s·(clamp(round(x/s) + z, 0, 2^b − 1) − z)
  symmetric    s = c·max|x| / (2^(b−1) − 1),  x̂ = s·clamp(round(x/s), −2^(b−1), 2^(b−1) − 1)

The quantize-dequantize above is the only code path: calibration and evaluation run the same
modules. An `ActQuantizer` may first apply an online Hadamard transform (QuaRot: the inputs of
o_proj and down_proj, whose weights carry the matching transform).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from bitquilt.calib.capture import sample_inputs
from bitquilt.transforms.hadamard import hadamard_transform

ACT_BITS = (2, 3, 4, 5, 6, 7, 8, 16)  # 16: no quantization
CLIP_GRID = tuple(round(1 - 0.05 * i, 2) for i in range(10))  # 1.0 … 0.55


@dataclass(frozen=True)
class ActQuantConfig:
    bits: int = 16
    sym: bool = False
    group_size: int = -1  # -1: one group per token (per head for keys/values)
    clip_ratio: float | None = 1.0  # None: to be searched on calibration data

    def validate(self) -> ActQuantConfig:
        if self.bits not in ACT_BITS:
            raise ValueError(f"unsupported activation bits {self.bits}; supported: {', '.join(map(str, ACT_BITS))}")
        if self.clip_ratio is not None and not 0 < self.clip_ratio <= 1:
            raise ValueError(f"clipping ratio must be in (0, 1], got {self.clip_ratio}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"activation group size must be positive or -1, got {self.group_size}")
        return self

    @property
    def enabled(self) -> bool:
        return self.bits < 16


def fake_quantize(x: torch.Tensor, config: ActQuantConfig) -> torch.Tensor:
    """Quantize-dequantize x per group of its last dimension (see the module docstring; an unsearched
    clipping ratio counts as 1)."""
    if not config.enabled:
        return x
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
    """A dynamic quantizer `config`, optionally preceded by an online Hadamard (`hadamard`); serialisable."""

    def __init__(self, config: ActQuantConfig | None = None, hadamard: bool = False):
        super().__init__()
        self.config = (config or ActQuantConfig()).validate()
        if self.config.clip_ratio is None:
            raise ValueError("a quantizer needs a clipping ratio; search it first (see input_quantizers)")
        self.hadamard = hadamard

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self.config), "hadamard": self.hadamard}

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """Inverse of `to_dict`: the config's fields, then the subclass's own constructor arguments."""
        d = dict(d)
        config = ActQuantConfig(**{f: d.pop(f) for f in ActQuantConfig.__dataclass_fields__ if f in d})
        return cls(config, **d)

    def extra_repr(self) -> str:
        c = self.config
        g = "" if c.group_size == -1 else f" g{c.group_size}"
        bits = f"{c.bits} bits{' sym' if c.sym else ''}{g} clip={c.clip_ratio:g}" if c.enabled else "off"
        return bits + (", hadamard" if self.hadamard else "")


class ActQuantizer(DynamicQuantizer):
    """x ↦ Q(x H) (H only if `hadamard`): the input quantizer of one linear.

    A `QuantLinear` applies it in its forward; a plain `nn.Linear` gets it through a forward
    pre-hook (`attach_act_quant`) that runs before any other pre-hook, so calibration hooks on
    an unsolved linear see the input as its matmul does (hooks on a QuantLinear see it before).
    Assign `config` to change the bits of one layer.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hadamard:
            x = hadamard_transform(x)
        return fake_quantize(x, self.config)


def _apply_act_quant(module: nn.Module, args: tuple) -> tuple | None:
    q = getattr(module, "act_quant", None)
    return None if q is None else (q(args[0]), *args[1:])


def attach_act_quant(linear: nn.Module, quantizer: ActQuantizer | None) -> None:
    """Make `linear` (a QuantLinear or an nn.Linear) quantize its inputs with `quantizer` (None: stop)."""
    from bitquilt.nn.quant_linear import QuantLinear

    linear.act_quant = quantizer
    if not isinstance(linear, QuantLinear) and not getattr(linear, "_act_quant_hooked", False):
        linear.register_forward_pre_hook(_apply_act_quant, prepend=True)
        linear._act_quant_hooked = True


@torch.no_grad()
def search_clip_ratio(x: torch.Tensor, weight: torch.Tensor, config: ActQuantConfig,
                      grid: tuple[float, ...] = CLIP_GRID) -> float:
    """The ratio c minimising the output error Σ_t ‖(x̂_t − x_t) Wᵀ‖² on samples x [tokens, in]
    (through the Gram matrix WᵀW when the layer widens its input, which is then cheaper)."""
    w = weight.float()
    gram = w.T @ w if w.shape[0] > w.shape[1] else None
    losses = []
    for c in grid:
        d = fake_quantize(x, replace(config, clip_ratio=c)) - x
        losses.append(float(((d @ gram) * d).sum() if gram is not None else (d @ w.T).pow(2).sum()))
    return grid[losses.index(min(losses))]


def input_quantizers(block: nn.Module, names: list[str], configs: dict[str, ActQuantConfig | None],
                     inputs: list[torch.Tensor], kwargs: dict[str, Any]) -> dict[str, ActQuantizer | None]:
    """The input quantizer each of `names` takes when solved: its config (clipping searched where
    the ratio is None) after the online Hadamard the linear already has, if any."""
    search = [n for n in names if configs[n] is not None and configs[n].enabled and configs[n].clip_ratio is None]
    samples = sample_inputs(block, search, inputs, kwargs) if search else {}
    out = {}
    for n in names:
        lin, config = block.get_submodule(n), configs[n]
        current = getattr(lin, "act_quant", None)
        if config is None or not config.enabled:
            out[n] = current
            continue
        if config.clip_ratio is None:
            config = replace(config, clip_ratio=search_clip_ratio(samples[n], lin.weight, config))
        out[n] = ActQuantizer(config, hadamard=current is not None and current.hadamard)
    return out
