"""llama.cpp's grid search for its block types (ggml-quants.c, `quantize_row_*_impl`), written for whole matrices.

Every function takes many rows of values at once (one row per sub-block or block) and returns per row what the C
function returns for one; `importance` is llama.cpp's imatrix (mean x² of each input channel; None: uncalibrated).

  make_qx    symmetric levels l ∈ [−nmax, nmax): start at 1/scale = −nmax/max (max: the value of largest |x|), try
             −(nmax + 0.1·i)/max for i = −9..9 and keep the weighted least-squares scale Σwxl/Σwl² with the largest
             (Σwxl)²/Σwl²                                                    (`make_qx_quants`, rmse_type 1)
  make_qkx   affine levels l ∈ [0, nmax] above min ≤ 0: try 1/scale = (nmax + rmin + rdelta·i)/(max − min),
             i = 0..nstep, refit scale and min by weighted least squares (min clamped to ≤ 0), keep the least
             Σw(scale·l + min − x)²                                          (`make_qkx3_quants`)
  make_qp    non-negative values (sub-block scales, minimums) on levels [0, nmax]: 1/scale = (nmax + 0.1·i)/max,
             i = −4..4, least weighted error, then up to 5 passes moving one level at a time while (Σwxl)²/Σwl² grows
                                                                             (`make_qp_quants`)

`fit` strings them together per type as llama.cpp does: per-value weights, the sub-block search, the super-block
quantization of the sub-block scales and minimums (part of the grid: d·sc and dmin·mn are what the file holds), then
each value rounded to nearest on the final grid (`round_to_grid`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

import torch

from bitquilt.formats.ggml_blocks import QK_K, Blocks, BlockType
from bitquilt.solvers.base import single_thread

EPS = 1e-15  # GROUP_MAX_EPS: a group below this is all zero
CHUNK = 2**18  # values fitted at a time: whole rows, temporaries that stay in cache (and bounded for a 150k-row table)


def _signed_max(x: torch.Tensor) -> torch.Tensor:
    """Per row, the value of largest magnitude (its sign kept)."""
    return x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)


def make_qx(x: torch.Tensor, nmax: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale [N] and levels [N, n] in [−nmax, nmax) of x ≈ scale·l (module docstring)."""
    peak = _signed_max(x)
    zero = peak.abs() < EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)

    wx = w * x

    def attempt(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        levels = torch.round(iscale.unsqueeze(-1) * x).clamp_(-nmax, nmax - 1)
        return levels, (wx * levels).sum(-1), (w * levels * levels).sum(-1)

    best_l, sumlx, suml2 = attempt(-nmax / peak)
    scale = torch.where(suml2 > 0, sumlx / suml2.clamp(min=1e-30), torch.zeros_like(sumlx))
    best = scale * sumlx
    for i in [*range(-9, 0), *range(1, 10)]:
        levels, slx, sl2 = attempt(-(nmax + 0.1 * i) / peak)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        best_l = torch.where(better.unsqueeze(-1), levels, best_l)
        scale = torch.where(better, slx / sl2.clamp(min=1e-30), scale)
        best = torch.where(better, scale * slx, best)
    return torch.where(zero, torch.zeros_like(scale), scale), best_l


def make_qkx(x: torch.Tensor, nmax: int, w: torch.Tensor, rmin: float = -0.9, rdelta: float = 0.05,
             nstep: int = 36) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale [N] and minimum m ≥ 0 [N] of x ≈ scale·l − m, l ∈ [0, nmax] (module docstring). The weighted error
    Σw(s·l + μ − x)² is expanded into the sums the least-squares fit needs anyway."""
    low = x.min(-1).values.clamp(max=0)
    span = x.max(-1).values - low
    flat = span <= 0
    span = torch.where(flat, torch.ones_like(span), span)
    wx = w * x
    sum_w, sum_x, sum_x2 = w.sum(-1), wx.sum(-1), (wx * x).sum(-1)
    shifted = x - low.unsqueeze(-1)

    def fitted(iscale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        levels = torch.round(shifted * iscale.unsqueeze(-1)).clamp_(0, nmax)
        wl = w * levels
        return wl.sum(-1), (wl * levels).sum(-1), (wx * levels).sum(-1)

    def error(s: torch.Tensor, m: torch.Tensor, sum_l: torch.Tensor, sum_l2: torch.Tensor,
              sum_xl: torch.Tensor) -> torch.Tensor:
        return (s * s * sum_l2 + 2 * s * m * sum_l - 2 * s * sum_xl + m * m * sum_w - 2 * m * sum_x + sum_x2)

    scale, minimum = span / nmax, low
    best = error(scale, minimum, *fitted(nmax / span))
    for i in range(nstep + 1):
        sum_l, sum_l2, sum_xl = fitted((rmin + rdelta * i + nmax) / span)
        det = sum_w * sum_l2 - sum_l * sum_l
        safe = torch.where(det > 0, det, torch.ones_like(det))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0
        this_scale = torch.where(positive, sum_xl / sum_l2.clamp(min=1e-30), this_scale)
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        err = error(this_scale, this_min, sum_l, sum_l2, sum_xl)
        better = (det > 0) & (err < best)
        scale, minimum = torch.where(better, this_scale, scale), torch.where(better, this_min, minimum)
        best = torch.where(better, err, best)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale, -minimum


def make_qp(x: torch.Tensor, nmax: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale [N] and levels [N, n] in [0, nmax] of non-negative x ≈ scale·l (module docstring)."""
    x = x.clamp(min=0)
    peak = x.max(-1).values
    zero = peak < EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)

    def mse(iscale: torch.Tensor) -> torch.Tensor:
        levels = torch.round(iscale.unsqueeze(-1) * x).clamp(max=nmax)
        return (w * (x - levels / iscale.unsqueeze(-1)).square()).sum(-1)

    iscale = nmax / peak
    best = mse(iscale)
    for i in [-4, -3, -2, -1, 1, 2, 3, 4]:
        candidate = (nmax + 0.1 * i) / peak
        err = mse(candidate)
        better = err < best
        iscale, best = torch.where(better, candidate, iscale), torch.where(better, err, best)
    levels = torch.round(iscale.unsqueeze(-1) * x).clamp(0, nmax)
    sumlx, suml2 = (w * x * levels).sum(-1), (w * levels * levels).sum(-1)
    for _ in range(5):
        changed = False
        for i in range(x.shape[-1]):
            wi, xi, li = w[:, i], x[:, i], levels[:, i]
            slx, sl2 = sumlx - wi * xi * li, suml2 - wi * li * li
            ok = (slx > 0) & (sl2 > 0)
            new = torch.round(xi * sl2 / torch.where(ok, slx, torch.ones_like(slx))).clamp(0, nmax)
            slx, sl2 = slx + wi * xi * new, sl2 + wi * new * new
            take = ok & (new != li) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            if take.any():
                changed = True
                levels[:, i] = torch.where(take, new, li)
                sumlx, suml2 = torch.where(take, slx, sumlx), torch.where(take, sl2, suml2)
        if not changed:
            break
    scale = torch.where((suml2 > 0) & ~zero, sumlx / suml2.clamp(min=1e-30), torch.zeros_like(sumlx))
    return scale, torch.where(zero.unsqueeze(-1), torch.zeros_like(levels), levels)


