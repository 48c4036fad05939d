"""Llama-family causal LMs without transformers: the runtime's own module tree for a saved model.

Running a saved model needs none of transformers' modeling code: `LeanDecoder` (bitquilt.runtime.lean)
calls the embedding, norms, linears, rotary table and LM head itself. Importing a transformers model class
costs ≈ 1.7 s and ≈ 100 MB of resident memory (sympy, torch._dynamo and torch.distributed come with it), more
than a 4-bit small model; this module builds the same tree from `config.json` alone:

    ModuleTreeLM
      model.embed_tokens                 nn.Embedding [vocab, hidden]
      model.layers[i].input_layernorm    RMSNorm
      model.layers[i].self_attn          {q,k,v,o}_proj (+ q_norm, k_norm on qwen3 and gemma3)
      model.layers[i].post_attention_layernorm
      model.layers[i].mlp                {gate,up,down}_proj, SiLU-gated (GELU-tanh on gemma3)
      model.norm, model.rotary_emb
      lm_head                            (tied to embed_tokens when the config says so)

Gemma 2 and 3 (`gemma2`, `gemma3_text`) differ where transformers' Gemma modules do: their RMSNorms scale by (1 + w);
the embedding output is multiplied by √hidden; attention scores by query_pre_attn_scalar^-½; `post_attention_layernorm`
normalises the attention's output before the residual add, `pre_feedforward_layernorm` the MLP's input and
`post_feedforward_layernorm` its output; each layer is "sliding_attention" (a window of `sliding_window` positions;
on gemma3 with the RoPE θ of that layer type) or "full_attention" (`layer_types`), and the logits may be soft-capped
(c·tanh(z/c)); gemma2 soft-caps the attention scores too, gemma3 has q/k norms.

Mixtral, Qwen3-MoE and OLMoE (`MOE_FAMILIES`) replace the gated MLP by `mlp.gate` (a router, weight [experts, hidden]:
softmax over the experts, each token's num_experts_per_tok most probable, renormalised to sum 1 on Mixtral and where
norm_topk_prob says so) and `mlp.experts.{e}.{gate,up,down}_proj` (`bitquilt.models.experts.ExpertLinears`, as
loading splits transformers' 3D experts); Qwen3-MoE norms q and k per head, OLMoE over the whole projection and may
clip q, k and v (`clip_qkv`).

Module names are transformers' so a checkpoint's tensor names, saved layer names and online-module hosts apply
unchanged; phi3's are those of its split layout (`bitquilt.models.fused`: q/k/v and gate/up apart, as saved). Biases
follow each family: qwen2's q/k/v carry one, mistral's and phi3's nothing; llama and qwen3 follow `attention_bias`
(and llama `mlp_bias`). RoPE: inverse frequencies θ^(-2i/d), optionally divided by a linear factor or rescaled by
Llama 3's wavelength bands, over the first d = partial_rotary_factor·head_dim dimensions of each head (phi3; the rest
pass unrotated); `ModuleTreeConfig.unsupported_reason` names anything else (another family, activation or RoPE type),
for which the transformers model stays the runtime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from bitquilt.models.adapters import architecture_for
from bitquilt.models.experts import Expert, ExpertLinears
from bitquilt.runtime.lean import FAMILIES, GEMMA, MOE_FAMILIES, LeanDecoder, family_activation, soft_cap

ROPE_TYPES = ("default", "linear", "llama3", "longrope")
REQUIRED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ModuleTreeConfig:
    """The fields of a config.json the runtime reads (names as in transformers' configs)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    attention_bias: bool
    mlp_bias: bool
    rope: dict[str, Any] = field(default_factory=dict)
    sliding_window: int | None = None
    use_sliding_window: bool = False
    partial_rotary_factor: float = 1.0
    pad_token_id: int | None = None
    layer_types: tuple[str, ...] = ()  # gemma3: each layer's attention, "sliding_attention" or "full_attention"
    rope_by_type: dict[str, dict[str, Any]] = field(default_factory=dict)  # gemma3: RoPE parameters per layer type
    query_pre_attn_scalar: float | None = None  # gemma3: scores scale by its -1/2 power instead of head_dim's
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    num_experts: int = 0  # MoE: experts per layer, each token's top k, renormalised or not, an expert's width
    experts_per_token: int = 0
    norm_topk_prob: bool = False
    expert_size: int = 0
    clip_qkv: float | None = None  # olmoe

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModuleTreeConfig:
        """From a config.json's dict; ValueError naming the first required field it lacks."""
        missing = [k for k in REQUIRED if not isinstance(d.get(k), int if k != "model_type" else str)]
        if missing:
            raise ValueError(f"config.json has no valid {missing[0]!r}")
        heads = d["num_attention_heads"]
        parameters = d.get("rope_parameters") or d.get("rope_scaling") or {}
        layer_types = tuple(d.get("layer_types") or ()) if d["model_type"] in GEMMA else ()
        by_type = {t: _rope(parameters[t], d) for t in set(layer_types)} \
            if layer_types and all(isinstance(parameters.get(t), dict) for t in layer_types) else {}
        rope = by_type.get("full_attention") or next(iter(by_type.values()), None) or _rope(parameters, d)
        partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        pad = d.get("pad_token_id")
        return cls(model_type=d["model_type"], vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                   intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                   num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   max_position_embeddings=d.get("max_position_embeddings", 2048),
                   tie_word_embeddings=d.get("tie_word_embeddings", False),
                   hidden_act=d.get("hidden_activation") or d.get("hidden_act", "silu"),
                   attention_bias=d.get("attention_bias", False),
                   mlp_bias=d.get("mlp_bias", False), rope=rope, sliding_window=d.get("sliding_window"),
                   use_sliding_window=d.get("use_sliding_window", False),
                   partial_rotary_factor=partial,
                   pad_token_id=pad if isinstance(pad, int) and 0 <= pad < d["vocab_size"] else None,
                   layer_types=layer_types, rope_by_type=by_type,
                   query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
                   final_logit_softcapping=d.get("final_logit_softcapping"),
                   attn_logit_softcapping=d.get("attn_logit_softcapping"),
                   num_experts=d.get("num_local_experts") or d.get("num_experts") or 0,
                   experts_per_token=d.get("num_experts_per_tok") or 0,
                   norm_topk_prob=d["model_type"] == "mixtral" or bool(d.get("norm_topk_prob")),
                   expert_size=d.get("moe_intermediate_size") or d["intermediate_size"], clip_qkv=d.get("clip_qkv"))

    def unsupported_reason(self) -> str | None:
        """Why this module cannot build the model; None if it can."""
        if self.model_type not in FAMILIES:
            return f"model type {self.model_type!r} (the bitquilt runtime covers {', '.join(FAMILIES)})"
        if self.hidden_act != family_activation(self.model_type):
            return f"activation {self.hidden_act!r} (the bitquilt runtime runs {family_activation(self.model_type)} " \
                   f"on {self.model_type})"
        if self.model_type in GEMMA and (len(self.layer_types) != self.num_hidden_layers
                                         or set(self.layer_types) - {"sliding_attention", "full_attention"}):
            return "layer types other than one sliding_attention or full_attention per layer"
        if self.model_type == "gemma3_text" and set(self.layer_types) - set(self.rope_by_type):
            return "layer types without their RoPE parameters (gemma3 needs them per layer type)"
        if self.attn_logit_softcapping is not None and self.model_type != "gemma2":
            return "attention logit soft-capping"
        if self.model_type in MOE_FAMILIES and not 0 < self.experts_per_token <= self.num_experts:
            return f"{self.experts_per_token} experts per token of {self.num_experts}"
        for rope in self.rope_by_type.values() or [self.rope]:
            if rope["rope_type"] not in ROPE_TYPES:
                return f"RoPE type {rope['rope_type']!r} (the bitquilt runtime computes {', '.join(ROPE_TYPES)})"
        if self.partial_rotary_factor != 1.0 and self.model_type != "phi3":
            return f"a partial rotary factor of {self.partial_rotary_factor} (the bitquilt runtime rotates part of a "\
                   "head on phi3 only)"
        return None


def _rope(parameters: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
    """One RoPE parameter set as the runtime reads it: rope_type and rope_theta always, defaults from the config."""
    rope = dict(parameters)
    rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    rope.setdefault("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    return rope


def rotary_dim(config: ModuleTreeConfig) -> int:
    """How many leading dimensions of each head RoPE rotates (transformers' int(head_dim · partial_rotary_factor))."""
    return int(config.head_dim * config.partial_rotary_factor)


def inverse_frequencies(config: ModuleTreeConfig, layer_type: str | None = None) -> torch.Tensor:
    """RoPE's ω_i = θ^(-2i/d), i < d/2, with the config's scaling:

    - linear:  ω_i / factor;
    - llama3:  with λ_i = 2π/ω_i and the original context L, wavelengths longer than L/low_freq_factor get
      ω_i / factor, shorter than L/high_freq_factor keep ω_i, and those between interpolate
      (1 − s)·ω_i/factor + s·ω_i with s = (L/λ_i − low_freq_factor) / (high_freq_factor − low_freq_factor);
    - longrope: 1 / (f_i · θ^(2i/d)), f the short factors: what transformers uses while a sequence stays within the
      original context L (longer runs, where it switches to the long ones, are refused: `bitquilt.runtime.lean`).

    `layer_type` picks gemma3's parameters of that layer type.
    """
    rope, d = config.rope_by_type[layer_type] if layer_type else config.rope, rotary_dim(config)
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    if rope["rope_type"] == "longrope":
        return 1.0 / (torch.tensor(rope["short_factor"], dtype=torch.float32) * rope["rope_theta"] ** exponents)
    omega = 1.0 / (rope["rope_theta"] ** exponents)
    if rope["rope_type"] == "linear":
        return omega / rope["factor"]
    if rope["rope_type"] == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        context = rope["original_max_position_embeddings"]
        wavelength = 2 * math.pi / omega
        s = (context / wavelength - low) / (high - low)
        between = (1 - s) * omega / factor + s * omega
        return torch.where(wavelength > context / low, omega / factor,
                           torch.where(wavelength < context / high, omega, between))
    return omega


def attention_factor(config: ModuleTreeConfig) -> float:
    """The scale of cos and sin: LongRoPE's `attention_factor`, by default √(1 + ln s / ln L) for the extension
    s = max positions / L (its `factor` where given) over the original context L, 1 when s ≤ 1; 1 for other types."""
    rope = config.rope
    if rope["rope_type"] != "longrope":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = rope["original_max_position_embeddings"]
    s = rope.get("factor") or config.max_position_embeddings / original
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(original))


class RotaryEmbedding(nn.Module):
    """cos and sin of position·ω for every position asked, [B, T, rotary dim] (the halves repeated); gemma3's of the
    layer type asked (as transformers' Gemma3RotaryEmbedding is called)."""

    def __init__(self, config: ModuleTreeConfig):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)
        for layer_type in config.rope_by_type:
            self.register_buffer(f"{layer_type}_inv_freq", inverse_frequencies(config, layer_type), persistent=False)
        self.scale = attention_factor(config)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = getattr(self, f"{layer_type}_inv_freq") if layer_type else self.inv_freq
        angles = position_ids[:, :, None].float() * inv_freq[None, None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * self.scale).to(x.dtype), (angles.sin() * self.scale).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, heads, T, d] rotated by cos, sin [B, T, r]: x·cos + rotate_half(x)·sin over the first r dimensions
    of each head, the others unchanged (r < d: a partial rotary factor)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        turned = x[..., :r] * cos + rotate_half(x[..., :r]) * sin
        return turned if r == x.shape[-1] else torch.cat((turned, x[..., r:]), dim=-1)

    return rotate(q), rotate(k)


