"""Every decoder layer of a decode step in one compiled call (csrc/runtime/decode_step.cpp), for one sequence or a
batch of them.

`FusedLayers` holds, per layer, the norms' weights, the seven linears and optional q/k norms (Gemma 3's too: norms of
the branches' outputs, a sliding window, the layer type's RoPE tables; a mixture of experts' router and experts in
place of the MLP); a sequence's static KV cache joins as a handle
(`cache`), and `step(x, positions, caches)` runs one token of each of B sequences (or a prompt chunk of one) through
every layer: norms, projections, biases, RoPE, attention over each sequence's own cache (Gemma 2's scores soft-capped),
SiLU- (or GELU-tanh-) gated MLP and residuals, without a Python call per op, each linear called once for all B rows (its
weight read once per step); a routed MoBiQuant linear routes each row at the step's threshold for it where given (a
batch mixing precisions), and `step_bits` says the bits per weight each row used. The LM head and the final norm may
join too (`set_head`: `logits`). Every row comes out as it would alone (the kernels' rows are independent), so batching
changes no sequence's result. A linear is bit-plane packed parts run by the lookup-table kernel (the slices of a
MoBiQuant weight as a static prefix, or routed per token by its router; a MosaicQuant base with its sparse residual
added inside the tables), an 8-bit uniform weight run by the 8-bit GEMV, or a dense fp32 matrix (a dot product per row
and token, where module by module a BLAS GEMM runs, whose rows may round otherwise for other row counts): for the packed
weights, the kernel each would run module by module. While `kernels.using(int8_activations=True)` is in force as the
layers are built, 4- and 2-bit uniform weights run the low-bit × int8 kernel and 8-bit ones the GEMV's int8 path, as
module by module too. The model side (which modules qualify) is `bitquilt.runtime.lean`; the math is the eager modules'
in another fp32 order, tested against them, and csrc/runtime/decoder_core.h's, which the standalone runtime's library
runs too (`bitquilt.runtime.standalone`).
"""

from __future__ import annotations

import torch

from bitquilt.formats.base import WeightFormat
from bitquilt.formats.sparse_blocks import SparseBlockFormat
from bitquilt.kernels import cpu, mosaic, options, q4_int8, uniform8


