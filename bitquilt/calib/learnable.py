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

llama.cpp block grid (K-quants and the 32-value types): ŵ = a·(q − c) − b per sub-block, a = d·(sc − c_sc),
b = dmin·mn, with the integer sub-block scales sc and minimums mn fixed (the search quantized them) and the fp16
super-block factors d, dmin scaled by learned factors α, β ∈ [½, 1] (rounded to fp16 as stored). Codes follow the
uniform case: q = clamp(⌊(W + b)/a + V⌉ + c, 0, 2^b − 1), V starting where it reproduces the solver's codes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bitquilt.formats.base import WeightFormat
from bitquilt.formats.bitplane import BitplaneFormat, combine_groups
from bitquilt.formats.ggml import GGMLFormat
from bitquilt.formats.ggml_blocks import Blocks
from bitquilt.formats.uniform import UniformFormat, UniformGrid, expand_groups
from bitquilt.solvers.ggml_search import round_to_grid


def round_half_up(x: torch.Tensor) -> torch.Tensor:
    """⌊x + ½⌋: unlike round-half-to-even, ⌊x + k⌉ = ⌊x⌉ + k for every integer k (the offsets V rely on it)."""
    return torch.floor(x + 0.5)


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """⌊x⌉ (half up) forward, identity backward."""
    return x + (round_half_up(x) - x).detach()


def fp16_ste(x: torch.Tensor) -> torch.Tensor:
    """x rounded to fp16 as a scale is stored (forward), identity backward."""
    return x + (x.to(torch.float16).float() - x).detach()


def offsets_from(codes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """V₀ = codes − ⌊x⌉: the integer offsets with which ⌊x + V⌉ gives the solver's (zero-free) codes."""
    return codes - round_half_up(x)


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


class LearnableRounding(LearnableWeight):
    """Rounding offsets V kept within V₀ ± ½ and two range factors α, β kept in [½, 1] (module docstring)."""

    CLIP_MIN = 0.5

    def init_params(self, v0: torch.Tensor, like: torch.Tensor, clip: bool, beta: bool) -> None:
        """V = V₀; α, β = 1 shaped like `like` (one per group or super-block), learned with `clip` (β only where
        `beta`)."""
        self.register_buffer("v0", v0)
        self.v = nn.Parameter(v0.clone())
        self.alpha = nn.Parameter(torch.ones_like(like), requires_grad=clip)
        self.beta = nn.Parameter(torch.ones_like(like), requires_grad=clip and beta)

    @torch.no_grad()
    def project_(self) -> None:
        self.v.data = torch.maximum(torch.minimum(self.v, self.v0 + 0.5), self.v0 - 0.5)
        self.alpha.clamp_(self.CLIP_MIN, 1.0)
        self.beta.clamp_(self.CLIP_MIN, 1.0)


class LearnableUniform(LearnableRounding):
    """SignRound's rounding offsets V and clipping factors α, β on a solver's uniform grid (module docstring)."""

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
        v0 = offsets_from(fmt.codes().float() - self.per_column(z0), self.w / self.per_column(s0))
        self.init_params(v0, s0, clip, beta=not fmt.sym)

    def scale_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale (rounded to fp16 as stored, straight-through) and zero of each (row, group)."""
        maxq = self.grid.maxq
        if self.grid.sym:
            scale, lo = self.s0 * self.alpha, None
        else:
            lo, hi = self.beta * self.x_min, self.alpha * self.x_max
            scale = self.s0 * ((hi - lo) / (self.x_max - self.x_min))  # = (hi − lo)/(2^b − 1), exactly s₀ at α = β = 1
        scale = fp16_ste(scale).clamp(min=2**-24)
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


class LearnableGGML(LearnableRounding):
    """Rounding offsets V and super-block factors α (of d), β (of dmin) on a llama.cpp block grid (module
    docstring); tensors are viewed [rows, blocks, sub-blocks, values]."""

    def __init__(self, weight: torch.Tensor, fmt: GGMLFormat, clip: bool = True):
        super().__init__()
        self.type, blocks = fmt.type, fmt.fields()
        rows, nb, _ = blocks.q.shape
        self.shape = (rows, nb, self.type.subs, self.type.sub)
        self.register_buffer("w", weight.detach().float().reshape(self.shape).clone())
        self.register_buffer("sc", blocks.sc)
        self.register_buffer("mn", blocks.mn)
        self.register_buffer("d", blocks.d.float())
        self.register_buffer("dmin", None if blocks.dmin is None else blocks.dmin.float())
        a, b = blocks.steps(self.type)
        b = torch.zeros_like(a) if b is None else b
        zero_step = (a == 0).unsqueeze(-1)
        x = torch.where(zero_step, 0.0, (self.w + b.unsqueeze(-1)) / a.unsqueeze(-1))
        v0 = offsets_from(blocks.q.view(self.shape).float() - self.type.code_zero, x)
        self.init_params(torch.where(zero_step, 0.0, v0), self.d, clip, beta=self.dmin is not None)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """d and dmin of every super-block, learned factors applied and rounded to fp16 (straight-through)."""
        return fp16_ste(self.alpha * self.d), None if self.dmin is None else fp16_ste(self.beta * self.dmin)

    def steps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) per sub-block [rows, blocks, sub-blocks], as `Blocks.steps` computes them (b = 0 without mins)."""
        d, dmin = self.factors()
        a = d.unsqueeze(-1) * (self.sc - self.type.scale_zero).float()
        return a, torch.zeros_like(a) if dmin is None else dmin.unsqueeze(-1) * self.mn.float()

    def _codes(self, a: torch.Tensor, b: torch.Tensor, round_fn: Callable) -> torch.Tensor:
        """Codes q (float): `round_to_grid` with the offsets V."""
        return round_to_grid(self.w, a.unsqueeze(-1), b.unsqueeze(-1), self.type, round_fn, self.v)

    def forward(self) -> torch.Tensor:
        a, b = self.steps()
        q = self._codes(a, b, round_ste) - self.type.code_zero
        w = a.unsqueeze(-1) * q - b.unsqueeze(-1)
        return w.reshape(self.shape[0], -1)

    @torch.no_grad()
    def to_format(self) -> GGMLFormat:
        d, dmin = self.factors()
        a, b = self.steps()
        q = self._codes(a, b, round_half_up).to(torch.uint8).reshape(*self.shape[:2], -1)
        return GGMLFormat.from_fields(self.type, Blocks(q, self.sc, self.mn, d.half(),
                                                        None if dmin is None else dmin.half()))


def learnable(weight: torch.Tensor, fmt: WeightFormat, clip: bool = True) -> LearnableWeight | None:
    """The learnable stand-in of `fmt` (the solver's result for full-precision `weight`); None for a
    format reconstruction cannot move (it is then left as solved)."""
    if isinstance(fmt, UniformFormat):
        return LearnableUniform(weight, fmt, clip)
    if isinstance(fmt, BitplaneFormat):
        return LearnableBitplane(fmt)
    if isinstance(fmt, GGMLFormat):
        return LearnableGGML(weight, fmt, clip)
    return None


class LearnableLinear(nn.Module):
    """y = x Ŵ(θ)ᵀ + b: a linear computing with a `LearnableWeight` (input online modules run in its pre-hook)."""

    def __init__(self, weight: LearnableWeight, bias: torch.Tensor | None):
        super().__init__()
        self.learned = weight
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.learned().to(x.dtype), self.bias)