# ---------------------------------------------------------------- per type
def value_weights(x: torch.Tensor, importance: torch.Tensor | None, t: BlockType) -> torch.Tensor:
    """llama.cpp's per-value weights for block values x [R, nb, block]: qw·√(σ² + x²) with qw the imatrix entry and
    σ² the mean square of the super-block (×2 for Q3_K–Q5_K) or, for the 32-value types, of the whole row; without an
    imatrix x² (Q3_K, Q6_K), √σ² + |x| (Q4_K, Q5_K), or qw = 1 (Q2_K and the 32-value types, where llama.cpp falls
    back to a plain max/min rule)."""
    if t.block == QK_K:
        sigma2 = x.square().mean(-1, keepdim=True) * (1 if t.name == "Q2_K" else 2)
    else:
        sigma2 = x.square().mean(dim=(1, 2), keepdim=True)
    if importance is None:
        if t.name in ("Q3_K", "Q6_K"):
            return x.square()
        if t.name in ("Q4_K", "Q5_K"):
            return sigma2.sqrt() + x.abs()
        return (sigma2 + x.square()).sqrt()
    qw = importance.view(1, x.shape[1], x.shape[2]).to(x.dtype)
    if t.name == "Q6_K":  # llama.cpp weighs Q6_K by the imatrix alone
        return qw.expand_as(x)
    return qw * (sigma2 + x.square()).sqrt()