class FusedLayers:
    """A Llama-like decoder stack in the extension's `FusedDecoder`, stepping the sequences whose caches it is given
    (module docstring)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 scaling: float, cos: torch.Tensor, sin: torch.Tensor, gelu: bool = False,
                 score_cap: float | None = None):
        ext = cpu.extension()
        if ext is None:
            raise RuntimeError("the CPU kernels are unavailable")
        self._decoder = ext.FusedDecoder(hidden, heads, kv_heads, head_dim, intermediate, eps, scaling,
                                         cos.float().contiguous(), sin.float().contiguous(), gelu, score_cap or 0.0)
        self.head: int | None = None  # the LM head's linear, once `set_head` names one

    def add_linear(self, fmts: list[WeightFormat] | None, dense: torch.Tensor | None, bias: torch.Tensor | None,
                   out_features: int, in_features: int) -> int | None:
        """Index of a linear y = x (Σ Ŵ_p)ᵀ + b over packed parts `fmts`, or y = x Wᵀ + b for `dense` (fp32); None if
        the parts do not pack alike. A MosaicQuant weight, [base, sparse residual], runs the base's lookup tables with
        the residual added inside (`bitquilt.kernels.mosaic`'s fused kernel). Otherwise a single 4- or 2-bit uniform
        part runs on int8 activations while those are enabled (`bitquilt.kernels.q4_int8`), as module by module."""
        residual: list[torch.Tensor] = []
        if fmts and isinstance(fmts[-1], SparseBlockFormat):
            segments = mosaic.segments(fmts[-1]) if len(fmts) == 2 else None
            if segments is None:
                return None
            fmts, residual = fmts[:1], segments.segments()
        single = fmts is not None and len(fmts) == 1 and not residual
        if single and options().int8_activations and (q4 := q4_int8.layout(fmts[0])) is not None:
            return self._decoder.add_q4_linear(q4.codes, q4.scales, q4.group, q4.bits, out_features, in_features, bias)
        if single and (u8 := uniform8.operands(fmts[0])) is not None:  # as module by module
            codes, groups = u8
            return self._decoder.add_u8_linear(codes, groups.scale, groups.scale_zero, groups.group, out_features,
                                               in_features, options().int8_activations, bias)
        kwargs = {"block": 32, "group": 32}
        if fmts:
            layouts = cpu.packed_alike(fmts)
            if layouts is None:
                return None
            kwargs = {"block": layouts[0].block, "group": layouts[0].group}
        else:
            layouts = []
        return self._decoder.add_linear([p.planes for p in layouts], [p.coeffs for p in layouts],
                                        [p.bits for p in layouts], [p.uniform for p in layouts], N=out_features,
                                        K=in_features, dense=dense, bias=bias, residual=residual, **kwargs)

    def route(self, index: int, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor, fc2_weight: torch.Tensor,
              fc2_bias: torch.Tensor, threshold: torch.Tensor, slice_bits: list[int]) -> None:
        """Give linear `index` (several parts, `slice_bits[p]` bits each) a MoBiRoute router: per token, its first k
        parts, k from the router's two layers and `threshold` (read at every step, so a later `set_precision`
        applies) or the step's own threshold for the token's row. The parts run on int8 activations while those are
        enabled (`bitquilt.kernels.cpu.matmul_parts`, as module by module)."""
        self._decoder.set_router(index, fc1_weight.detach().contiguous(), fc1_bias.detach().contiguous(),
                                 fc2_weight.detach().contiguous(), fc2_bias.detach().contiguous(), threshold,
                                 [float(b) for b in slice_bits], options().int8_activations)

    def add_layer(self, in_norm: torch.Tensor, post_norm: torch.Tensor, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, linears: list[int],
                  branch_norms: tuple[torch.Tensor, torch.Tensor] | None = None, window: int | None = None,
                  rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """A layer: the vectors its norms multiply by and the indices of its q, k, v, o, gate, up, down linears;
        Gemma's norms of the attention's and the MLP's outputs, sliding window and RoPE tables [max_len, head_dim]
        (else the constructor's)."""
        attn_out, mlp_out = branch_norms or (None, None)
        cos, sin = (None, None) if rope is None else (t.float().contiguous() for t in rope)
        self._decoder.add_layer(in_norm, post_norm, q_norm, k_norm, linears, attn_out, mlp_out, window or 0, cos, sin)

    def set_experts(self, router: int, gates: list[int], ups: list[int], downs: list[int], top_k: int,
                    renormalize: bool) -> None:
        """The last layer's MLP as a mixture of experts: linear `router` [E, hidden] picks each token's `top_k`
        experts by softmax probability (renormalised to sum 1 where `renormalize`), whose linears are gates[e],
        ups[e], downs[e]; each expert runs once for the rows routed to it."""
        self._decoder.set_experts(router, gates, ups, downs, top_k, renormalize)

    def cache(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> object:
        """A sequence's cache for `step`, over its per-layer keys and values [kv_heads, length, head_dim] (fp32,
        written in place; length at most the RoPE tables')."""
        return self._decoder.cache(keys, values)

    def set_head(self, index: int, norm: torch.Tensor) -> None:
        """Linear `index` as the LM head, after the final RMSNorm of weight `norm` (the layers' epsilon)."""
        self._decoder.set_head(index, norm)
        self.head = index

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits [B, vocab] of hidden states x [B, D] (`set_head` first), each row as it comes out alone."""
        return self._decoder.logits(x)

    def step(self, x: torch.Tensor, positions: list[int], caches: list[object], thresholds: list[float] | None = None,
             counts: list[int] | None = None) -> torch.Tensor:
        """The hidden states [R, D] after every layer of B sequences' rows x [R, D]: sequence b's `counts[b]` tokens
        (one each by default; x holds sequence 0's rows, then sequence 1's, ...) from `positions[b]` of `caches[b]`
        on (their keys and values cached there), so a prompt chunk can share a decode step's weight reads. Routed
        linears route sequence b's rows at `thresholds[b]` where given and not NaN (a batch mixing precisions;
        `bitquilt.nn.slice_router.threshold_for`), else at their routers' own."""
        return self._decoder.step(x, positions, caches, thresholds or [], counts or [])

    def step_bits(self) -> list[float]:
        """The bits per weight each row of the last step used in the routed linears (weighted by their sizes), a value
        per row; empty without routed linears."""
        return self._decoder.step_bits()
