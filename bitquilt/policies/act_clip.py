"""Activation clipping: the clipping ratio of each linear's input quantizer, searched on calibration data.

For a linear whose plan asks for a searched ratio (`a_clip=None`), c is chosen from a grid to
minimise the output error Σ_t ‖(Q_c(x_t) − x_t) Wᵀ‖² on sampled inputs x (as its matmul sees
them: after any online rotation), with the weight as it stands before solving.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from bitquilt.calib.capture import sample_inputs
from bitquilt.calib.stages import BlockContext, register_stage
from bitquilt.nn.act_quant import ActQuantConfig, fake_quantize

CLIP_GRID = tuple(round(1 - 0.05 * i, 2) for i in range(10))  # 1.0 … 0.55


@torch.no_grad()
def search_clip_ratio(x: torch.Tensor, weight: torch.Tensor, config: ActQuantConfig,
                      grid: tuple[float, ...] = CLIP_GRID) -> float:
    """The ratio c minimising Σ_t ‖(x̂_t − x_t) Wᵀ‖² on samples x [tokens, in] (through the Gram
    matrix WᵀW when the layer widens its input, which is then cheaper)."""
    w = weight.float()
    gram = w.T @ w if w.shape[0] > w.shape[1] else None
    losses = []
    for c in grid:
        d = fake_quantize(x, replace(config, clip_ratio=c)) - x
        losses.append(float(((d @ gram) * d).sum() if gram is not None else (d @ w.T).pow(2).sum()))
    return grid[losses.index(min(losses))]


@register_stage("act_clip", scope="inputs", kind="policy")
def act_clip(ctx: BlockContext, _options: Any) -> dict[str, float]:
    """Set the searched clipping ratio of every linear of the shared input that asks for one."""
    search = [n for n in ctx.linears if (a := ctx.plan.act(ctx.full(n))) is not None and a.clip_ratio is None]
    if not search:
        return {}
    samples = sample_inputs(ctx.block, search, ctx.inputs, ctx.kwargs)
    chosen = {}
    for n in search:
        plan = ctx.plan[ctx.full(n)]
        ratio = search_clip_ratio(samples[n], ctx.block.get_submodule(n).weight, plan.act)
        plan.act = replace(plan.act, clip_ratio=ratio)
        chosen[n] = ratio
    return chosen
