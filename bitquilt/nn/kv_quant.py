"""KV-cache quantization: keys (after RoPE) and values quantized per head, in groups along head_dim.

A `KVQuantizer` sits in the `kv_quant` slot of an attention module: the attention site of
`bitquilt.nn.online` hands it (q, k, v) after RoPE and after any `qk_rotation` (QuaRot's
head-wise Hadamard), then calls the base attention implementation. That point sees the whole
key/value sequence with or without a cache (perplexity runs with `use_cache=False`). The cache
itself keeps the unquantized tensors; since the quantizer works per token, quantizing the whole
sequence at every step gives exactly the values a cache quantizing each token on entry would
hold (a simulation of the memory saving, not the saving itself).

Key centring. Keys carry a large component that is the same for every token (k_proj biases in
Qwen2.5, massive activations), often many times the part that varies between tokens, so a 4-bit
grid spanning it leaves nothing for the part attention depends on, and the model collapses. Keys are
therefore quantized around a per-head, per-channel centre c fitted on calibration data (the mean key,
`bitquilt.policies.kv_center`): k̂ = Q(k − c) + c. Any constant c is exact for attention (q·c is the same for
every key of a query, so softmax ignores it): a kernel can store Q(k − c) and skip adding c where the attention
is a plain softmax.
"""

from __future__ import annotations

from typing import Any

import torch

from bitquilt.nn.act_quant import ActQuantConfig, DynamicQuantizer, fake_quantize
from bitquilt.nn.online import register_online


@register_online
class KVQuantizer(DynamicQuantizer):
    """(q, k, v) ↦ (q, Q(k − c) + c, Q(v)) per head (c: `key_center` [kv_heads, 1, head_dim] once
    fitted, else 0); `config` sets bits and group size: values per group along head_dim, a divisor of it,
    with -1 or any size ≥ head_dim meaning one group per head (`--kv-group-size`)."""

    def __init__(self, config: ActQuantConfig | None = None, key_center: torch.Tensor | None = None,
                 key_center_shape: list[int] | None = None):
        super().__init__(config)
        if key_center is None and key_center_shape is not None:  # restored: the centre loads as a saved tensor
            key_center = torch.zeros(key_center_shape)
        self.register_buffer("key_center", key_center)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        c = self.key_center
        key = fake_quantize(key, self.config) if c is None else fake_quantize(key - c, self.config) + c
        return query, key, fake_quantize(value, self.config)

    def to_dict(self) -> dict[str, Any]:
        shape = None if self.key_center is None else list(self.key_center.shape)
        return {**super().to_dict(), "key_center_shape": shape}
