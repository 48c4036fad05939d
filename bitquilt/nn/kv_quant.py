"""KV-cache quantization: keys (after RoPE) and values quantized per head, in groups along head_dim.

Mechanism. transformers' attention modules compute q, k, v, apply RoPE, update the cache and
then call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)`.
We register one more implementation, `bitquilt_kv_<base>`, that applies the attention module's
`kv_quant` (if any) to (q, k, v) and hands over to the base implementation (sdpa, eager, ...)
with the base's mask function. That point is after RoPE in every supported family, sees the
whole key/value sequence with or without a cache (perplexity runs with `use_cache=False`), and
needs no copy of any modeling code. The cache itself keeps the unquantized tensors; since the
quantizer works per token, quantizing the whole sequence at every step gives exactly the values
a cache quantizing each token on entry would hold (a simulation of the memory saving, not the
saving itself).

QuaRot's online head-wise Hadamard on queries and keys (QKᵀ is unchanged, K's outliers are
spread before quantization) is the quantizer's `hadamard` flag.

Key centring. Keys carry a large component that is the same for every token (k_proj biases in
Qwen2.5, massive activations): in the first block of qwen2.5-1.5b it is ~30× the part that varies
between tokens, so a 4-bit grid spanning it leaves nothing for the part attention depends on, and
the model collapses. Keys are therefore quantized around a per-head, per-channel centre c fitted
on calibration data (the mean key): k̂ = Q(k − c) + c. Any constant c is exact for attention
(q·c is the same for every key of a query, so softmax ignores it): a kernel can store Q(k − c)
and skip adding c where the attention is a plain softmax.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from bitquilt.calib.capture import feed_linears
from bitquilt.models.adapters import Architecture, decoder_layers
from bitquilt.nn.act_quant import ActQuantConfig, DynamicQuantizer, fake_quantize
from bitquilt.transforms.hadamard import hadamard_transform

PREFIX = "bitquilt_kv_"


class KVQuantizer(DynamicQuantizer):
    """(q, k, v) ↦ (q H, Q(k H − c) + c, Q(v)) per head (H only if `hadamard`; c: `key_center`
    [kv_heads, 1, head_dim] once fitted, else 0); `config` sets bits and group size."""

    def __init__(self, config: ActQuantConfig | None = None, hadamard: bool = False,
                 key_center_shape: list[int] | None = None):
        super().__init__(config, hadamard)
        self.register_buffer("key_center", None if key_center_shape is None else torch.zeros(key_center_shape))
        self.key_sums: list[tuple[torch.Tensor, int]] | None = None  # set while fitting the centre

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        if self.hadamard:
            query, key = hadamard_transform(query), hadamard_transform(key)
        if self.key_sums is not None:  # fitting: record, leave the keys as they are
            self.key_sums.append((key.float().sum(dim=(0, 2)), key.shape[0] * key.shape[2]))
            return query, key, value
        c = self.key_center
        key = fake_quantize(key, self.config) if c is None else fake_quantize(key - c, self.config) + c
        return query, key, fake_quantize(value, self.config)

    def to_dict(self) -> dict[str, Any]:
        shape = None if self.key_center is None else list(self.key_center.shape)
        return {**super().to_dict(), "key_center_shape": shape}  # the centre itself is a saved tensor


def _base_attention(module: nn.Module, base: str):
    if base == "eager":  # each family's own eager function (e.g. with softcapping)
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[base]


def _kv_attention(base: str):
    def attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
        quantizer = getattr(module, "kv_quant", None)
        if quantizer is not None:
            query, key, value = quantizer(query, key, value)
        return _base_attention(module, base)(module, query, key, value, attention_mask, **kwargs)

    return attention


def enable_kv_attention(model: nn.Module) -> None:
    """Switch `model` to the `bitquilt_kv_<base>` attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    base = model.config._attn_implementation or "eager"
    if base.startswith(PREFIX):
        return
    name = PREFIX + base
    AttentionInterface.register(name, _kv_attention(base))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)


def attach_kv_quant(model: nn.Module, attention: str, quantizer: KVQuantizer | None) -> None:
    """Quantize the keys/values of the attention module named `attention` with `quantizer`."""
    model.get_submodule(attention).kv_quant = quantizer
    if quantizer is not None:
        enable_kv_attention(model)


def configure_kv_quant(model: nn.Module, arch: Architecture, config: ActQuantConfig) -> None:
    """Set every attention module's KV quantizer to `config`, keeping any head-wise Hadamard it has
    (nothing is attached where there is none and `config` is off)."""
    for i in range(len(decoder_layers(model, arch))):
        name = f"{arch.layers}.{i}.{arch.attention}"
        current = getattr(model.get_submodule(name), "kv_quant", None)
        if config.enabled or current is not None:
            attach_kv_quant(model, name, KVQuantizer(config, hadamard=current is not None and current.hadamard))


@torch.no_grad()
def fit_key_center(block: nn.Module, arch: Architecture, inputs: list[torch.Tensor], kwargs: dict[str, Any]) -> None:
    """Set the block's key centre to the mean key (after RoPE and any Hadamard) over the calibration
    inputs; each forward stops once attention has run."""
    quantizer = getattr(block.get_submodule(arch.attention), "kv_quant", None)
    if quantizer is None or not quantizer.config.enabled:
        return
    quantizer.key_sums = []
    try:
        feed_linears(block, [arch.values[1]], inputs, kwargs, lambda _name, _x: None)
        total = sum(s for s, _ in quantizer.key_sums)
        count = sum(n for _, n in quantizer.key_sums)
    finally:
        quantizer.key_sums = None
    quantizer.key_center = (total / count).unsqueeze(1)  # [kv_heads, 1, head_dim]
