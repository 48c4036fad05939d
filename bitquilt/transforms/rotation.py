"""Norm fusion and QuaRot (Ashkboos et al., 2024): rotate the residual stream by a random Hadamard.

Rows are tokens: a linear computes y = x Wᵀ + b. With Q = diag(s) M_d orthogonal (s random ±1,
M_d the Hadamard of `hadamard.py`) the residual stream x becomes x Q, and the model computes the
same function if

  norm fusion   RMSNorm(x)·(o + g) feeds W  →  W diag(o + g), g ← 1 − o  (o: Gemma's offset);
                RMSNorm commutes with Q since ‖x Q‖ = ‖x‖
  embedding     E ← E Q
  readers       W ← W Q          (q/k/v, gate/up, LM head: their input is x Q)
  tied head     an LM head tied to the embedding stays tied, reading E Q: the final norm's scale is not
                folded into it (that would be a second table, E diag(g) Q) but applied online on the
                norm's output, x ↦ x Qᵀ diag(g) Q (`RotatedScale`)
  writers       W ← Qᵀ W, b ← b Q (o_proj, down_proj: their output joins x Q);
                where a norm sits between a writer and the residual add (Gemma 3's post-norms)
                the writer is left alone and Q is applied online to the norm's output.

Then, for activation and KV quantization (function-preserving as well):

  values        per head, W_v,h ← Hᵀ W_v,h and W_o[:, h] ← W_o[:, h] H  (H = M_head_dim)
  online        the writers' inputs x ↦ x M and W ← W M (a Hadamard over all of o_proj's input,
                i.e. across heads too, and over down_proj's FFN width): `HadamardRotation` in
                their `input_rotation` slot, before the activation quantizer
  queries/keys  q, k ↦ q H, k H per head after RoPE (QKᵀ unchanged): `QKRotation` in the
                attention's `qk_rotation` slot, before the KV quantizer.

Each decoder block's part touches that block alone (`rotate_block`), so the stage runs on the embedding and the
final norm at once, on each block through `ModelContext.each_block` and on the LM head through `at_end`: the same
operations, in the same order on every tensor, whether the model is in memory or streamed block by block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from bitquilt.calib.stages import ModelContext, register_stage
from bitquilt.models.adapters import Architecture, SharedInput, decoder_layers
from bitquilt.nn.hadamard import hadamard_transform, random_signs
from bitquilt.nn.online import attach, enable_attention_site
from bitquilt.nn.rotation import HadamardRotation, QKRotation, RotatedScale
from bitquilt.registry import option


@dataclass(frozen=True)
class QuaRotOptions:
    seed: int = option(0, "seed of the residual rotation's random signs")
    online_hadamard: bool = option(True, "Hadamard on the writers' inputs (for activation quantization)")
    head_hadamard: bool = option(True, "head-wise Hadamard on values, online on queries/keys (for KV quantization)")


def _rowwise_float64(w: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], rows: int = 8192) -> torch.Tensor:
    """fn (acting on each row of its input independently) applied to w in float64, a chunk of rows at
    a time, returned in w's dtype: a float64 copy of a whole 150k-row embedding or LM head, plus the
    transform's temporaries, would more than double the model's peak memory."""
    flat = w.reshape(-1, w.shape[-1])
    out = torch.empty(flat.shape, dtype=w.dtype, device=w.device)
    for i in range(0, flat.shape[0], rows):
        out[i:i + rows] = fn(flat[i:i + rows].double())
    return out.reshape(w.shape)


def _times(w: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """w (diag(s) M) on the last dimension, computed in float64."""
    return _rowwise_float64(w, lambda rows: hadamard_transform(rows, signs))


@torch.no_grad()
def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    param.copy_(value.reshape(param.shape))


def _linear(root: nn.Module, name: str) -> nn.Linear:
    lin = root.get_submodule(name)
    if type(lin) is not nn.Linear:
        raise ValueError(f"{name} is a {type(lin).__name__}; rotations must run on the full-precision model")
    return lin


def _readers(block: nn.Module, shared: SharedInput) -> list[nn.Module]:
    """The linears of `shared` and its full-precision readers (an MoE router: its `weight` [experts, hidden])."""
    return [_linear(block, n) for n in shared.linears] + [block.get_submodule(n) for n in shared.fp_readers]


def is_tied(model: nn.Module, arch: Architecture) -> bool:
    """Whether the LM head shares the embedding's weight (a head not read yet, streaming: as the config says)."""
    head, embed = model.get_submodule(arch.lm_head), model.get_submodule(arch.embed)
    if head.weight.is_meta:
        return bool(getattr(model.config, "tie_word_embeddings", False))
    return head.weight.data_ptr() == embed.weight.data_ptr()


