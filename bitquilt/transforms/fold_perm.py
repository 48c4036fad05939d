"""Fold a linear's input-column permutation into the rows of the linears producing its input.

A weight stored in permuted column order (MXSens puts each linear's most sensitive columns
first) computes y = x[:, perm] · W_storedᵀ, a gather of x on every call. When the linear's
input is an elementwise function of other linears' outputs (the gated MLP,
down(act(gate(x)) ⊙ up(x))), permuting the producers' output rows by perm makes that input
arrive already permuted:  act(gate'(x)) ⊙ up'(x) = (act(gate(x)) ⊙ up(x))[:, perm]  for
gate' = gate[perm, :], up' = up[perm, :]. The consumer then keeps W_stored and drops perm. Exact:
rows are only renamed. Runs on each block after it is solved, where the producers' formats can
permute rows and the consumer's input has no online transform (a rotation expects the original order).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bitquilt.calib.stages import BlockContext, register_stage
from bitquilt.nn.act_quant import MXActQuantizer
from bitquilt.nn.online import attach, get, has_input_transform, swap_host
from bitquilt.nn.quant_linear import QuantLinear


def _permuted_rows(linear: nn.Module, order: torch.Tensor) -> QuantLinear | None:
    if not isinstance(linear, QuantLinear):
        return None
    fmt = linear.fmt.permute_rows(order)
    bias = None if linear.bias is None else linear.bias[order.long()]
    return None if fmt is None else QuantLinear(fmt, bias).to(order.device)


@register_stage("fold_perm", scope="post_block", kind="transform", needs_calibration=False)
@torch.no_grad()
def fold_perm(ctx: BlockContext, _options: Any) -> dict[str, Any] | None:
    """Fold every foldable consumer's permutation of this block into its producers."""
    folded = []
    for consumer, producers in ctx.arch.elementwise_inputs:
        linear = ctx.block.get_submodule(consumer)
        perm = getattr(getattr(linear, "fmt", None), "perm", None)
        if perm is None or has_input_transform(linear) or not hasattr(linear.fmt, "in_stored_order"):
            continue
        permuted = {p: _permuted_rows(ctx.block.get_submodule(p), perm) for p in producers}
        if any(v is None for v in permuted.values()):
            continue
        for p, new in permuted.items():
            swap_host(ctx.block, p, new)
        act = get(linear, "act_quant")
        new = QuantLinear(linear.fmt.in_stored_order(), linear.bias)
        swap_host(ctx.block, consumer, new)
        if isinstance(act, MXActQuantizer):
            attach(new, "act_quant", MXActQuantizer(act.config, act.widths, act.columns))
        folded.append(consumer)
    return {"folded": folded} if folded else None
