"""MosaicQuant (2026): a dense 4-bit base plus a sparse residual of 4-bit tiles chosen by a Hessian Δ-score.

After the backbone's equivalence transform (SmoothQuant scales or QuaRot rotations), a solver gives
the dense base B = Q(W); its error E = W − B is cut into r×c tiles and each tile b gets its own
symmetric 4-bit quantization Q4(E_b) (`formats.sparse_blocks`). Storing the tiles S lowers the
layer's output distortion on calibration inputs X (H = XᵀX/n, per token)

    D(S) = tr((E − R_S) H (E − R_S)ᵀ),   R_S = Σ_{b ∈ S} Q4(E_b) placed at tile b,

and MosaicQuant keeps the ⌈ρ · #tiles⌉ tiles of highest

    Δ_b = Σ_{(i,j) ∈ b} H_jj · (E_ij² − (E_ij − Q4(E)_ij)²)

the drop in D tile b alone would give if H were diagonal (the paper's score). Other rankings:
`exact`, the drop tile b alone gives with the full H, 2⟨Q4(E_b), (E H)_b⟩ − Σ_{rows i of b}
Q4(E_b)_i H_cc Q4(E_b)_iᵀ (one E·H product); `greedy`, the exact greedy on D: each step takes the
tile of largest true drop given the tiles already taken (the same formula with E replaced by
D = E − R_S; tiles in other rows do not interact, so a step updates its own band of rows only);
`magnitude` (Σ_b E², no activations) and `random` (seeded). Every score ranks tiles; a budget
keeps a prefix. After a rotation (QuaRot) H's diagonal is nearly flat while its off-diagonal part
is not, so Δ ranks almost like magnitude and the full-H rankings recover far more (bench/mosaic.py):
`auto`, the default, is greedy on an RTN base.

A GPTQ base is solved jointly with its residual (`gptq_mosaic`): GPTQ's error E is shaped by its
feedback (its columns cancel through H), so tiles fitted to it afterwards add distortion; instead the
tiles are chosen on the RTN error of GPTQ's starting grid, with Δ weighting column j by the
sweep's own sensitivity 1/[U]_jj² (U the Cholesky factor of H⁻¹: the OBS cost of an error on column
j; H_jj when H is diagonal; `auto` here), and the sweep quantizes their weights to base + residual,
compensating what both leave.

The weight becomes `CompositeFormat({"base": B, "residual": S})`: both branches are 4-bit and read
the same (4-bit) activations, x Ŵᵀ = x Bᵀ + x Sᵀ, fused by `bitquilt.kernels.mosaic`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bitquilt.formats.base import WeightFormat
from bitquilt.formats.composite import CompositeFormat
from bitquilt.formats.sparse_blocks import (
    QMAX,
    QMIN,
    SparseBlockFormat,
    check_block_shape,
    from_blocks,
    quantize_tiles,
    to_blocks,
)
from bitquilt.formats.uniform import UniformGrid, resolve_group_size
from bitquilt.registry import Registry, make_options, option
from bitquilt.solvers.base import LayerSpec, LinearStats, Solver, hessian_error
from bitquilt.solvers.gptq import GPTQOptions, gptq
from bitquilt.solvers.hessian import invert_permutation, prepare_hessian
from bitquilt.solvers.rtn import dequantize_groups, quantize_groups

SCORES = ("auto", "delta", "exact", "greedy", "magnitude", "random")
NEEDS_HESSIAN = ("auto", "delta", "exact", "greedy")
AUTO = {"joint": "delta", "fitted": "greedy"}  # what "auto" ranks by, per way of adding the residual


@dataclass(frozen=True)
class MosaicOptions:
    budget: float = option(0.1, "fraction of each linear's tiles stored as the 4-bit residual (0 to 1)")
    block: tuple[int, ...] = option((1, 32), "tile shape (rows, columns); columns a multiple of 32 run fused")
    score: str = option("auto", f"tile ranking: {', '.join(SCORES)} (auto: greedy on an RTN base, delta in the joint "
                        "GPTQ sweep: the best measured on each)")
    seed: int = option(0, "seed of the random ranking")

    def __post_init__(self) -> None:
        if not 0.0 <= self.budget <= 1.0:
            raise ValueError(f"mosaic: budget is a fraction of tiles in [0, 1], got {self.budget}")
        if len(self.block) != 2 or min(self.block) <= 0 or self.block[0] * self.block[1] % 32:
            raise ValueError(f"mosaic: block must be two positive sizes (rows, columns) holding a multiple of 32 "
                             f"values, e.g. 1x32 or 16x32; got {'x'.join(map(str, self.block))}")
        if self.score not in SCORES:
            raise ValueError(f"mosaic: score must be one of {', '.join(SCORES)}, got {self.score!r}")

    @property
    def needs_hessian(self) -> bool:
        return self.score in NEEDS_HESSIAN


def parse_block(text: str) -> tuple[int, int]:
    """'16x32' -> (16, 32)."""
    try:
        r, c = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"residual block {text!r}: write ROWSxCOLS, e.g. 1x32 or 16x32") from None
    return r, c


@dataclass
class Residual:
    """E = W − B in tiles and every tile's 4-bit quantization, the inputs every score ranks."""

    error: torch.Tensor  # E [out, in]
    tiles: torch.Tensor  # E in tiles [n, r·c]
    quantized: torch.Tensor  # Q4(E) in tiles [n, r·c]
    block: tuple[int, int]

    @classmethod
    def of(cls, weight: torch.Tensor, base: torch.Tensor, block: tuple[int, int]) -> Residual:
        check_block_shape(*weight.shape, block)
        error = weight.float() - base.float()
        tiles = to_blocks(error, block)
        q, s = quantize_tiles(tiles)
        return cls(error, tiles, q * s[:, None], block)

    @property
    def n_tiles(self) -> int:
        return self.tiles.shape[0]

    def dense(self, index: torch.Tensor) -> torch.Tensor:
        """R_S [out, in]: the quantized tiles `index`, zero elsewhere."""
        out = torch.zeros_like(self.tiles)
        out[index] = self.quantized[index]
        return from_blocks(out, self.block, *self.error.shape)

    def column_of_tile(self) -> torch.Tensor:
        """Input columns covered by each tile [n, r·c] (tile-local row-major, as `to_blocks`)."""
        cols = torch.arange(self.error.shape[1], device=self.error.device).expand(self.error.shape[0], -1)
        return to_blocks(cols, self.block)


