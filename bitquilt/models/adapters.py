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

A mixture-of-experts family declares its `Experts`: transformers holds them as 3D tensors, which loading splits into
one module of linears per expert (`bitquilt.models.experts`). Its adapter names expert linears with an `{e}`
placeholder; `architecture_of` expands it for the model's expert count (`Architecture.expanded`): a shared input whose
producer is per expert becomes one per expert (down reads its own expert's product), one whose producer is shared
(the norm before the MoE) holds every expert's linears, and the full-precision modules that read the same input (the
router, `SharedInput.fp_readers`) take the scales folded into it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from torch import nn

EXPERT = "{e}"  # the expert index in the names of an MoE adapter's template (`Architecture.expanded`)


@dataclass(frozen=True)
class SharedInput:
    linears: tuple[str, ...]  # names relative to a decoder block
    prev: str  # module whose output is the group's input
    fp_readers: tuple[str, ...] = ()  # full-precision modules with a `weight` reading that input too (MoE router)

    def dense_reader(self) -> str:
        """The module that reads every token of the input: the router where the linears are experts (each sees only
        its tokens), else the first linear."""
        return (self.fp_readers or self.linears)[0]


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


@dataclass(frozen=True)
class Experts:
    """Where an MoE block keeps its experts: `module` holds 3D tensors [experts, rows, in] (`gate_up_proj`: gate rows
    then up rows; `down_proj`), split on load into `module.{e}.gate_proj`/`up_proj`/`down_proj`
    (`bitquilt.models.experts`); `router` (its `weight` [experts, hidden]) picks each token's experts."""

    count: Callable[[Any], int]  # experts per block, from the model config
    width: Callable[[Any], int]  # an expert's intermediate size, from the model config
    module: str = "mlp.experts"
    router: str = "mlp.gate"
    # the checkpoint's 3D tensor -> the per-expert linears it stacks, in row order
    tensors: tuple[tuple[str, tuple[str, ...]], ...] = (("gate_up_proj", ("gate_proj", "up_proj")),
                                                          ("down_proj", ("down_proj",)))

    # (ours, the checkpoint's): renames taking a name inside the MoE block to the family's per-expert checkpoint
    # layout (what its Hub checkpoints and transformers' save_pretrained write), applied in order
    renames: tuple[tuple[str, str], ...] = ()

    def rows(self, config: Any) -> dict[str, tuple[int, ...]]:
        """{3D tensor: the rows of each linear it stacks, per expert}."""
        width = self.width(config)
        return {"gate_up_proj": (width, width), "down_proj": (config.hidden_size,)}


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
    experts: Experts | None = None  # an MoE family's experts (names hold `{e}` until `expanded`)

    def linear_names(self) -> tuple[str, ...]:
        return tuple(n for g in self.shared_inputs for n in g.linears)

    def residual_readers(self) -> tuple[SharedInput, ...]:
        """Shared inputs that read the (normalised) residual stream: their producer is a norm, not a linear."""
        linears = set(self.linear_names())
        return tuple(g for g in self.shared_inputs if g.prev not in linears)

    def expanded(self, config: Any) -> Architecture:
        """This adapter for a model of `config`: expert names (`{e}`) spelled out for each of its experts (module
        docstring); the adapter itself for a dense family."""
        return self if self.experts is None else _expanded(self, self.experts.count(config))


def _at(names: tuple[str, ...], e: int) -> tuple[str, ...]:
    return tuple(n.replace(EXPERT, str(e)) for n in names)


def _each(names: tuple[str, ...], count: int) -> tuple[str, ...]:
    """The names of `names` without `{e}`, then those with it for experts 0..count−1, expert by expert."""
    per_expert = tuple(n for n in names if EXPERT in n)
    return tuple(n for n in names if EXPERT not in n) + tuple(n for e in range(count) for n in _at(per_expert, e))


