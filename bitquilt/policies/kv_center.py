"""Key centring: the centre each attention module's keys are quantized around (see `bitquilt.nn.kv_quant`).

The centre is the mean key over the block's calibration inputs, per KV head and channel, after
RoPE and any online rotation of the keys: a `KeyRecorder` takes the KV quantizer's slot while the
block runs (each forward stops once attention has run), then the quantizer gets the centre.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bitquilt.calib.capture import feed_linears
from bitquilt.calib.stages import BlockContext, register_stage
from bitquilt.nn.kv_quant import KVQuantizer
from bitquilt.nn.online import attach, get


class KeyRecorder(nn.Module):
    """Passes (q, k, v) through unchanged and sums the keys per head and channel."""

    def __init__(self) -> None:
        super().__init__()
        self.total: torch.Tensor | float = 0.0
        self.count = 0

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        self.total = self.total + key.float().sum(dim=(0, 2))
        self.count += key.shape[0] * key.shape[2]
        return query, key, value


@register_stage("kv_center", scope="block", kind="policy")
@torch.no_grad()
def kv_center(ctx: BlockContext, _options: Any) -> dict[str, Any]:
    attention = ctx.block.get_submodule(ctx.arch.attention)
    quantizer = get(attention, "kv_quant")
    if not isinstance(quantizer, KVQuantizer) or not quantizer.config.enabled:
        return {}
    recorder = KeyRecorder()
    attach(attention, "kv_quant", recorder)
    try:
        feed_linears(ctx.block, [ctx.arch.values[1]], ctx.inputs, ctx.kwargs, lambda _name, _x: None)
    finally:
        attach(attention, "kv_quant", quantizer)
    quantizer.key_center = (recorder.total / recorder.count).unsqueeze(1)  # [kv_heads, 1, head_dim]
    return {"mean_abs_center": float(quantizer.key_center.abs().mean())}
