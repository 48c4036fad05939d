"""Mixture-of-experts experts as ordinary linears: one module per expert, computing what transformers' experts do.

transformers 5 keeps an MoE block's experts as 3D tensors (`gate_up_proj` [experts, 2·width, hidden], `down_proj`
[experts, hidden, width]) and loops over the experts some token was routed to. `ExpertLinears` stands where that
module was (`bitquilt.models.fused.split_fused` builds it from the tensors' row slices) with the same call: for
each expert hit, the rows of the tokens routed to it go through its own `gate_proj`/`up_proj` (act(gate) · up) and
`down_proj`, are weighted by the router's weight for that (token, expert) pair and added into the output in the
same order. An expert's linears therefore see exactly its tokens, which is what calibration hooks record (its
Hessian), and a linear replaced by a quantized one is the one called.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class Expert(nn.Module):
    """One SiLU-gated (or the family's activation) expert: down(act(gate(x)) · up(x))."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module,
                 act_fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ExpertLinears(nn.ModuleList):
    """The experts of one MoE block, expert e at index e (`mlp.experts.{e}.gate_proj`, ...), called as transformers
    calls its experts module: (hidden states [tokens, hidden], chosen experts [tokens, k], their weights)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # [experts, k, tokens]; index len(self) (a token sent nowhere, as transformers allows) is skipped
            routed = nn.functional.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)
            hit = routed.sum(dim=(-1, -2)).gt(0).nonzero().flatten().tolist()
        for e in hit:
            if e == len(self):
                continue
            slot, tokens = torch.where(routed[e])
            y = self[e](hidden_states[tokens]) * top_k_weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out
