"""MoBiQuant's joint calibration pieces: a sliced linear that trains its slices and router together,
the bit budget, and the bits-per-threshold curve each router keeps.

Training forward of one linear with slices Ŵ_1..Ŵ_E (learnable coefficients over fixed planes,
`LearnableBitplane`) and router logits l_{t,j} (`bitquilt.nn.slice_router`):

    y_t = x_t Ŵ_1ᵀ + Σ_{j=1}^{E−1} m_{t,j} · x_t Ŵ_{j+1}ᵀ + b,   m_{t,j} = σ(l_{t,j} / T)

with the temperature T annealed geometrically from `t_start` to `t_end` (near binary), so the
gates end where inference puts them: m = [l > 0] (δ = ½). Without gradients (loss measurement) the
gates are already binary. Expected bits of a token: b₁ + Σ_j b_{j+1}·m_{t,j}.

Budget over one block's routed linears (weights n_i, expected bits per token b̄_i averaged over the batch):

    penalty = λ · sg(L) · (Σ_i n_i b̄_i / Σ_i n_i − B)²

L the mini-batch's output error (sg: no gradient through it), so λ weighs one bit of overshoot
against the error itself whatever the block's scale.

Refitting the slices (`train_slices`) touches only the first m (`refit_count`: up to one bit past
the budget). Every other step forces every token of the block through the same prefix k, drawn
uniformly from 1..m, so each refitted slice learns on the static prefixes that use it and not only
on the budget's mix:

    E_steps[loss] ∝ log L_routed + penalty + E_k log L_k      (each step minimises L/sg(L): ∇ log L)

the log making a 2-bit prefix's large error and a 4-bit prefix's small one weigh alike. Then the
slices above m are cut again (`recut`, MoBiSlice's recursion) from what the refitted ones leave of
W̃ = Σ_e W_e, the untrained slices' sum (W to the finest step): a refitted base moves by fractions
of its own step, far more than the finest slice can absorb, so without the re-cut the high
precisions lose what the low ones gain (docs/methods/mobiquant.md).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from bitquilt.calib.learnable import LearnableBitplane
from bitquilt.formats.bitplane import BitplaneFormat
from bitquilt.formats.composite import CompositeFormat
from bitquilt.kernels.composite import prefix_matmul
from bitquilt.nn.slice_router import TAU_GRID, SliceRouter
from bitquilt.solvers.mobislice import quantize_slice

GATE_FLOOR = 1e-4  # training skips the tail of slices whose gate is below this for every token


def routable(fmt: object) -> bool:
    """A weight the router can train on: ≥ 2 bit-plane slices, no column permutation."""
    return (isinstance(fmt, CompositeFormat) and fmt.perm is None and len(fmt.parts) >= 2
            and all(isinstance(p, BitplaneFormat) for p in fmt.parts.values()))


class RoutedSlices(nn.Module):
    """A sliced linear with learnable slices and router (module docstring)."""

    def __init__(self, fmt: CompositeFormat, bias: torch.Tensor | None, router: SliceRouter):
        super().__init__()
        self.names = list(fmt.parts)
        self.slices = nn.ModuleList(LearnableBitplane(p) for p in fmt.parts.values())
        self.router = router
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        device = next(iter(fmt.tensors().values())).device
        self.register_buffer("bits", torch.tensor(router.slice_bits, dtype=torch.float32, device=device))
        self.out_features = fmt.out_features
        self.temperature = 1.0
        self.forced: int | None = None  # k: every token through the first k slices, the router unused
        self.expected_bits: torch.Tensor | None = None  # of the last forward, for the budget
        self._dense: tuple[tuple[int, ...], list[torch.Tensor]] | None = None  # (parameter versions, weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forced is not None:
            y = self._static_forward(x, self.forced)
        else:
            logits = self.router.logits(x)
            y = self._train_forward(x, logits) if torch.is_grad_enabled() else self._hard_forward(x, logits)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _static_forward(self, x: torch.Tensor, k: int) -> torch.Tensor:
        self.expected_bits = self.bits[:k].sum()
        return F.linear(x, sum(self.dense_slices()[:k]).to(x.dtype))

    def _train_forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Soft gates. Gates fall along the slices, so the slices whose gate is below GATE_FLOOR for every
        token of the batch form a tail: it is left out (its outputs and gradients are below the floor)."""
        gates = torch.sigmoid(logits / self.temperature)
        used = 1 + int((gates.detach().reshape(-1, gates.shape[-1]).amax(0) > GATE_FLOOR).sum())
        gates = torch.cat([torch.ones_like(gates[..., :1]), gates[..., : used - 1]], dim=-1)
        self.expected_bits = (gates * self.bits[:used]).sum(-1).mean()
        weight = torch.cat([s() for s in self.slices[:used]]).to(x.dtype)  # [used·out, in]
        per_slice = F.linear(x, weight).unflatten(-1, (used, self.out_features))
        return (per_slice * gates.unsqueeze(-1).to(per_slice.dtype)).sum(-2)

    def _hard_forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Binary gates (δ = ½): each token through the slices it uses only, as at run time."""
        counts = 1 + (logits > 0).sum(-1)
        self.expected_bits = self.router.bits_of(counts).mean()
        weights = [w.to(x.dtype) for w in self.dense_slices()]
        y = prefix_matmul(x.reshape(-1, x.shape[-1]), counts.reshape(-1), weights)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dense_slices(self) -> list[torch.Tensor]:
        """Each slice's weight Ŵ_e, computed once while the slices' parameters are unchanged (no-grad passes over
        many windows: the error before and after, the streams) and afresh under autograd."""
        if torch.is_grad_enabled():
            return [s() for s in self.slices]
        version = tuple(p._version for p in self.slices.parameters())
        if self._dense is None or self._dense[0] != version:
            self._dense = (version, [s() for s in self.slices])
        return self._dense[1]

    def to_format(self) -> CompositeFormat:
        return CompositeFormat({n: s.to_format() for n, s in zip(self.names, self.slices)})


def temperature_schedule(routed: list[RoutedSlices], t_start: float, t_end: float) -> Callable[[float], None]:
    """anneal(t): T = t_start·(t_end/t_start)^t in every routed linear, t ∈ [0, 1)."""
    def anneal(t: float) -> None:
        for r in routed:
            r.temperature = t_start * math.exp(t * math.log(t_end / t_start))
    return anneal


def prefix_schedule(routed: list[RoutedSlices], n_slices: int, steps: int, seed: int) -> Callable[[float], None]:
    """choose(t), before step t·steps: odd steps force every linear to one random prefix k ∈ 1..n_slices
    (the same k for the whole block), even steps and the end (t = 1) route (module docstring)."""
    rng = random.Random(seed)

    def choose(t: float) -> None:
        k = rng.randint(1, n_slices) if t < 1 and round(t * steps) % 2 else None
        for r in routed:
            r.forced = k
    return choose


def refit_count(slice_bits: list[int], target_bits: float) -> int:
    """m: the fewest leading slices whose bits reach target_bits + 1 (all of them if none do)."""
    total = 0
    for m, bits in enumerate(slice_bits, start=1):
        total += bits
        if total >= target_bits + 1:
            return m
    return len(slice_bits)


@torch.no_grad()
def recut(original: CompositeFormat, refitted: list[BitplaneFormat], grid: str = "nested",
          iters: int = 3) -> CompositeFormat:
    """The refitted first slices, then the rest of `original`'s slices (same widths and groups) cut again, on
    MoBiSlice's `grid` (`iters` refits for lloyd), from what the refitted ones leave of W̃ = Σ_e W_e (module
    docstring)."""
    names = list(original.parts)
    residual = original.dequantize() - sum(p.dequantize() for p in refitted)
    parts = dict(zip(names, refitted))
    for name in names[len(refitted):]:
        old = original.parts[name]
        parts[name] = quantize_slice(residual, old.bits, old.group_size, grid, iters)
        residual = residual - parts[name].dequantize()
    return CompositeFormat(parts)


def budget_penalty(routed: list[RoutedSlices], target_bits: float,
                   weight: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """penalty(L) of the module docstring for these linears (weight = λ)."""
    numel = torch.tensor([float(r.out_features * r.slices[0].fmt.in_features) for r in routed])

    def penalty(loss: torch.Tensor) -> torch.Tensor:
        mean_bits = sum(n * r.expected_bits for n, r in zip(numel, routed)) / numel.sum()
        return weight * loss.detach() * (mean_bits - target_bits) ** 2
    return penalty


class CurveMeter:
    """Accumulates a router's mean bits per token at every τ of TAU_GRID over the inputs it sees."""

    def __init__(self, router: SliceRouter):
        self.router = router
        self.total = torch.zeros(len(TAU_GRID), dtype=torch.float64)
        self.tokens = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        logits = self.router.logits(x.reshape(-1, x.shape[-1]))
        counts = 1 + (logits.unsqueeze(1) > TAU_GRID.to(logits.device)[None, :, None]).sum(-1)  # [T, G]
        self.total += self.router.bits_of(counts.cpu()).double().sum(0)
        self.tokens += logits.shape[0]

    def curve(self) -> torch.Tensor:
        return (self.total / max(self.tokens, 1)).float()
