"""Differentiable stand-ins for packed weights, trained by block-wise reconstruction.

A `LearnableWeight` starts exactly at a solver's packed result (RTN, GPTQ, AWQ-scaled grids,
BPDQ coefficients), exposes the parameters reconstruction may move, computes Ŵ(θ) with
straight-through rounding, and packs the trained weight back into the *same* format: bits,
group size and layout are unchanged, so saved models and kernels do not know it happened.

Uniform grid (SignRound, Cheng et al., 2023; the parametrisation of Intel's AutoRound):
    Ŵ = s·(clamp(⌊W/s + V⌉ + z, 0, 2^b − 1) − z)
per (row, group), with the range [x_min, x_max] of the solver's grid (x_min = −z₀·s₀,
x_max = x_min + (2^b − 1)·s₀) clipped by learned factors β, α ∈ [½, 1]:
    s = (α·x_max − β·x_min) / (2^b − 1),   z = ⌊−β·x_min / s⌉   (symmetric: s = α·s₀, z = 2^(b−1)).
V starts at V₀ = (q₀ − z₀) − ⌊W/s₀⌉, an integer that reproduces the solver's codes q₀ (0 after
RTN; after GPTQ it moves a code where GPTQ moved it) and stays in [V₀ − ½, V₀ + ½]: each weight
may round the other way from where it starts, keeping W's fractional position. ⌊·⌉ is
straight-through (gradient 1).

BPDQ grid: Ŵ = C₀ + Σᵢ Cᵢ·Bᵢ per (row, group) with the bit-planes B fixed and the coefficients C
learned (the planes were chosen for those coefficients; moving C re-fits the levels to the block),
in units of the group's finest step |C₁|.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bitquilt.formats.base import WeightFormat
from bitquilt.formats.bitplane import BitplaneFormat, combine_groups
from bitquilt.formats.uniform import UniformFormat, UniformGrid, expand_groups


def round_half_up(x: torch.Tensor) -> torch.Tensor:
    """⌊x + ½⌋: unlike round-half-to-even, ⌊x + k⌉ = ⌊x⌉ + k for every integer k (the offsets V rely on it)."""
    return torch.floor(x + 0.5)


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """⌊x⌉ (half up) forward, identity backward."""
    return x + (round_half_up(x) - x).detach()


class PerColumn:
    """Expands per-(row, group) values t [out, G, ...] to per-column values [out, in, ...]: a broadcast
    for contiguous groups (cheap forward and backward), a gather for act-order groups (g_idx)."""

    def __init__(self, fmt: UniformFormat):
        self.index = None if fmt.g_idx is None else fmt.g_idx.long()
        self.group_size, self.in_features = fmt.group_size, fmt.in_features

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.index is not None:
            return t[:, self.index.to(t.device)]
        return expand_groups(t, self.group_size, self.in_features)


class LearnableWeight(nn.Module):
    """A weight Ŵ(θ) that starts at a packed format and packs back into it."""

    def forward(self) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def to_format(self) -> WeightFormat:  # pragma: no cover - interface
        raise NotImplementedError

    def project_(self) -> None:
        """Put every parameter back into its allowed range (after each optimiser step)."""


class LearnableUniform(LearnableWeight):
    """SignRound's rounding offsets V and clipping factors α, β on a solver's uniform grid (module docstring)."""

    CLIP_MIN = 0.5

    def __init__(self, weight: torch.Tensor, fmt: UniformFormat, clip: bool = True):
        super().__init__()
        self.grid = UniformGrid(fmt.bits, fmt.sym)
        self.group_size, self.g_idx = fmt.group_size, fmt.g_idx
        self.register_buffer("w", weight.detach().float().clone())
        self.per_column = PerColumn(fmt)
        s0, z0 = fmt.scale_zero()
        self.register_buffer("x_min", -z0 * s0)
        self.register_buffer("x_max", (self.grid.maxq - z0) * s0)
        self.register_buffer("s0", s0)
        q0 = fmt.codes().float()
        v0 = (q0 - self.per_column(z0)) - round_half_up(self.w / self.per_column(s0))
        self.register_buffer("v0", v0)
        self.v = nn.Parameter(v0.clone())
        shape = s0.shape
        self.alpha = nn.Parameter(torch.ones(shape, device=s0.device), requires_grad=clip)
        self.beta = nn.Parameter(torch.ones(shape, device=s0.device), requires_grad=clip and not fmt.sym)

    def scale_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale (rounded to fp16 as stored, straight-through) and zero of each (row, group)."""
        maxq = self.grid.maxq
        if self.grid.sym:
            scale, lo = self.s0 * self.alpha, None
        else:
            lo, hi = self.beta * self.x_min, self.alpha * self.x_max
            scale = self.s0 * ((hi - lo) / (self.x_max - self.x_min))  # = (hi − lo)/(2^b − 1), exactly s₀ at α = β = 1
        scale = scale + (scale.to(torch.float16).float().clamp(min=2**-24) - scale).detach()
        if lo is None:
            return scale, torch.full_like(self.s0, (maxq + 1) // 2)
        return scale, torch.clamp(round_ste(-lo / scale), 0, maxq)

    def _codes(self, scale: torch.Tensor, zero: torch.Tensor, round_fn: Callable) -> torch.Tensor:
        s, z = self.per_column(scale), self.per_column(zero)
        return torch.clamp(round_fn(self.w / s + self.v) + z, 0, self.grid.maxq)

    def forward(self) -> torch.Tensor:
        scale, zero = self.scale_zero()
        s, z = self.per_column(scale), self.per_column(zero)
        return s * (self._codes(scale, zero, round_ste) - z)

    @torch.no_grad()
    def project_(self) -> None:
        self.v.data = torch.maximum(torch.minimum(self.v, self.v0 + 0.5), self.v0 - 0.5)
        self.alpha.clamp_(self.CLIP_MIN, 1.0)
        self.beta.clamp_(self.CLIP_MIN, 1.0)

    @torch.no_grad()
    def to_format(self) -> UniformFormat:
        scale, zero = self.scale_zero()
        q = self._codes(scale, zero, round_half_up)
        return UniformFormat.from_codes(q, scale, zero, self.grid, self.group_size, self.g_idx)


class LearnableBitplane(LearnableWeight):
    """BPDQ's coefficients learned over fixed bit-planes (module docstring), moved in units of each group's
    finest step: C = C⁰ + |C⁰₁|·D, D starting at 0, so one step size suits every layer's scale."""

    def __init__(self, fmt: BitplaneFormat):
        super().__init__()
        self.fmt = fmt
        self.register_buffer("planes", fmt.unpacked_planes().float())
        c0 = fmt.coeffs.float()
        self.register_buffer("c0", c0)
        self.register_buffer("unit", c0[..., 1:2].abs().clamp(min=2**-24))
        self.offsets = nn.Parameter(torch.zeros_like(c0))

    def coeffs(self) -> torch.Tensor:
        return self.c0 + self.unit * self.offsets

    def forward(self) -> torch.Tensor:
        return combine_groups(self.coeffs(), self.planes, self.fmt.group_size)

    @torch.no_grad()
    def to_format(self) -> BitplaneFormat:
        f = self.fmt
        return BitplaneFormat(f.planes, self.coeffs().to(torch.float16).contiguous(), f.bits, f.group_size,
                              f.in_features)


def learnable(weight: torch.Tensor, fmt: WeightFormat, clip: bool = True) -> LearnableWeight | None:
    """The learnable stand-in of `fmt` (the solver's result for full-precision `weight`); None for a
    format reconstruction cannot move (it is then left as solved)."""
    if isinstance(fmt, UniformFormat):
        return LearnableUniform(weight, fmt, clip)
    if isinstance(fmt, BitplaneFormat):
        return LearnableBitplane(fmt)
    return None


class LearnableLinear(nn.Module):
    """y = x Ŵ(θ)ᵀ + b: a linear computing with a `LearnableWeight` (input online modules run in its pre-hook)."""

    def __init__(self, weight: LearnableWeight, bias: torch.Tensor | None):
        super().__init__()
        self.learned = weight
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.learned().to(x.dtype), self.bias)
