"""Declarative architecture adapters: where the decoder blocks are and how their linears connect.

One small description per family instead of copies of modeling files. The engine walks
`shared_inputs` in order ("true sequential"): the linears of one `SharedInput` read the same
input, which is the output of `prev` (a norm or a linear) — what scale-migrating transforms
such as AWQ and SmoothQuant fold their inverse scales into. ("Group" is kept for quantization
groups: columns sharing a scale.)

Rotations of the residual stream (QuaRot) also need to know who reads and writes it: shared
inputs whose `prev` is a norm read it (and the LM head, after the final norm); `writers` add to it,
through `post_norms` where the family normalises a branch's output first (Gemma 3).

A family whose checkpoints fuse projections (Phi-3's `qkv_proj`, `gate_up_proj`) declares each `Fusion`: the model
is split into the llama-like parts when it is loaded (`bitquilt.models.fused`), and every name here is a part's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class SharedInput:
    linears: tuple[str, ...]  # names relative to a decoder block
    prev: str  # module whose output is the group's input


@dataclass(frozen=True)
class Fusion:
    """One linear of a checkpoint that holds several of the adapter's linears, their rows stacked in order."""

    fused: str  # name relative to a decoder block, e.g. "self_attn.qkv_proj"
    parts: tuple[str, ...]  # the adapter's linears it holds, in row order (same parent module)
    rows: Callable[[Any], tuple[int, ...]]  # each part's row count, from the model config


def _qkv_rows(config: Any) -> tuple[int, ...]:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    return heads * head_dim, kv, kv


def _gate_up_rows(config: Any) -> tuple[int, ...]:
    return config.intermediate_size, config.intermediate_size


PHI3_FUSIONS = (Fusion("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), _qkv_rows),
                Fusion("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), _gate_up_rows))


@dataclass(frozen=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]
    shared_inputs: tuple[SharedInput, ...]
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (offset + weight)
    attention: str = "self_attn"  # the module whose keys/values enter the cache
    values: tuple[str, str] = ("self_attn.v_proj", "self_attn.o_proj")  # value producer, its consumer (per head)
    writers: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")  # linears whose output joins the residual
    post_norms: tuple[str, ...] = ()  # norm applied to each writer's output before the residual add, if any
    # (consumer, producers): the consumer's input is an elementwise function of the producers' outputs (the
    # gated MLP), so a permutation of its input columns folds into the producers' output rows
    elementwise_inputs: tuple[tuple[str, tuple[str, ...]], ...] = (("mlp.down_proj", ("mlp.gate_proj", "mlp.up_proj")),)
    fusions: tuple[Fusion, ...] = ()  # linears the checkpoint stores fused (split on load: `bitquilt.models.fused`)

    def linear_names(self) -> tuple[str, ...]:
        return tuple(n for g in self.shared_inputs for n in g.linears)

    def residual_readers(self) -> tuple[SharedInput, ...]:
        """Shared inputs that read the (normalised) residual stream: their producer is a norm, not a linear."""
        linears = set(self.linear_names())
        return tuple(g for g in self.shared_inputs if g.prev not in linears)


def _llama_like(name: str, model_types: tuple[str, ...], mlp_norm: str = "post_attention_layernorm", **kw):
    return Architecture(
        name=name,
        model_types=model_types,
        shared_inputs=(
            SharedInput(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
            SharedInput(("self_attn.o_proj",), "self_attn.v_proj"),
            SharedInput(("mlp.gate_proj", "mlp.up_proj"), mlp_norm),
            SharedInput(("mlp.down_proj",), "mlp.up_proj"),
        ),
        **kw,
    )


ARCHITECTURES: tuple[Architecture, ...] = (
    _llama_like("llama", ("llama",)),
    _llama_like("mistral", ("mistral",)),
    _llama_like("qwen2", ("qwen2",)),
    _llama_like("qwen3", ("qwen3",)),
    _llama_like("gemma3", ("gemma3_text",), mlp_norm="pre_feedforward_layernorm", norm_offset=1.0,
                post_norms=("post_attention_layernorm", "post_feedforward_layernorm")),
    _llama_like("phi3", ("phi3",), fusions=PHI3_FUSIONS),
)


class UnsupportedArchitecture(ValueError):
    pass


def supported_model_types() -> list[str]:
    return sorted(t for a in ARCHITECTURES for t in a.model_types)


def architecture_for(model_type: str) -> Architecture | None:
    """The adapter for a config's `model_type`, None if there is none."""
    return next((arch for arch in ARCHITECTURES if model_type in arch.model_types), None)


def architecture_of(model: nn.Module) -> Architecture:
    """The adapter for a transformers causal LM, or an error naming what is supported."""
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    arch = architecture_for(model_type)
    if arch is not None:
        return arch
    raise UnsupportedArchitecture(
        f"unsupported architecture {model_type!r}; supported model types: {', '.join(supported_model_types())}"
    )


def decoder_layers(model: nn.Module, arch: Architecture) -> nn.ModuleList:
    return model.get_submodule(arch.layers)