def untie_lm_head(model: nn.Module, arch: Architecture) -> bool:
    """Give the LM head its own weight if it shares the embedding's; True if it did. A head not read yet (streaming:
    still on the meta device) is marked untied in the config, and the checkpoint reads it as a copy of the
    embedding (`bitquilt.models.streaming.StreamingCheckpoint.finish`)."""
    if not is_tied(model, arch):
        return False
    head = model.get_submodule(arch.lm_head)
    if not head.weight.is_meta:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    model.config.tie_word_embeddings = False
    return True


@torch.no_grad()
def take_norm_scale(norm: nn.Module, offset: float) -> torch.Tensor:
    """The norm's scale o + g in float64; the norm keeps only x/rms(x) (g ← 1 − o)."""
    if getattr(norm, "bias", None) is not None:
        raise ValueError(f"cannot fuse a norm with a bias ({type(norm).__name__})")
    scale = offset + norm.weight.double()
    norm.weight.fill_(1 - offset)
    return scale


def scale_columns(lin: nn.Linear, scale: torch.Tensor) -> None:
    """W ← W diag(scale)."""
    _set(lin.weight, _rowwise_float64(lin.weight, lambda rows: rows * scale))


@torch.no_grad()
def fuse_block_norms(block: nn.Module, arch: Architecture) -> None:
    """Fold the scale of every norm of `block` that feeds linears into them."""
    for g in arch.residual_readers():
        scale = take_norm_scale(block.get_submodule(g.prev), arch.norm_offset)
        for lin in _readers(block, g):
            scale_columns(lin, scale)


@torch.no_grad()
def fuse_norms(model: nn.Module, arch: Architecture) -> None:
    """Fold the scale (o + g) of every norm that feeds linears into them; the norms keep only x/rms(x)."""
    untie_lm_head(model, arch)
    for block in decoder_layers(model, arch):
        fuse_block_norms(block, arch)
    scale_columns(_linear(model, arch.lm_head), take_norm_scale(model.get_submodule(arch.final_norm), arch.norm_offset))


@torch.no_grad()
def rotate_block_residual(block: nn.Module, arch: Architecture, signs: torch.Tensor, seed: int) -> None:
    """x → x Q on `block`'s readers and writers of the residual stream (its norms fused first); `signs` =
    random_signs(d, seed)."""
    for g in arch.residual_readers():
        for lin in _readers(block, g):
            _set(lin.weight, _times(lin.weight, signs))
    for i, n in enumerate(arch.writers):
        if arch.post_norms:
            attach(block.get_submodule(arch.post_norms[i]), "output_rotation", HadamardRotation(len(signs), seed))
            continue
        lin = _linear(block, n)
        _set(lin.weight, _times(lin.weight.T, signs).T)
        if lin.bias is not None:
            _set(lin.bias, _times(lin.bias, signs))


