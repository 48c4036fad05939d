"""Batch-1 generation without the transformers module stack: the same modules, fewer ops per step.

A transformers decode step of a small model spends about half its time outside the matmuls:
per-layer rotary tables, a cache that grows by `torch.cat`, mask construction, keyword plumbing,
output dataclasses. `LeanDecoder` runs the model's own modules for one sequence:

- embeddings, norms, every linear (quantized or not, with its online modules: rotations,
  activation quantizers, slice routers) and the LM head are called as they are;
- a static KV cache: per layer, key and value buffers [1, kv_heads, max_len, head_dim] written
  in place at each position;
- rotary cos/sin computed once for every position by the model's rotary module and applied by
  the family's own `apply_rotary_pos_emb`;
- attention by `scaled_dot_product_attention` with grouped-query heads (`enable_gqa`), causal
  for the prompt, over the cache's filled prefix for a new token; the attention site's online
  modules (KV quantizers, q/k rotations) see q, k, v there as they do in transformers (after
  RoPE, keys and values the whole filled cache);
- an RMSNorm without hooks runs as one fused `rms_norm` call;
- with `fuse=True`, a one-token step runs every decoder layer in one compiled call (`bitquilt.runtime.fused`, which
  `bitquilt.runtime.batch` steps several sequences through at once) when every layer qualifies (an MoE block's
  router and experts too): plain RMSNorms, no attention-site modules, no hooks, fp32, and linears that are
  `nn.Linear` or `QuantLinear` without online modules (a slice router excepted) whose weight a CPU kernel takes
  (bitplane, uniform at any width, the slices of a MoBiQuant checkpoint, static or routed per token); `fused_reason`
  says why not otherwise, and those steps run module by module.

`LeanLayers` is all of it but the cache: it runs the rows of several sequences, each appended to its own `KVCache`
at its own position, every linear called once with all rows and attention per sequence (a chunk after earlier
tokens under a causal mask); `LeanDecoder` is it over one cache, `bitquilt.runtime.batch` over a running batch.

Families: llama, mistral (without a sliding window shorter than the run), qwen2 (without sliding window), qwen3 (q/k
norms), gemma2 and gemma3 ((1 + w) norms, post-norms, GELU-tanh, sliding-window layers, soft-capped logits; gemma2's
soft-capped attention scores, gemma3's q/k norms and RoPE tables per layer type; `bitquilt.runtime.module_tree`), phi3
split (`bitquilt.models.fused`; a partial rotary factor runs module by module, not fused; LongRoPE within its original
context); the mixture-of-experts families mixtral, qwen3_moe and olmoe (q/k norms over the whole projection, optional
q/k/v clipping): a layer whose MLP is an MoE block calls the block itself on the normed rows (its router picks each
row's experts; `bitquilt.models.experts.ExpertLinears` runs each expert's linears, quantized or not, on its rows), and
the fused step runs the same routing in C++ (`bitquilt.runtime.fused`, except with q/k/v clipping);
`unsupported_reason` says why another model stays on transformers.
Tested against the transformers forward (logits and greedy tokens).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from bitquilt import kernels
from bitquilt.formats.base import WeightFormat
from bitquilt.formats.composite import CompositeFormat
from bitquilt.models.adapters import architecture_for
from bitquilt.models.experts import ExpertLinears
from bitquilt.nn.online import run_site, slots_at
from bitquilt.nn.quant_linear import QuantLinear

if TYPE_CHECKING:  # importing the kernels builds the extension: done on first use instead
    from bitquilt.runtime.fused import FusedLayers

MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")  # a router and experts in place of the gated MLP
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", *MOE_FAMILIES)
GEMMA = ("gemma2", "gemma3_text")  # Gemma's layer: post-norms, GELU-tanh, scaled embeddings, sliding windows
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# tables that change once a sequence passes the original context: computed once for a run, so runs within it only
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def family_activation(model_type: str) -> str:
    """The gated MLP's activation of a family: GELU (tanh approximation) on Gemma, SiLU elsewhere."""
    return "gelu_pytorch_tanh" if model_type in GEMMA else "silu"


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """c·tanh(z/c), or z when the cap c is None (gemma's `final_logit_softcapping`)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _activation(config: object) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def unsupported_reason(model: nn.Module, max_len: int) -> str | None:
    """Why `LeanDecoder` cannot run `model` for `max_len` positions; None if it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return f"model type {model_type!r} (lean decoding covers {', '.join(FAMILIES)})"
    if _activation(config) != family_activation(model_type):
        return f"activation {_activation(config)!r} (lean decoding runs {family_activation(model_type)} on " \
               f"{model_type})"
    window = getattr(config, "sliding_window", None)
    if window is not None and model_type not in GEMMA \
            and (model_type != "qwen2" or getattr(config, "use_sliding_window", False)) and window < max_len:
        return f"a sliding window of {window} positions shorter than the run ({max_len})"
    if getattr(config, "attn_logit_softcapping", None) is not None and model_type != "gemma2":
        return "attention logit soft-capping"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if not hasattr(getattr(model, "model", None), "rotary_emb"):
        return "no shared rotary embedding module"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope", None) or {}
    original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                        None) or config.max_position_embeddings
    if rope.get("rope_type") in LENGTH_DEPENDENT_ROPE and max_len > original:
        return (f"RoPE type {rope['rope_type']!r} past its original context ({max_len} positions > {original}), "
                "where its tables change with the sequence length")
    if max_len > config.max_position_embeddings:
        return f"{max_len} positions exceed the model's {config.max_position_embeddings}"
    return None