class Linear(nn.Linear):
    """nn.Linear whose weights come from a checkpoint: no random initialisation (on the meta device, torch's init
    ops would import torch._dynamo and sympy, ≈ 90 MB, for nothing)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding whose table comes from a checkpoint (as `Linear`); its rows times `embed_scale` where set (gemma3:
    √hidden, a non-persistent buffer multiplied in the table's dtype, as transformers' and `QuantEmbedding`'s)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.register_buffer("embed_scale", None, persistent=False)

    def reset_parameters(self) -> None:
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(ids)
        return rows if self.embed_scale is None else rows * self.embed_scale.to(rows.dtype)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + ε) · (offset + w) over the last dimension (w from the checkpoint; offset 1 on gemma3)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.variance_epsilon, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight + self.offset if self.offset else self.weight,
                          self.variance_epsilon)


def _norm(config: ModuleTreeConfig, size: int) -> RMSNorm:
    arch = architecture_for(config.model_type)
    return RMSNorm(size, config.rms_norm_eps, arch.norm_offset if arch is not None else 0.0)


def _attention_biases(config: ModuleTreeConfig) -> tuple[bool, bool]:
    """(q/k/v, o) bias of each family: qwen2 always has q/k/v biases and no o bias, mistral and phi3 none, llama and
    qwen3 follow attention_bias."""
    if config.model_type == "qwen2":
        return True, False
    if config.model_type in ("mistral", "phi3"):
        return False, False
    return config.attention_bias, config.attention_bias


class Attention(nn.Module):
    def __init__(self, config: ModuleTreeConfig, index: int):
        super().__init__()
        d, heads, kv_heads, hidden = config.head_dim, config.num_attention_heads, config.num_key_value_heads, \
            config.hidden_size
        qkv_bias, o_bias = _attention_biases(config)
        self.head_dim, self.scaling = d, (config.query_pre_attn_scalar or d) ** -0.5
        self.layer_type = config.layer_types[index] if config.layer_types else None
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.q_proj = Linear(hidden, heads * d, bias=qkv_bias)
        self.k_proj = Linear(hidden, kv_heads * d, bias=qkv_bias)
        self.v_proj = Linear(hidden, kv_heads * d, bias=qkv_bias)
        self.o_proj = Linear(heads * d, hidden, bias=o_bias)
        if config.model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
            self.q_norm, self.k_norm = _norm(config, d), _norm(config, d)
        elif config.model_type == "olmoe":  # over the whole projection
            self.q_norm, self.k_norm = _norm(config, heads * d), _norm(config, kv_heads * d)


class MLP(nn.Module):
    def __init__(self, config: ModuleTreeConfig):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        bias = config.mlp_bias and config.model_type == "llama"
        self.gate_proj = Linear(hidden, inner, bias=bias)
        self.up_proj = Linear(hidden, inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)


class Router(nn.Module):
    """An MoE layer's router: (logits, the top k's probabilities, their experts) of rows [N, hidden], as transformers'
    TopKRouter computes them (softmax in fp32, top k, renormalised to sum 1 where `norm_topk_prob`)."""

    def __init__(self, config: ModuleTreeConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.top_k, self.norm_topk_prob = config.experts_per_token, config.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        top, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), experts


class MixtureOfExperts(nn.Module):
    """`gate` (the router) and `experts` in place of the gated MLP: rows [B, T, hidden] in and out."""

    def __init__(self, config: ModuleTreeConfig):
        super().__init__()
        self.gate = Router(config)
        hidden, width = config.hidden_size, config.expert_size
        self.experts = ExpertLinears(Expert(Linear(hidden, width, bias=False), Linear(hidden, width, bias=False),
                                            Linear(width, hidden, bias=False), F.silu)
                                     for _ in range(config.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        _, weights, experts = self.gate(rows)
        return self.experts(rows, experts, weights).reshape(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModuleTreeConfig, index: int):
        super().__init__()
        self.self_attn = Attention(config, index)
        self.mlp = MixtureOfExperts(config) if config.model_type in MOE_FAMILIES else MLP(config)
        self.input_layernorm = _norm(config, config.hidden_size)
        self.post_attention_layernorm = _norm(config, config.hidden_size)
        if config.model_type in GEMMA:
            self.pre_feedforward_layernorm = _norm(config, config.hidden_size)
            self.post_feedforward_layernorm = _norm(config, config.hidden_size)


class Body(nn.Module):
    def __init__(self, config: ModuleTreeConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = _norm(config, config.hidden_size)


class ModuleTreeLM(nn.Module):
    """A Llama-family causal LM built from its config (module docstring). Runs through `LeanDecoder`;
    `forward` gives every position's logits of unpadded sequences, for scoring."""

    runs_attention_site = True  # LeanDecoder calls the attention site's online modules itself

    def __init__(self, config: ModuleTreeConfig):
        super().__init__()
        reason = config.unsupported_reason()
        if reason is not None:
            raise ValueError(f"the bitquilt runtime does not support this model: {reason}")
        self.config = config
        with torch.device("meta"):  # the weights come from the checkpoint
            self.model = Body(config)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.model.rotary_emb = RotaryEmbedding(config)
        if config.model_type in GEMMA:
            self.model.embed_tokens.embed_scale = torch.tensor(config.hidden_size ** 0.5)

    def tie_weights(self) -> None:
        """The LM head reads the embedding table (configs with tie_word_embeddings)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of every position of input_ids [B, T] (no padding, no cache)."""
        return self.head_logits(self.final_hidden(input_ids))

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of final hidden states: the LM head's output, soft-capped where the config says so."""
        return soft_cap(self.lm_head(hidden), self.config.final_logit_softcapping)

    @torch.no_grad()
    def final_hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The LM head's input [B, T, hidden] at every position of input_ids [B, T]: scoring a long window applies
        the head to a slice of positions at a time instead of holding [T, vocab] logits (`bitquilt.eval.ppl`)."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, tokens] with tokens > 0, got shape {tuple(input_ids.shape)}")
        decoder = LeanDecoder(self, input_ids.shape[1], fuse=False)
        rows = []
        for row in input_ids:
            decoder.reset()
            rows.append(decoder.final_hidden(row[None]))
        return torch.stack(rows)