def _fit_scales(x: torch.Tensor, w: torch.Tensor, t: BlockType) -> Blocks:
    """Block fields but the codes for values x [R, nb, block] with weights w."""
    rows, nb, _ = x.shape
    xs, ws = x.reshape(-1, t.sub), w.reshape(-1, t.sub)
    sw = ws.sum(-1).view(rows * nb, t.subs)
    mn = dmin = None
    if t.name in ("Q2_K", "Q4_K", "Q5_K"):
        scales, mins = make_qkx(xs, t.maxq, ws)
        nmax = 2**t.scale_bits - 1
        d, sc = make_qp(scales.view(rows * nb, t.subs), nmax, sw)
        dmin, mn = make_qp(mins.view(rows * nb, t.subs), nmax, sw)
    elif t.name == "Q3_K":
        scales, _ = make_qx(xs, 4, ws)
        d, sc = make_qx(scales.view(rows * nb, t.subs), 32, sw)
        sc = sc + 32
    elif t.name == "Q6_K":
        scales, _ = make_qx(xs, 32, ws)
        scales = scales.view(rows * nb, t.subs)
        peak = _signed_max(scales)
        zero = peak.abs() < EPS
        iscale = -128 / torch.where(zero, torch.ones_like(peak), peak)
        d = torch.where(zero, torch.zeros_like(peak), 1 / iscale)
        sc = torch.round(iscale.unsqueeze(-1) * scales).clamp(-128, 127)
    elif t.name == "Q8_0":
        d, sc = xs.abs().max(-1).values / 127, torch.ones(rows * nb, 1)
    elif t.name == "Q5_1":
        d, dmin = make_qkx(xs, t.maxq, ws)
        sc = mn = torch.ones(rows * nb, 1)
    else:  # Q4_0, Q5_0
        d, _ = make_qx(xs, t.code_zero, ws)
        sc = torch.ones(rows * nb, 1)

    def subs(v: torch.Tensor | None) -> torch.Tensor | None:
        return None if v is None else v.to(torch.int16).view(rows, nb, t.subs)

    def half(v: torch.Tensor | None) -> torch.Tensor | None:
        return None if v is None else v.to(torch.float16).view(rows, nb)

    q = torch.zeros(rows, nb, t.block, dtype=torch.uint8)
    return Blocks(q, subs(sc), subs(mn), half(d), half(dmin))


def column_steps(blocks: Blocks, t: BlockType) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) of every value, fp32 [R, in]: ŵ = a·(q − code_zero) − b (b = 0 without minimums)."""
    a, b = blocks.steps(t)
    rows = a.shape[0]
    a = a.repeat_interleave(t.sub, dim=-1).reshape(rows, -1)
    b = torch.zeros_like(a) if b is None else b.repeat_interleave(t.sub, dim=-1).reshape(rows, -1)
    return a, b


def round_to_grid(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, t: BlockType,
                  rounding: Callable[[torch.Tensor], torch.Tensor] = torch.round,
                  offset: torch.Tensor | None = None) -> torch.Tensor:
    """Codes (float) of w on the grid (a, b), nearest level (`rounding` of the position plus `offset`, e.g. learned
    rounding offsets); code_zero where the step a is 0 (any code gives −b)."""
    safe = torch.where(a == 0, torch.ones_like(a), a)
    x = (w + b) / safe
    q = rounding(x if offset is None else x + offset) + t.code_zero
    return torch.where(a == 0, torch.full_like(q, t.code_zero), q.clamp(0, t.maxq))


def fit(w: torch.Tensor, t: BlockType, importance: torch.Tensor | None = None) -> Blocks:
    """The grid llama.cpp's search fits to w [R, in] (importance: [in] or None) and w's codes on it, ROWS rows at a
    time."""
    if w.shape[1] % t.block:
        raise ValueError(f"{t.name} needs rows of a multiple of {t.block} values, got {w.shape[1]}")
    parts, rows = [], max(1, CHUNK // w.shape[1])
    with single_thread():  # many small ops on cache-sized chunks: threads only add barriers (14× slower measured)
        for i in range(0, w.shape[0], rows):
            x = w[i:i + rows].float()
            xb = x.view(x.shape[0], -1, t.block)
            blocks = _fit_scales(xb, value_weights(xb, importance, t), t)
            a, b = column_steps(blocks, t)
            blocks.q = round_to_grid(x, a, b, t).to(torch.uint8).view_as(blocks.q)
            parts.append(blocks)
    return concat(parts)


def concat(parts: list[Blocks]) -> Blocks:
    """Blocks of consecutive row ranges as one."""
    return Blocks(*(None if getattr(parts[0], f.name) is None else torch.cat([getattr(p, f.name) for p in parts])
                    for f in fields(Blocks)))