def _rms_eps(norm: nn.Module) -> float | None:
    """The epsilon of a plain RMSNorm (no hooks, no online modules); None for anything else."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    plain = type(norm).__name__.endswith("RMSNorm") and eps is not None and not norm._forward_hooks \
        and not norm._forward_pre_hooks and not norm._modules
    return eps if plain else None


def _norm_scale(norm: nn.Module, offset: float) -> torch.Tensor:
    """The vector a norm multiplies by: its weight, plus the family's offset (Gemma's 1 + w)."""
    return (norm.weight + offset).detach() if offset else norm.weight.detach()


def _norm_fn(norm: nn.Module, offset: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """The norm as one fused call when it is a plain RMSNorm (no hooks, no online modules), else the module."""
    eps = _rms_eps(norm)
    if eps is None:
        return norm
    scale = _norm_scale(norm, offset)
    return lambda x: F.rms_norm(x, scale.shape, scale, eps)


@dataclass(frozen=True)
class LinearSpec:
    """What a fused layer needs of a linear: packed parts or a dense fp32 weight, its bias, and its slice router."""

    fmts: list[WeightFormat] | None
    dense: torch.Tensor | None
    bias: torch.Tensor | None
    router: nn.Module | None = None


def _linear_spec(name: str, linear: nn.Module) -> LinearSpec | str:
    """The linear as a fused layer runs it, or why it cannot."""
    if linear._forward_hooks or linear._forward_pre_hooks:
        return f"{name} has hooks"
    bias = linear._parameters.get("bias")
    bias = None if bias is None else bias.detach()
    if isinstance(linear, QuantLinear):
        online = set(linear._modules) - {"router"}
        if online:
            return f"{name} has online modules ({', '.join(sorted(online))})"
        fmt = linear.fmt
        if not isinstance(fmt, CompositeFormat):
            return LinearSpec([fmt], None, bias)
        if fmt.perm is not None:
            return f"{name} permutes its input columns"
        router = linear._modules.get("router") if linear.slices is None else None  # a static count overrides it
        return LinearSpec(list(fmt.parts.values())[: linear.slices], None, bias, router)
    if type(linear) is nn.Linear and linear.weight.dtype == torch.float32:
        return LinearSpec(None, linear.weight.detach().contiguous(), bias)
    return f"{name} is a {type(linear).__name__}"


def fuse_layers(stack: LeanLayers) -> tuple[FusedLayers | None, str | None]:
    """The stack's layers in one compiled step (`bitquilt.runtime.fused.FusedLayers`) for caches of up to its
    `max_len` positions (`fused_cache`), or None and why not."""
    from bitquilt.runtime.fused import FusedLayers

    if stack.dtype != torch.float32:
        return None, f"dtype {stack.dtype} (fused layers run fp32)"
    if any(stack.has_site):
        return None, "modules at the attention site (KV quantizers or rotations)"
    if stack.cos.shape[-1] != stack.head_dim:
        return None, "a partial rotary embedding (fused layers rotate whole heads)"
    config, first = stack.model.config, stack.layers[0]
    if stack.clip is not None:
        return None, "q/k/v clipping (clip_qkv)"
    norms = {_rms_eps(m) for layer in stack.layers for m in layer.modules() if type(m).__name__.endswith("Norm")}
    if None in norms or len(norms) != 1:
        return None, "norms that are not plain RMSNorms with one epsilon"
    eps, gemma = norms.pop(), config.model_type in GEMMA
    if any(not isinstance(getattr(layer.mlp, "experts", None), ExpertLinears | None) for layer in stack.layers):
        return None, "experts not split into linears"
    try:
        fused = FusedLayers(config.hidden_size, stack.heads, stack.kv_heads, stack.head_dim,
                            _gated_mlp(first).gate_proj.out_features,
                            eps, first.self_attn.scaling, stack.cos[0], stack.sin[0],
                            gelu=stack.activation is not F.silu, score_cap=stack.score_cap)
    except RuntimeError as e:
        return None, str(e)

    def scale(norm: nn.Module | None) -> torch.Tensor | None:
        return None if norm is None else _norm_scale(norm, stack.offset)

    def add(name: str, linear: nn.Module) -> int | str:
        """The fused layers' index of `linear`, or why it cannot join."""
        spec = _linear_spec(name, linear)
        if isinstance(spec, str):
            return spec
        index = fused.add_linear(spec.fmts, spec.dense, spec.bias, linear.out_features, linear.in_features)
        if index is None:
            return f"{name}: a weight no CPU kernel takes whole"
        if spec.router is not None:
            r = spec.router
            fused.route(index, r.fc1.weight, r.fc1.bias, r.fc2.weight, r.fc2.bias, r.threshold,
                        [f.bits for f in spec.fmts])
        return index

    for i, layer in enumerate(stack.layers):
        if any(m._forward_hooks or m._forward_pre_hooks for m in (layer, layer.self_attn, layer.mlp)):
            return None, f"layer {i} has hooks"
        attn, mlp = layer.self_attn, _gated_mlp(layer)
        indices = [add(f"layer {i} {name}", linear) for name, linear in (
            ("q_proj", attn.q_proj), ("k_proj", attn.k_proj), ("v_proj", attn.v_proj), ("o_proj", attn.o_proj),
            ("gate_proj", mlp.gate_proj), ("up_proj", mlp.up_proj), ("down_proj", mlp.down_proj))]
        if why := next((x for x in indices if isinstance(x, str)), None):
            return None, why
        mlp_norm = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
        branch_norms = (scale(layer.post_attention_layernorm), scale(layer.post_feedforward_layernorm)) if gemma \
            else None
        cos, sin = stack.rope[i]
        fused.add_layer(scale(layer.input_layernorm), scale(mlp_norm), scale(getattr(attn, "q_norm", None)),
                        scale(getattr(attn, "k_norm", None)), indices, branch_norms, stack.windows[i],
                        (cos[0], sin[0]) if gemma else None)
        if hasattr(layer.mlp, "experts") and (why := _fuse_experts(fused, add, i, layer.mlp)):
            return None, why
    _fuse_head(stack, fused, eps)
    return fused, None