def delta_scores(res: Residual, hessian_diag: torch.Tensor) -> torch.Tensor:
    """Δ_b = Σ_{(i,j) ∈ b} H_jj (E_ij² − (E_ij − Q4(E)_ij)²) (module docstring)."""
    h = hessian_diag.float()[res.column_of_tile()]
    return (h * (res.tiles.pow(2) - (res.tiles - res.quantized).pow(2))).sum(dim=1)


def magnitude_scores(res: Residual) -> torch.Tensor:
    return res.tiles.pow(2).sum(dim=1)


class TileGains:
    """The exact drop in D(S) each tile would give if taken next: 2⟨Q4(E_b), (D H)_b⟩ − Σ_{rows i of b} Q4(E_b)_i
    H_cc Q4(E_b)_iᵀ, with D = E − R_S (S empty to start). Taking a tile changes D in its own band of r rows only,
    so `take` updates the gradient D H of that band and the gains of the tiles in it."""

    def __init__(self, res: Residual, hessian: torch.Tensor):
        r, c = self.block = res.block
        out, inp = res.error.shape
        self.h = hessian.float()
        self.per_row = inp // c
        self.gradient = res.error @ self.h
        self.q4 = res.quantized.reshape(out // r, self.per_row, r, c)  # tile b = (band b // per_row, block b % ...)
        h_blocks = self.h.reshape(self.per_row, c, self.per_row, c).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
        self.self_term = torch.einsum("bprc,pcd,bprd->bp", self.q4, h_blocks, self.q4).reshape(-1)
        self.gains = self.linear_term(slice(0, out // r)) - self.self_term

    def linear_term(self, bands: slice) -> torch.Tensor:
        r, c = self.block
        g = self.gradient[bands.start * r:bands.stop * r].reshape(-1, r, self.per_row, c).transpose(1, 2)
        return 2 * (self.q4[bands] * g).sum(dim=(2, 3)).reshape(-1)

    def take(self, b: int) -> slice:
        """Take tile b: update its band's gradient and gains; returns the band's tile ids."""
        r, c = self.block
        band, cb = divmod(b, self.per_row)
        q = self.q4[band, cb]
        self.gradient[band * r:(band + 1) * r] -= q @ self.h[cb * c:(cb + 1) * c]
        tiles = slice(band * self.per_row, (band + 1) * self.per_row)
        self.gains[tiles] = self.linear_term(slice(band, band + 1)) - self.self_term[tiles]
        return tiles


def greedy_order(res: Residual, hessian: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` tiles of the exact greedy on D(S) (module docstring), in the order taken. Each band's best
    gain is cached, so a step scans the bands and the one band it changed, not every tile."""
    gains = TileGains(res, hessian)
    per_row = gains.per_row
    order, taken = [], torch.zeros(res.n_tiles, dtype=torch.bool, device=hessian.device)
    best, where = gains.gains.view(-1, per_row).max(dim=1)
    for _ in range(count):
        band = int(best.argmax())
        b = band * per_row + int(where[band])
        order.append(b)
        taken[b] = True
        tiles = gains.take(b)
        row = gains.gains[tiles].masked_fill_(taken[tiles], -math.inf)
        gains.gains[tiles] = row
        best[band], where[band] = row.max(dim=0)
    return torch.tensor(order, dtype=torch.int64, device=hessian.device)


def ranking(res: Residual, score: str, stats: LinearStats | None, count: int, seed: int = 0,
            sensitivity: torch.Tensor | None = None) -> torch.Tensor:
    """Tile ids, best first: at least the first `count` of the ranking by `score`. `sensitivity` replaces H_jj in
    the Δ-score (GPTQ's sweep: 1/[U]_jj², `sweep_sensitivity`)."""
    if score in NEEDS_HESSIAN and (stats is None or stats.hessian is None):
        raise ValueError(f"mosaic score {score!r} needs the layer's Hessian (calibration statistics)")
    if score == "greedy":
        return greedy_order(res, stats.hessian, count)
    if score == "exact":
        return torch.argsort(TileGains(res, stats.hessian).gains, descending=True, stable=True)
    if score == "random":
        return torch.randperm(res.n_tiles, generator=torch.Generator().manual_seed(seed)).to(res.tiles.device)
    if score == "magnitude":
        return torch.argsort(magnitude_scores(res), descending=True, stable=True)
    values = delta_scores(res, stats.hessian.diagonal() if sensitivity is None else sensitivity)
    return torch.argsort(values, descending=True, stable=True)


def sweep_sensitivity(weight: torch.Tensor, hessian: torch.Tensor, opts: GPTQOptions) -> torch.Tensor:
    """1/[U]_jj² per input column (original order), U the upper Cholesky factor of H⁻¹ in GPTQ's sweep order: the
    output error a unit error on column j costs once the columns before it are fixed and the later ones compensate
    (OBS); H_jj when H is diagonal."""
    prep, _ = prepare_hessian(hessian, weight, opts.damp, opts.act_order)
    d = prep.hinv_u.diagonal().pow(-2)
    return d if prep.perm is None else d[invert_permutation(prep.perm)]


def tile_count(budget: float, n_tiles: int) -> int:
    """Tiles a budget ρ keeps: ⌈ρ · n⌉ (at least one tile of any positive budget)."""
    return min(n_tiles, math.ceil(budget * n_tiles - 1e-9))


def select_tiles(res: Residual, stats: LinearStats | None, opts: MosaicOptions, way: str,
                 sensitivity: torch.Tensor | None = None) -> torch.Tensor:
    """The ⌈ρ·n⌉ best tiles of `res` by `opts.score` (`way`: "fitted" or "joint", what "auto" means)."""
    count = tile_count(opts.budget, res.n_tiles)
    score = AUTO[way] if opts.score == "auto" else opts.score
    return ranking(res, score, stats, count, opts.seed, sensitivity)[:count]


def mosaic_residual(weight: torch.Tensor, base: WeightFormat, stats: LinearStats | None,
                    opts: MosaicOptions) -> CompositeFormat:
    """base + the residual tiles `opts` selects, on E = W − base (module docstring): for a base without
    error feedback (RTN)."""
    block = (int(opts.block[0]), int(opts.block[1]))
    res = Residual.of(weight, base.dequantize(), block)
    index = select_tiles(res, stats, opts, "fitted")
    return CompositeFormat({"base": base, "residual": SparseBlockFormat.from_dense(res.error, index, block)})


def gptq_mosaic(weight: torch.Tensor, stats: LinearStats, spec: LayerSpec, gptq_opts: GPTQOptions,
                opts: MosaicOptions) -> CompositeFormat:
    """GPTQ onto the base + residual grid (module docstring). Tiles and their 4-bit steps are chosen on the RTN
    error of the grid GPTQ starts from, the Δ-score weighting column j by the sweep's 1/[U]_jj² instead of H_jj
    (it recovers more than H_jj and than magnitude: docs/methods/mosaicquant.md); in the sweep every
    weight of a chosen tile is quantized to q_base + s_tile·q_res (q_res ∈ [−8, 7], the rounding of what the base
    left) and the error feedback compensates what remains."""
    block = (int(opts.block[0]), int(opts.block[1]))
    g = resolve_group_size(spec.group_size, weight.shape[1])
    start = dequantize_groups(*quantize_groups(weight, UniformGrid(spec.bits, spec.sym), g, gptq_opts.mse), g)
    res = Residual.of(weight, start, block)
    sensitivity = sweep_sensitivity(weight, stats.hessian, gptq_opts) if opts.score in ("auto", "delta") else None
    index = select_tiles(res, stats, opts, "joint", sensitivity)
    _, tile_scales = quantize_tiles(res.tiles[index])
    per_tile = torch.zeros(res.n_tiles, device=weight.device)
    per_tile[index] = tile_scales
    step = from_blocks(per_tile[:, None].expand(-1, block[0] * block[1]), block, *weight.shape)  # 0 off the tiles
    codes = torch.zeros_like(weight)

    def add_residual(column: int, w: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        s = step[:, column]
        q = torch.where(s > 0, torch.clamp(torch.round((w - kept) / s.clamp(min=1e-30)), QMIN, QMAX), 0.0)
        codes[:, column] = q
        return kept + q * s

    base = gptq(weight, stats, spec, gptq_opts, column_hook=add_residual)
    residual = SparseBlockFormat.from_codes(index, to_blocks(codes, block)[index], tile_scales, *weight.shape, block)
    return CompositeFormat({"base": base, "residual": residual})


def mosaic_solve(weight: torch.Tensor, stats: LinearStats | None, spec: LayerSpec, solver: Solver, solver_opts: Any,
                 opts: MosaicOptions) -> tuple[CompositeFormat, WeightFormat]:
    """The MosaicQuant weight of one linear on `solver`'s base, and the solver's own weight without a residual (the
    reference its recovered distortion is measured against). RTN: the residual is fitted to the base's error; GPTQ:
    jointly (`gptq_mosaic`), since GPTQ's error is shaped by its feedback and a residual fitted to it afterwards
    raises the output distortion."""
    plain = solver(weight, stats, spec, solver_opts)
    if solver.name == "gptq":
        return gptq_mosaic(weight.float(), stats, spec, solver_opts, opts), plain
    return mosaic_residual(weight.float(), plain, stats, opts), plain


def recovery_curve(res: Residual, order: torch.Tensor, hessian: torch.Tensor,
                   budgets: Sequence[float]) -> list[float]:
    """Recovered fraction of the output distortion, 1 − D(S_ρ)/D(∅), keeping the first ⌈ρ·n⌉ tiles of
    `order` for each budget ρ; D measured with the full H (exact on the calibration inputs)."""
    before = hessian_error(res.error, None, hessian)
    out = []
    for rho in budgets:
        kept = order[:tile_count(rho, res.n_tiles)]
        after = hessian_error(res.error, res.dense(kept), hessian)
        out.append(1.0 - after / before if before > 0 else 0.0)
    return out


BASE_SOLVERS = ("rtn", "gptq")


@dataclass(frozen=True)
class ResidualMethod:
    """A registered residual: `fn(weight, stats, spec, solver, solver options, options)` -> (the weight with its
    residual, the solver's weight without one); `bases`: the solvers it can extend."""

    name: str
    fn: Callable[[torch.Tensor, LinearStats | None, LayerSpec, Solver, Any, Any], tuple[CompositeFormat, WeightFormat]]
    options: type
    bases: tuple[str, ...]

    def make_options(self, values: dict | None = None) -> MosaicOptions:
        return make_options(self.options, values, f"residual {self.name!r}")


RESIDUALS: Registry[ResidualMethod] = Registry("residual")
RESIDUALS.register("mosaic", ResidualMethod("mosaic", mosaic_solve, MosaicOptions, BASE_SOLVERS))
