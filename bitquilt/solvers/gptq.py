"""GPTQ (Frantar et al., 2023): column-by-column quantization with inverse-Hessian error feedback.

For each column j (in act-order if asked), q_j = quant(w_j) and the error
e_j = (w_j − q_j) / [H⁻¹]_jj is pushed onto the columns not yet quantized:
W[:, j+1:] −= e_j · [H⁻¹]_{j, j+1:}, using the upper Cholesky factor U of H⁻¹ (lazy batch
updates every `block_size` columns). Group scales are fitted from the *updated* weights of
the group when its first column is reached (or from the original weights with
`static_groups`, which keeps groups contiguous under act-order).

Default: act-order with static groups. It beats the plain sweep at every width measured
(docs/methods/gptq.md, bench/results/accuracy.md) and, unlike dynamic groups, keeps each group's columns
contiguous, so the packed layout and its kernels are unchanged. `act_order=False` gives the original paper's sweep.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bitquilt.formats.uniform import UniformFormat, UniformGrid, n_groups, resolve_group_size
from bitquilt.registry import option
from bitquilt.solvers.base import LayerSpec, LinearStats, check_finite, register_solver, single_thread
from bitquilt.solvers.hessian import invert_permutation, prepare_hessian
from bitquilt.solvers.rtn import quantize_groups


@dataclass(frozen=True)
class GPTQOptions:
    damp: float = option(0.01, "Hessian dampening, a fraction of its mean diagonal")
    block_size: int = option(128, "columns per lazy update of the sweep")
    act_order: bool = option(True, "sweep columns by decreasing Hessian diagonal (off: the original column order)")
    static_groups: bool = option(True, "with act-order, fit group grids before the sweep so groups stay contiguous")
    mse: bool = option(True, "search each group's range (shrunk min-max) for the least error, not plain min-max")

    def __post_init__(self) -> None:
        check_damp(self.damp, "gptq")
        check_block_size(self.block_size, "gptq")


def check_damp(damp: float, solver: str) -> None:
    """Raise ValueError unless `damp` is a finite λ ≥ 0: the fraction of the Hessian's mean diagonal added to it."""
    if not (math.isfinite(damp) and damp >= 0):
        raise ValueError(f"solver {solver!r}: damp must be ≥ 0 (a fraction of the Hessian's mean diagonal; typical "
                         f"0.01-0.1, 0 = none), got {damp}")


def check_block_size(block_size: int, solver: str) -> None:
    """Raise ValueError unless `block_size`, the columns per lazy update of the sweep, is positive."""
    if block_size < 1:
        raise ValueError(f"solver {solver!r}: block_size must be ≥ 1 (columns per lazy update of the sweep; typical "
                         f"128), got {block_size}")


def sweep_columns(
    W1: torch.Tensor, U1: torch.Tensor, E1: torch.Tensor, Q1: torch.Tensor, quantize_column, offset: int = 0
) -> None:
    """GPTQ's per-column step over the columns of one block (starting at column `offset`), in place.

    For each column i, q = `quantize_column(offset + i, W1, i)`, e_i = (w_i − q) / U_ii and
    W1[:, i:] −= e_i · U1[i, i:]. Q1 receives the quantized columns and E1 the scaled errors,
    so that W1_start = Q1 + E1·U1.
    """
    diagonal = U1.diagonal().tolist()  # Python floats: no tensor indexing per column
    for i in range(W1.shape[1]):
        w = W1[:, i]
        q = quantize_column(offset + i, W1, i)
        Q1[:, i] = q
        err = (w - q).div_(diagonal[i])
        W1[:, i:].addr_(err, U1[i, i:], alpha=-1)
        E1[:, i] = err


def gptq_sweep(
    W: torch.Tensor, hinv_u: torch.Tensor, block_size: int, quantize_column=None, quantize_block=None
) -> torch.Tensor:
    """The GPTQ column sweep with lazy block updates; W is updated in place, returns the quantized matrix.

    Per column, `quantize_column(j, W_block, i)` returns the quantized column j (shared by every
    solver whose per-column step is 'project onto my grid'). A solver that works on whole blocks
    passes `quantize_block(i1, W1, U1, E1, Q1)` instead: it must fill Q1 and E1 for the block
    starting at column i1 with W1_start = Q1 + E1·U1 (e.g. with `sweep_columns`); the columns
    after the block are then updated from E1.
    """
    rows, cols = W.shape
    Q = torch.zeros_like(W)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = hinv_u[i1:i2, i1:i2]
        with single_thread():  # column steps are tiny ops: OpenMP barriers would dominate them
            if quantize_block is None:
                sweep_columns(W1, U1, E1, Q[:, i1:i2], quantize_column, i1)
            else:
                quantize_block(i1, W1, U1, E1, Q[:, i1:i2])
        W[:, i2:] -= E1 @ hinv_u[i1:i2, i2:]
    return Q


ColumnHook = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@register_solver("gptq", GPTQOptions)
def gptq(weight: torch.Tensor, stats: LinearStats | None, spec: LayerSpec, opts: GPTQOptions,
         column_hook: ColumnHook | None = None) -> UniformFormat:
    """The GPTQ sweep (module docstring). `column_hook(c, w, q)`, given column c of the weight (original order),
    its current updated values w and their quantization q on the grid, returns the value the sweep keeps instead
    (e.g. q plus a residual branch's correction, `bitquilt.solvers.mosaic`): the error feedback then compensates
    what the whole weight, not the grid alone, leaves."""
    check_finite(weight)
    rows, cols = weight.shape
    g = resolve_group_size(spec.group_size, cols)
    grid = UniformGrid(spec.bits, spec.sym)
    prep, W = prepare_hessian(stats.hessian, weight, opts.damp, opts.act_order)
    perm = prep.perm
    scales = torch.zeros(rows, n_groups(cols, g), device=W.device)
    zeros = torch.zeros_like(scales)
    codes = torch.zeros_like(W)
    fit = grid.fit_mse if opts.mse else grid.fit

    # Groups whose parameters are fixed before the sweep: per-channel, or static groups.
    fixed = g == cols or opts.static_groups
    if fixed:
        W_orig = W[:, invert_permutation(perm)] if perm is not None else W
        _, scales, zeros = quantize_groups(W_orig, grid, g, opts.mse)
    group_of = ((perm if perm is not None else torch.arange(cols, device=W.device)) // g).tolist() if fixed else None

    def quantize_column(j: int, W1: torch.Tensor, i: int) -> torch.Tensor:
        if fixed:
            grp = group_of[j]
        else:
            grp = j // g
            if j % g == 0:
                # the group's columns still inside this block are taken updated, later ones as they stand
                group_cols = torch.cat([W1[:, i:], W[:, j - i + W1.shape[1]:]], dim=1)[:, :g]
                scales[:, grp], zeros[:, grp] = fit(group_cols)
        s, z = scales[:, grp], zeros[:, grp]
        q = torch.clamp(torch.round(W1[:, i] / s) + z, 0, grid.maxq)
        codes[:, j] = q
        kept = s * (q - z)
        if column_hook is None:
            return kept
        return column_hook(int(perm[j]) if perm is not None else j, W1[:, i], kept)

    gptq_sweep(W, prep.hinv_u, opts.block_size, quantize_column)

    g_idx = None
    if perm is not None:
        inv = invert_permutation(perm)
        codes = codes[:, inv]
        if not fixed:
            g_idx = (torch.arange(cols, device=W.device) // g)[inv]
    return UniformFormat.from_codes(codes, scales, zeros, grid, g, g_idx=g_idx)