def _gated_mlp(layer: nn.Module) -> nn.Module:
    """The layer's gated MLP (gate_proj, up_proj, down_proj): its own, or an MoE block's first expert (whose shapes
    every expert shares: the layer's MLP slot in the fused layers)."""
    experts = getattr(layer.mlp, "experts", None)
    return layer.mlp if experts is None else experts[0]


def _fuse_experts(fused: FusedLayers, add: Callable[[str, nn.Module], int | str], i: int,
                  block: nn.Module) -> str | None:
    """Layer i's MoE `block` (router `gate`, `ExpertLinears` `experts`) into `fused`'s last layer; why not, or None."""
    parts = {part: [add(f"layer {i} expert {e} {part}", getattr(expert, part))
                    for e, expert in enumerate(block.experts)] for part in ("gate_proj", "up_proj", "down_proj")}
    if why := next((x for linears in parts.values() for x in linears if isinstance(x, str)), None):
        return why
    router = block.gate.weight.detach().contiguous()  # [experts, hidden], full precision: a dense linear
    fused.set_experts(fused.add_linear(None, router, None, *router.shape), parts["gate_proj"], parts["up_proj"],
                      parts["down_proj"], block.gate.top_k,
                      getattr(block.gate, "norm_topk_prob", True))  # Mixtral's router always renormalises
    return None


