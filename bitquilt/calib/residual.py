"""Residual-stream dynamics across depth (DynamicPTQ): how much each decoder layer moves the stream,
and how much of what was already there survives low-bit quantization of the result.

For a token t entering decoder layer ℓ with residual state x = x_t^(ℓ) and leaving it with
x' = x_t^(ℓ+1) = x + Δx (Δx = the attention half + the MLP half, h = x + Δx_attn in between):

  Jump Ratio              JR_t = ‖Δx‖ / ‖x‖            (per half: ‖h − x‖/‖x‖ and ‖x' − h‖/‖h‖)
  max-abs Jump Ratio      JRmax_t = max|Δx| / max|x|
  Historical-Feature SNR  SNR_t = 10·log10(‖x‖² / ‖Q_b(x') − x'‖²)  dB

Q_b is the per-token activation quantizer a linear reading x' would apply (b bits). A large jump
widens x' and with it Q_b's step, and the history x the next layers still need is then coded with
fewer levels: the SNR measures the history's energy against the rounding noise the quantized
stream carries. An orthogonal rotation R (QuaRot) leaves JR unchanged (‖ΔxR‖/‖xR‖ = ‖Δx‖/‖x‖), so
rotations alone cannot remove a jump; they do change the SNR (the noise of Q_b depends on the
basis), which is why it is measured after the backbone's rotation. Layer values are means over
calibration tokens (the per-token distribution is summarised by percentiles of JR).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from bitquilt.calib.capture import block_output, capture_block_inputs
from bitquilt.models.adapters import Architecture, decoder_layers
from bitquilt.nn.act_quant import ActQuantConfig, fake_quantize


def jump_ratio(x: torch.Tensor, x_next: torch.Tensor) -> torch.Tensor:
    """‖x' − x‖ / ‖x‖ per token (rows of [tokens, d])."""
    return (x_next - x).norm(dim=-1) / x.norm(dim=-1).clamp(min=1e-30)


def maxabs_jump_ratio(x: torch.Tensor, x_next: torch.Tensor) -> torch.Tensor:
    """max|x' − x| / max|x| per token."""
    return (x_next - x).abs().amax(dim=-1) / x.abs().amax(dim=-1).clamp(min=1e-30)


def historical_snr_db(x: torch.Tensor, x_next: torch.Tensor, config: ActQuantConfig) -> torch.Tensor:
    """10·log10(‖x‖² / ‖Q(x') − x'‖²) per token, Q the activation quantizer `config`."""
    noise = (fake_quantize(x_next, config) - x_next).pow(2).sum(dim=-1).clamp(min=1e-30)
    return 10 * torch.log10(x.pow(2).sum(dim=-1).clamp(min=1e-30) / noise)


@dataclass
class LayerPhase:
    """The residual-stream metrics of one decoder layer (means over calibration tokens)."""

    layer: int
    jump_ratio: float
    jump_ratio_attn: float
    jump_ratio_mlp: float
    jump_ratio_maxabs: float
    jump_ratio_p50: float
    jump_ratio_p99: float
    snr_db: dict[int, float] = field(default_factory=dict)  # bits -> mean SNR in dB

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "snr_db": {str(b): v for b, v in self.snr_db.items()}}


class _Collector:
    """Per-layer lists of per-token metrics, filled by hooks on each decoder layer and its MLP norm."""

    def __init__(self, n_layers: int, configs: dict[int, ActQuantConfig]):
        self.configs = configs
        self.values: list[dict[str, list[torch.Tensor]]] = [{} for _ in range(n_layers)]
        self.inputs: list[torch.Tensor | None] = [None] * n_layers
        self.mids: list[torch.Tensor | None] = [None] * n_layers

    def add(self, i: int, key: str, v: torch.Tensor) -> None:
        self.values[i].setdefault(key, []).append(v.float().reshape(-1))

    def finish_layer(self, i: int, x_next: torch.Tensor) -> None:
        x, h = self.inputs[i], self.mids[i]
        d = x.shape[-1]
        x, x_next = x.reshape(-1, d).float(), x_next.reshape(-1, d).float()
        self.add(i, "jr", jump_ratio(x, x_next))
        self.add(i, "jr_max", maxabs_jump_ratio(x, x_next))
        if h is not None:
            h = h.reshape(-1, d).float()
            self.add(i, "jr_attn", jump_ratio(x, h))
            self.add(i, "jr_mlp", jump_ratio(h, x_next))
        for bits, config in self.configs.items():
            self.add(i, f"snr{bits}", historical_snr_db(x, x_next, config))

    def phases(self) -> list[LayerPhase]:
        out = []
        for i, vals in enumerate(self.values):
            cat = {k: torch.cat(v) for k, v in vals.items()}
            mean = {k: float(v.mean()) for k, v in cat.items()}
            out.append(LayerPhase(i, mean["jr"], mean.get("jr_attn", math.nan), mean.get("jr_mlp", math.nan),
                                  mean["jr_max"], float(cat["jr"].quantile(0.5)), float(cat["jr"].quantile(0.99)),
                                  {b: mean[f"snr{b}"] for b in self.configs}))
        return out


def mlp_norm_name(arch: Architecture) -> str | None:
    """The norm in front of the MLP: its input is the residual stream between the two halves."""
    readers = arch.residual_readers()
    return readers[1].prev if len(readers) > 1 else None


@torch.no_grad()
def residual_phases(model: nn.Module, arch: Architecture, calib_ids: torch.Tensor,
                    configs: dict[int, ActQuantConfig],
                    blocks: Iterable[tuple[int, nn.Module]] | None = None) -> list[LayerPhase]:
    """Run the calibration windows through the decoder blocks and measure each (see module docstring).

    `configs` maps a label (the bit width) to the activation quantizer the SNR is measured with. `blocks` yields
    (index, block) in order, each block in memory while its step runs (`ModelContext.walk_blocks`: read one at a
    time under streaming); default: the model's own.
    """
    layers = decoder_layers(model, arch)
    col = _Collector(len(layers), configs)
    mid_name = mlp_norm_name(arch)
    hidden, kwargs = capture_block_inputs(model, arch, calib_ids)
    for i, block in enumerate(layers) if blocks is None else blocks:
        def mid(_m, args, i=i):
            col.mids[i] = args[0]

        handle = None if mid_name is None else block.get_submodule(mid_name).register_forward_pre_hook(mid)
        try:
            outputs = []
            for x in hidden:
                col.inputs[i] = x
                outputs.append(block_output(block, x, kwargs[i]))
                col.finish_layer(i, outputs[-1])
        finally:
            if handle is not None:
                handle.remove()
        hidden = outputs
    return col.phases()
