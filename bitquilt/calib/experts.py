"""Calibration statistics of MoE experts that saw too few tokens.

An expert's linears are calibrated on the tokens routed to it (their input hooks see exactly those rows). An expert
the calibration text rarely picks gets a rank-deficient Hessian, or none at all, and a Hessian-based solver would
fit those few tokens rather than the expert. The rule (as GPTQModel and llm-compressor treat rare experts, with a
prior instead of a second method, so every solver and format still applies): an expert linear that saw n tokens,
fewer than its `in_features` d, gets statistics worth d tokens, its own n blended with d − n tokens of a prior:

- gate/up: the statistics of every token of the layer at the same input (what the router reads), the dense input
  the expert would see if routing picked it for everything;
- down (its input exists only inside the expert): the identity scaled to the expert's own mean diagonal, so GPTQ
  tends to round-to-nearest as n → 0 (the identity itself when the expert saw no token).
"""

from __future__ import annotations

import torch

from bitquilt.solvers.base import LinearStats


def blended(own: LinearStats | None, width: int, prior: LinearStats | None) -> LinearStats:
    """`own` (None: no token) blended with `prior` (None: the scaled identity) to `width` tokens (module docstring)."""
    n = 0 if own is None else own.n_tokens
    if own is None:
        own = LinearStats.empty(width, device=prior.act_absmax.device if prior is not None else "cpu")
    if prior is None:
        scale = float(own.hessian.diagonal().mean()) if n else 1.0
        ones = torch.ones(width, device=own.act_absmax.device)
        prior = LinearStats(torch.eye(width, device=ones.device) * scale, ones * scale ** 0.5, ones * scale ** 0.5, 0)
    share = n / width
    return LinearStats(own.hessian * share + prior.hessian * (1 - share),
                       torch.maximum(own.act_absmax, prior.act_absmax),
                       own.act_absmean * share + prior.act_absmean * (1 - share), n, own.products)


def fill_rare(stats: dict[str, LinearStats], widths: dict[str, int], dense: LinearStats | None) -> dict[str, int]:
    """Replace in `stats` the statistics of each linear of `widths` ({name: in_features}, an MoE group's expert
    linears) that saw fewer tokens than its width by `blended` ones (linears sharing one input keep sharing them);
    `dense`: the layer's statistics of that input over every token, None where there is none. Returns {name: tokens
    it saw} of those replaced."""
    rare: dict[str, int] = {}
    done: dict[int, LinearStats] = {}
    for name, width in widths.items():
        own = stats.get(name)
        if own is not None and own.n_tokens >= width:
            continue
        rare[name] = 0 if own is None else own.n_tokens
        key = id(own) if own is not None else id(name)
        if key not in done:
            done[key] = blended(own, width, dense)
        stats[name] = done[key]
    return rare