def _fuse_head(stack: LeanLayers, fused: FusedLayers, eps: float) -> None:
    """The final norm and LM head into `fused` (`fused_logits`) where they run there as they are: a plain RMSNorm of
    the layers' epsilon and a head a kernel takes whole (else the stack's own head gives the logits)."""
    head, norm = stack.model.lm_head, stack.model.model.norm
    spec = _linear_spec("lm_head", head)
    if isinstance(spec, str) or spec.router is not None or _rms_eps(norm) != eps:
        return
    index = fused.add_linear(spec.fmts, spec.dense, spec.bias, head.out_features, head.in_features)
    if index is not None:
        fused.set_head(index, _norm_scale(norm, stack.offset))


def fused_logits(stack: LeanLayers, fused: FusedLayers, x: torch.Tensor) -> torch.Tensor:
    """The logits [B, vocab] of the fused step's hidden states x [B, D]: its own head where it has one (each row as
    alone, however many), else the stack's."""
    return stack.logits(x) if fused.head is None else soft_cap(fused.logits(x), stack.softcap)


def fused_cache(fused: FusedLayers, cache: KVCache) -> object:
    """`cache` as `fused.step` takes it (a handle on its buffers, written in place)."""
    return fused.cache([k[0] for k in cache.keys], [v[0] for v in cache.values])