@torch.no_grad()
def rotate_block_heads(block: nn.Module, arch: Architecture) -> None:
    """Head-wise Hadamard on values (v_proj rows, o_proj columns) and online on queries/keys (the model needs
    `enable_attention_site`)."""
    head_dim = block.get_submodule(arch.attention).head_dim
    v, o = _linear(block, arch.values[0]), _linear(block, arch.values[1])
    w = v.weight.reshape(-1, head_dim, v.in_features).transpose(1, 2)  # [heads, in, head_dim]
    _set(v.weight, _times(w).transpose(1, 2))
    if v.bias is not None:
        _set(v.bias, _times(v.bias.reshape(-1, head_dim)))
    _set(o.weight, _times(o.weight.reshape(o.out_features, -1, head_dim)))
    attach(block.get_submodule(arch.attention), "qk_rotation", QKRotation())


@torch.no_grad()
def online_hadamard(block: nn.Module, arch: Architecture) -> None:
    """W ← W M on every writer of `block`, whose input is then x M online (its `input_rotation`)."""
    for n in arch.writers:
        lin = _linear(block, n)
        _set(lin.weight, _times(lin.weight))
        attach(lin, "input_rotation", HadamardRotation(lin.in_features))


def rotate_block(_index: int, block: nn.Module, arch: Architecture, signs: torch.Tensor, opts: QuaRotOptions) -> None:
    """QuaRot's part in one decoder block: its norms fused, the residual rotation, the Hadamards `opts` asks for."""
    fuse_block_norms(block, arch)
    rotate_block_residual(block, arch, signs, opts.seed)
    if opts.head_hadamard:
        rotate_block_heads(block, arch)
    if opts.online_hadamard:
        online_hadamard(block, arch)


def rotate_stream(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x Q, in float64: how the rotation maps the residual stream (for its function-preservation check)."""
    return hadamard_transform(x.double(), signs).to(x.dtype)


@torch.no_grad()
def rotate_head(model: nn.Module, arch: Architecture, scale: torch.Tensor, signs: torch.Tensor) -> None:
    """The LM head reads the rotated, unscaled stream: W ← W diag(scale) Q, `scale` the final norm's."""
    head = _linear(model, arch.lm_head)
    scale_columns(head, scale)
    _set(head.weight, _times(head.weight, signs))


def refuses_family(arch: Architecture) -> str | None:
    """Why QuaRot does not serve `arch`'s family, None where it does. With weighted norms after the branches (Gemma 3)
    the rotation still holds in full precision (the online output rotation), but the rotated model loses most of its
    accuracy once rounded, even at 8 bits (docs/methods/quarot.md has the measurement)."""
    if not arch.post_norms:
        return None
    return ("the family normalises each branch's output with a weighted norm before the residual add, and its rotated "
            "model, though exact in full precision, loses most of its accuracy once rounded, even at 8 bits "
            "(docs/methods/quarot.md)")


@register_stage("quarot", scope="model", kind="transform", options=QuaRotOptions, needs_calibration=False,
                streams=True, refuses=refuses_family)
@torch.no_grad()
def quarot(ctx: ModelContext, opts: QuaRotOptions) -> dict[str, Any]:
    """Rotate the embedding and take the final norm's scale now, each block as `ctx` reaches it, the LM head last."""
    model, arch = ctx.model, ctx.arch
    embed, final_norm = model.get_submodule(arch.embed), model.get_submodule(arch.final_norm)
    d = embed.weight.shape[1]
    signs = random_signs(d, opts.seed)
    head_scale = take_norm_scale(final_norm, arch.norm_offset)
    _set(embed.weight, _times(embed.weight, signs))  # a tied head's too: it is the same tensor
    tied = is_tied(model, arch)
    if tied:
        attach(final_norm, "output_rotation", RotatedScale(d, opts.seed, head_scale))
    ctx.each_block(partial(rotate_block, arch=arch, signs=signs, opts=opts), stream=partial(rotate_stream, signs=signs))
    if not tied:
        ctx.at_end(partial(rotate_head, arch=arch, scale=head_scale, signs=signs))
    if opts.head_hadamard:
        enable_attention_site(model)
    return {"seed": opts.seed, "hidden_size": d, "tied_lm_head": tied,
            "online_hadamard": list(arch.writers) if opts.online_hadamard else [],
            "online_output_rotation": list(arch.post_norms)}