@lru_cache(maxsize=32)
def _expanded(arch: Architecture, count: int) -> Architecture:
    groups: list[SharedInput] = []
    for g in arch.shared_inputs:
        if EXPERT in g.prev:  # each expert's own producer: one shared input per expert
            groups += [replace(g, linears=_at(g.linears, e), prev=_at((g.prev,), e)[0]) for e in range(count)]
        else:
            groups.append(replace(g, linears=_each(g.linears, count)))
    elementwise = tuple((_at((consumer,), e)[0], _at(producers, e)) for consumer, producers in arch.elementwise_inputs
                        for e in (range(count) if EXPERT in consumer else (0,)))
    return replace(arch, shared_inputs=tuple(groups), writers=_each(arch.writers, count),
                   elementwise_inputs=elementwise)


def _llama_inputs(mlp_norm: str, mlp: str = "mlp", expert: str = "", router: tuple[str, ...] = ()):
    """q/k/v, o, gate/up and down, llama's four shared inputs; `expert`: the gated MLP's linears are those of each
    expert of `mlp` (`mlp.{e}.gate_proj`, ...), whose full-precision `router` reads the norm too."""
    gate, up, down = (f"{mlp}{expert}.{n}" for n in ("gate_proj", "up_proj", "down_proj"))
    shared_inputs = (
        SharedInput(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
        SharedInput(("self_attn.o_proj",), "self_attn.v_proj"),
        SharedInput((gate, up), mlp_norm, fp_readers=router),
        SharedInput((down,), up),
    )
    return dict(shared_inputs=shared_inputs, writers=("self_attn.o_proj", down),
                elementwise_inputs=((down, (gate, up)),))


def _llama_like(name: str, model_types: tuple[str, ...], mlp_norm: str = "post_attention_layernorm", **kw):
    return Architecture(name=name, model_types=model_types, **_llama_inputs(mlp_norm), **kw)


def _moe(name: str, model_types: tuple[str, ...], experts: Experts) -> Architecture:
    """A llama-like block whose MLP is a routed mixture of gated experts (no shared expert)."""
    return Architecture(name=name, model_types=model_types, experts=experts,
                        **_llama_inputs("post_attention_layernorm", experts.module, f".{EXPERT}", (experts.router,)))


MIXTRAL_EXPERTS = Experts(count=lambda c: c.num_local_experts, width=lambda c: c.intermediate_size,
                          renames=((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."), (".up_proj.", ".w3."),
                                   (".down_proj.", ".w2.")))
OLMOE_EXPERTS = Experts(count=lambda c: c.num_experts, width=lambda c: c.intermediate_size)

ARCHITECTURES: tuple[Architecture, ...] = (
    _llama_like("llama", ("llama",)),
    _llama_like("mistral", ("mistral",)),
    _llama_like("qwen2", ("qwen2",)),
    _llama_like("qwen3", ("qwen3",)),
    *(_llama_like(name, (model_type,), mlp_norm="pre_feedforward_layernorm", norm_offset=1.0,
                  post_norms=("post_attention_layernorm", "post_feedforward_layernorm"))
      for name, model_type in (("gemma2", "gemma2"), ("gemma3", "gemma3_text"))),
    _llama_like("phi3", ("phi3",), fusions=PHI3_FUSIONS),
    _moe("mixtral", ("mixtral",), MIXTRAL_EXPERTS),
    _moe("qwen3_moe", ("qwen3_moe",), Experts(count=lambda c: c.num_experts, width=lambda c: c.moe_intermediate_size)),
    _moe("olmoe", ("olmoe",), OLMOE_EXPERTS),
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
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    arch = architecture_for(model_type)
    if arch is not None:
        return arch.expanded(config)
    raise UnsupportedArchitecture(
        f"unsupported architecture {model_type!r}; supported model types: {', '.join(supported_model_types())}"
    )


def decoder_layers(model: nn.Module, arch: Architecture) -> nn.ModuleList:
    return model.get_submodule(arch.layers)
