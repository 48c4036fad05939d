"""llama.cpp's K-quant mixes (`llama-quantize ... Q4_K_M`): which block type each tensor gets.

`tensor_type` is `llama_tensor_get_type_impl` (src/llama-quant.cpp) for a dense decoder, on llama.cpp's tensor roles:
every tensor takes the mix's base type except

  output (and token_embd when tied to it)  Q6_K
  attn_v       Q2_K: Q4_K if n_head / n_head_kv ≥ 4 else Q3_K · Q3_K_M: Q5_K in layers 0-1, else Q4_K ·
               Q4_K_M, Q5_K_M: Q6_K in the `more_bits` layers · Q4_K_S: Q5_K in layers 0-3
  ffn_down     Q2_K: Q3_K · Q3_K_M: Q5_K in the first n/16 layers, else Q4_K · Q4_K_M, Q5_K_M: Q6_K in the
               `more_bits` layers · Q4_K_S: Q5_K in the first n/8 layers
  attn_output  Q2_K: Q3_K · Q3_K_M: Q4_K
  attn_qkv     Q3_K_M: Q4_K · Q4_K_M: Q5_K · Q5_K_M: Q6_K (phi3's q/k/v, which the GGUF holds as one tensor: its
               parts take its type; its gate/up, llama.cpp's fused ffn_up, take ffn_up's)

then, for rows that do not split into 256 values, llama.cpp's 32-value fallback (`formats.ggml_blocks.with_fallback`:
smollm2's and qwen2.5-0.5b's hidden widths 576 and 896 put most of their tensors there). Norms and biases stay F32.
The `gguf_mix` policy writes each linear's type into its plan (`ggml_type`, read by the gguf solvers); the input
embeddings and the LM head get theirs in `bitquilt.pipeline.head`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from bitquilt.calib.stages import ModelContext, register_stage
from bitquilt.formats.ggml_blocks import block_type
from bitquilt.models.adapters import architecture_for
from bitquilt.registry import option

MIXES = {"Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K",
         "Q6_K": "Q6_K"}  # mix -> its base block type
ROLES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "gate_proj": "ffn_gate",
         "up_proj": "ffn_up", "down_proj": "ffn_down"}  # Hugging Face linear -> llama.cpp tensor role
FUSED_ROLES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # a fusion's parts -> the fused role


def check_mix(mix: str) -> str:
    if mix not in MIXES:
        raise ValueError(f"unknown --gguf-type {mix!r}; use one of {', '.join(MIXES)}")
    return mix


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third one between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(mix: str, role: str, layer: int = 0, n_layers: int = 1, n_gqa: int = 1) -> str:
    """The block type llama.cpp's mix `mix` gives a tensor of `role` in decoder layer `layer` of `n_layers`, before
    the fallback for narrow rows (module docstring). Roles: output, token_embd (untied), tied_embd, attn_q, attn_k,
    attn_v, attn_qkv, attn_output, ffn_gate, ffn_up, ffn_down."""
    if role in ("output", "tied_embd"):
        return "Q6_K"
    if role == "attn_v":
        if mix == "Q2_K":
            return "Q4_K" if n_gqa >= 4 else "Q3_K"
        if mix == "Q3_K_M":
            return "Q5_K" if layer < 2 else "Q4_K"
        if mix in ("Q4_K_M", "Q5_K_M") and more_bits(layer, n_layers):
            return "Q6_K"
        if mix == "Q4_K_S" and layer < 4:
            return "Q5_K"
    elif role == "ffn_down":
        if mix == "Q2_K":
            return "Q3_K"
        if mix == "Q3_K_M":
            return "Q5_K" if layer < n_layers // 16 else "Q4_K"
        if mix in ("Q4_K_M", "Q5_K_M") and more_bits(layer, n_layers):
            return "Q6_K"
        if mix == "Q4_K_S" and layer < n_layers // 8:
            return "Q5_K"
    elif role == "attn_output" and mix in ("Q2_K", "Q3_K_M"):
        return "Q3_K" if mix == "Q2_K" else "Q4_K"
    elif role == "attn_qkv" and mix in ("Q3_K_M", "Q4_K_M", "Q5_K_M"):
        return {"Q3_K_M": "Q4_K", "Q4_K_M": "Q5_K", "Q5_K_M": "Q6_K"}[mix]
    return MIXES[mix]


def linear_type(mix: str, name: str, config: Any) -> str:
    """`tensor_type` of the decoder linear `name` (e.g. model.layers.3.mlp.down_proj) of a model with `config`; a part
    of a fused projection (phi3's q_proj) takes the fused tensor's role."""
    found = re.search(r"\.(\d+)\.", name)
    arch = architecture_for(config.model_type)
    fusion = next((f for f in arch.fusions if name.endswith(tuple(f".{p}" for p in f.parts))), None) if arch else None
    role = FUSED_ROLES[fusion.fused] if fusion else ROLES.get(name.rpartition(".")[2], "other")
    n_gqa = config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return tensor_type(mix, role, int(found.group(1)) if found else 0, config.num_hidden_layers, n_gqa)


@dataclass(frozen=True)
class GGUFMixOptions:
    mix: str = option("Q4_K_M", f"llama.cpp mix: {', '.join(MIXES)}")

    def __post_init__(self) -> None:
        check_mix(self.mix)


@register_stage("gguf_mix", scope="prepass", kind="policy", options=GGUFMixOptions, needs_calibration=False,
                streams=True)
def gguf_mix(ctx: ModelContext, opts: GGUFMixOptions) -> dict[str, Any]:
    """Give every planned linear the block type of llama.cpp's mix (its solver applies the narrow-row fallback)."""
    chosen = {}
    for name in ctx.plan.quantized():
        t = block_type(linear_type(opts.mix, name, ctx.model.config))
        ctx.plan[name].params["ggml_type"] = t.name
        ctx.plan[name].weight = replace(ctx.plan[name].weight, bits=t.bits, group_size=t.block)
        chosen[name] = t.name
    ctx.plan.decisions["gguf_mix"] = {"mix": opts.mix, "types": chosen}
    counts: dict[str, int] = {}
    for t in chosen.values():
        counts[t] = counts.get(t, 0) + 1
    return {"mix": opts.mix, "linears": counts}