@dataclass
class KVCache:
    """One sequence's static KV cache: per layer, key and value buffers [1, kv_heads, length, head_dim] written in
    place, filled up to `pos`."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    pos: int = 0

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


class LeanLayers:
    """A Llama-like causal LM's modules, rotary tables for `max_len` positions and norms, run over the KV caches of
    one or several sequences (module docstring): what `LeanDecoder` runs for one sequence and
    `bitquilt.runtime.batch` for a batch."""

    def __init__(self, model: nn.Module, max_len: int):
        reason = unsupported_reason(model, max_len)
        if reason is not None:
            raise ValueError(f"lean decoding does not support this model: {reason}")
        self.model, self.max_len = model, max_len
        config, body = model.config, model.model
        self.layers = list(body.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.activation = ACTIVATIONS[_activation(config)]
        param = next(model.parameters(), None)
        self.dtype = torch.float32 if param is None or not param.is_floating_point() else param.dtype
        positions = torch.arange(max_len).unsqueeze(0)
        probe = torch.zeros(1, 1, self.head_dim, dtype=self.dtype)
        # per layer: the rotary tables [1, max_len, head_dim] of its type (gemma3 has two) and its window (or None)
        gemma = config.model_type in GEMMA
        types = [layer.self_attn.layer_type if config.model_type == "gemma3_text" else None for layer in self.layers]
        tables = {t: body.rotary_emb(probe, positions, *[t] if t else []) for t in set(types)}
        self.rope = [tables[t] for t in types]
        self.cos, self.sin = self.rope[0]
        self.windows = [layer.self_attn.sliding_window if gemma else None for layer in self.layers]
        self.offset = getattr(architecture_for(config.model_type), "norm_offset", 0.0)
        post = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
        self.input_norms = [_norm_fn(layer.input_layernorm, self.offset) for layer in self.layers]
        self.mlp_norms = [_norm_fn(getattr(layer, post), self.offset) for layer in self.layers]
        # Gemma: each branch's output normalised before the residual add
        self.branch_norms = [(_norm_fn(layer.post_attention_layernorm, self.offset),
                              _norm_fn(layer.post_feedforward_layernorm, self.offset))
                             if gemma else None for layer in self.layers]
        self.final_norm = _norm_fn(body.norm, self.offset)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.score_cap = getattr(config, "attn_logit_softcapping", None)  # gemma2
        attention_slots = set(slots_at("attention"))
        self.has_site = [bool(layer.self_attn._modules.keys() & attention_slots) for layer in self.layers]
        # olmoe: q/k norms over the whole projection (before the split into heads) and optional clipping of q, k, v
        self.whole_qk_norm = config.model_type == "olmoe"
        self.clip = getattr(config, "clip_qkv", None)

    def new_cache(self, length: int) -> KVCache:
        """An empty cache for a sequence of up to `length` (≤ max_len) positions."""
        if not 0 < length <= self.max_len:
            raise ValueError(f"a cache of {length} positions; this stack takes 1 to {self.max_len}")
        shape = (1, self.kv_heads, length, self.head_dim)
        return KVCache([torch.zeros(shape, dtype=self.dtype) for _ in self.layers],
                       [torch.zeros(shape, dtype=self.dtype) for _ in self.layers])

    def run(self, ids: torch.Tensor, caches: list[KVCache], counts: list[int]) -> torch.Tensor:
        """The residual stream [1, R, hidden] after every decoder layer of `ids` [1, R]: the rows of each sequence
        in turn, `counts[s]` of them appended to `caches[s]` at its position. Every linear is called once with all
        R rows; attention runs per sequence over its own cache. Advances the caches."""
        if not counts or len({id(c) for c in caches}) != len(caches) or sum(counts) != ids.shape[1] or min(counts) < 1:
            raise ValueError("each sequence once, with at least one of the input's rows")
        for cache, t in zip(caches, counts, strict=True):
            if cache.pos + t > cache.length:
                raise ValueError(f"position {cache.pos + t} is past the cache's {cache.length} positions")
        x = self.model.model.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            attended = self._attention(i, layer, self.input_norms[i](x), caches, counts)
            post = self.branch_norms[i]
            x = x + (attended if post is None else post[0](attended))
            mlp = layer.mlp
            h = self.mlp_norms[i](x)
            if hasattr(mlp, "gate_proj"):
                out = mlp.down_proj(self.activation(mlp.gate_proj(h)) * mlp.up_proj(h))
            else:  # an MoE block: [1, R, hidden] in and out, routed per row
                out = mlp(h)
            x = x + (out if post is None else post[1](out))
        for cache, t in zip(caches, counts):
            cache.pos += t
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits [..., vocab] of residual-stream rows x [..., hidden] (soft-capped where the config says)."""
        return soft_cap(self.model.lm_head(self.final_norm(x)), self.softcap)

    def _attention(self, index: int, layer: nn.Module, h: torch.Tensor, caches: list[KVCache],
                   counts: list[int]) -> torch.Tensor:
        attn, r = layer.self_attn, h.shape[1]
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        if self.whole_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.view(1, r, self.heads, self.head_dim)
        k = k.view(1, r, self.kv_heads, self.head_dim)
        v = v.view(1, r, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm") and not self.whole_qk_norm:  # qwen3, gemma3: per-head norms before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        (cos, sin), window = self.rope[index], self.windows[index]
        outs, row = [], 0
        for cache, t in zip(caches, counts):
            start, end = cache.pos, cache.pos + t
            rows = slice(row, row + t)
            q_s, k_s = self.apply_rope(q[:, rows].transpose(1, 2), k[:, rows].transpose(1, 2),
                                       cos[:, start:end], sin[:, start:end])
            cache.keys[index][:, :, start:end] = k_s
            cache.values[index][:, :, start:end] = v[:, rows].transpose(1, 2)
            # a sliding window: no row sees keys `window` or more positions before it
            first = 0 if window is None else max(0, start + 1 - window)
            keys, values = cache.keys[index][:, :, first:end], cache.values[index][:, :, first:end]
            if self.has_site[index]:
                q_s, keys, values = run_site(attn, "attention", q_s, keys, values)
            mask = _chunk_mask(t, start, first, end, window)
            if self.score_cap is None:
                out = F.scaled_dot_product_attention(q_s, keys, values, attn_mask=mask,
                                                     is_causal=mask is None and t > 1,
                                                     scale=attn.scaling, enable_gqa=self.heads != self.kv_heads)
            else:
                out = _capped_attention(q_s, keys, values, mask if mask is not None or t == 1
                                        else torch.ones(t, t, dtype=torch.bool).tril(), attn.scaling, self.score_cap)
            outs.append(out.transpose(1, 2).reshape(1, t, -1))
            row += t
        return attn.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs, 1))


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                      cap: float) -> torch.Tensor:
    """softmax(c·tanh(scale·q kᵀ / c), over the keys `mask` [T, keys] allows) v, as Gemma 2's eager attention: q
    [1, heads, T, d], k and v [1, kv_heads, keys, d] (each shared by heads / kv_heads query heads)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = soft_cap(torch.matmul(q, k.transpose(2, 3)) * scale, cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _chunk_mask(t: int, start: int, first: int, end: int, window: int | None) -> torch.Tensor | None:
    """Which of the keys at positions first..end-1 each of t rows at positions start..end-1 sees [t, end - first]:
    those up to its own position and, with a window, after its position minus the window; None where a plain causal
    mask (t > 1 from position 0, no key beyond the window) or no mask (one row) says the same."""
    if t == 1 or (start == 0 and (window is None or window >= t)):
        return None
    rows = torch.arange(start, end)[:, None]
    keys = torch.arange(first, end)[None, :]
    seen = keys <= rows
    return seen if window is None else seen & (keys > rows - window)


class LeanDecoder(LeanLayers):
    """Prompt and one-token steps of a Llama-like causal LM with a static KV cache (module docstring)."""

    def __init__(self, model: nn.Module, max_len: int, fuse: bool = True):
        super().__init__(model, max_len)
        self.cache = self.new_cache(max_len)
        self.fused, self.fused_reason = fuse_layers(self) if fuse else (None, "not requested")
        self._fused_cache = None if self.fused is None else fused_cache(self.fused, self.cache)

    @property
    def pos(self) -> int:
        return self.cache.pos

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [vocab] of the last of `ids` [1, T], appended at the cache's current position (`final_hidden`:
        every position's head input).

        T > 1 (a prompt) only on an empty cache; then one token at a time."""
        t, start = self._check(ids)
        if t == 1 and self.fused is not None and kernels.options().enabled:
            self.cache.pos = start + 1
            x = self.fused.step(self.model.model.embed_tokens(ids)[0], [start], [self._fused_cache])
            return fused_logits(self, self.fused, x)[0]
        return self.logits(self.run(ids, [self.cache], [t])[:, -1:])[0, -1]

    @torch.no_grad()
    def final_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The LM head's input [T, hidden] (the final norm's output) at every position of `ids` [1, T], appended at
        the cache's current position: what scoring multiplies by the head a slice of positions at a time."""
        t, _ = self._check(ids)
        return self.final_norm(self.run(ids, [self.cache], [t]))[0]

    def _check(self, ids: torch.Tensor) -> tuple[int, int]:
        """(T, start) of an input the cache can take, else ValueError."""
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise ValueError(f"lean decoding takes one sequence [1, T], got shape {tuple(ids.shape)}")
        t, start = ids.shape[1], self.pos
        if t > 1 and start:
            raise ValueError("a multi-token input must start on an empty cache (call reset())")
        if start + t > self.max_len:
            raise ValueError(f"position {start + t} is past the cache's {self.max_len} positions")
        return t, start

    def reset(self) -> None:
        """Forget the sequence (the buffers are overwritten as positions fill again)."""
        self.cache.pos = 0
