"""GGUF layout of mixture-of-experts models, as llama.cpp's converter writes Mixtral, Qwen3-MoE and OLMoE.

llama.cpp keeps the same linear of every expert of a block as one 3D tensor (`blk.N.ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`: [experts, rows, columns], expert 0 first) and the router as `blk.N.ffn_gate_inp` (F32, one row per
expert); `expert_stack` names the stack a per-expert linear joins. Its MoE graph picks each token's experts by
softmax and top-k, renormalising the k weights on llama (Mixtral) and qwen3moe and not on olmoe: a config routing
otherwise is refused (`moe_refusal`), as are OLMoE's q/k/v clipping and Mixtral's sliding window, which those graphs
lack, and OLMoE with fewer key/value heads than query heads (llama.cpp's olmoe has none).
"""

from __future__ import annotations

import re
from typing import Any

import gguf
from gguf import GGUFValueType as V

from bitquilt.models.adapters import Experts, architecture_for

# whether llama.cpp's graph of the family renormalises the top-k routing weights to sum to 1
RENORMALISED = {"mixtral": True, "qwen3_moe": True, "olmoe": False}


def expert_stack(hf_name: str, experts: Experts | None) -> str | None:
    """The name of the stacked tensor that the per-expert weight `hf_name` joins (`...mlp.experts.3.up_proj.weight`
    → `...mlp.experts.up_proj.weight`: the converter's merged name), or None for any other tensor."""
    if experts is None:
        return None
    linears = "|".join(n for _, names in experts.tensors for n in names)
    match = re.fullmatch(rf"(.*\.{re.escape(experts.module)})\.\d+\.({linears})\.weight", hf_name)
    return None if match is None else f"{match[1]}.{match[2]}.weight"


def moe_keys(config: Any) -> list[tuple[str, Any, V]]:
    """The expert keys the family's converter writes: expert count, experts per token, and (qwen3moe) the width of an
    expert, which differs from the dense feed-forward length there."""
    experts = architecture_for(config.model_type).experts
    keys = [(gguf.Keys.LLM.EXPERT_COUNT, experts.count(config), V.UINT32),
            (gguf.Keys.LLM.EXPERT_USED_COUNT, config.num_experts_per_tok, V.UINT32)]
    if config.model_type == "qwen3_moe":
        keys.append((gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, experts.width(config), V.UINT32))
    return keys


def moe_refusal(config: Any) -> str | None:
    """What of an MoE config llama.cpp's graph of the family computes otherwise (module docstring), or None."""
    renormalised = getattr(config, "norm_topk_prob", True)  # Mixtral always renormalises
    if renormalised != RENORMALISED[config.model_type]:
        return (f"norm_topk_prob={renormalised} (llama.cpp {'always' if RENORMALISED[config.model_type] else 'never'}"
                f" renormalises the top-k routing weights of {config.model_type})")
    if config.model_type == "olmoe" and config.num_key_value_heads != config.num_attention_heads:
        return "grouped-query attention (llama.cpp's olmoe graph has as many key/value heads as query heads)"
    if getattr(config, "clip_qkv", None) is not None:
        return "q/k/v clipping (clip_qkv), which llama.cpp's olmoe graph does not apply"
    if config.model_type == "mixtral" and config.sliding_window is not None:
        return "a sliding window (llama.cpp's llama graph attends to the whole context)"
    return None
