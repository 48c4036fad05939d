"""MXINT solvers: weights onto the MXINT-m grid (`bitquilt.formats.mxint`), one or several mantissa widths.

A linear's columns are put in an order (identity, decreasing Hessian diagonal, or random) and
split into classes of whole 32-column blocks, each with its own width, e.g. ((8, 32), (6, 64),
(4, 480)): the first 32 columns of the order get 8-bit elements, the next 64 6-bit, the rest 4.
Without classes every column gets `--w-bits` (uniform MXINT4/6/8). The classes of each linear are
normally chosen by the `mx_sens` policy (`bitquilt.policies.mx_sens`), which sets them per linear.

Each block is rounded to nearest on its own shared exponent, or, with `error_feedback`, swept
column by column in the stored order with GPTQ's inverse-Hessian error feedback, each block's
exponent fitted when the sweep reaches it (from the weights as updated so far).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitquilt.formats.mxint import BLOCK, MXIntFormat, qmax, shared_exponents, step_size
from bitquilt.registry import option
from bitquilt.solvers.base import LayerSpec, LinearStats, check_finite, register_solver
from bitquilt.solvers.gptq import check_damp, gptq_sweep
from bitquilt.solvers.hessian import prepare_hessian

ORDERS = ("identity", "hessian", "random")


@dataclass(frozen=True)
class MXIntOptions:
    classes: tuple | None = option(None, "column classes ((bits, columns), ...) in column order; None: all at "
                                   "--w-bits (the mx_sens policy sets them per linear)")
    order: str = option("identity", "column order the classes take: identity, hessian (decreasing diag(H): the "
                        "most sensitive columns first) or random")
    order_seed: int = option(0, "seed of the random column order")
    error_feedback: bool = option(False, "GPTQ-style inverse-Hessian error feedback onto the MXINT grid")
    damp: float = option(0.01, "Hessian dampening, a fraction of its mean diagonal")

    def __post_init__(self) -> None:
        check_damp(self.damp, "mxint")


def needs_hessian(opts: MXIntOptions) -> bool:
    return opts.order == "hessian" or opts.error_feedback


def resolve_classes(classes: tuple | None, bits: int, in_features: int) -> tuple[list[int], list[int]]:
    """(widths, columns) of the non-empty classes, checked against the layer's width."""
    pairs = [(bits, in_features)] if classes is None else [(int(m), int(n)) for m, n in classes]
    pairs = [(m, n) for m, n in pairs if n > 0]
    if sum(n for _, n in pairs) != in_features or any(n % BLOCK for _, n in pairs):
        raise ValueError(f"MXINT column classes {pairs} must be whole {BLOCK}-column blocks adding up to the "
                         f"layer's {in_features} input columns")
    return [m for m, _ in pairs], [n for _, n in pairs]


def column_order(order: str, stats: LinearStats | None, in_features: int, seed: int) -> torch.Tensor | None:
    """The stored column order, perm [in] (None: identity)."""
    if order == "identity":
        return None
    if order == "hessian":
        return torch.argsort(torch.diagonal(stats.hessian), descending=True, stable=True)
    if order == "random":
        return torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    raise ValueError(f"unknown MXINT column order {order!r}; use one of {', '.join(ORDERS)}")


def error_feedback_codes(w: torch.Tensor, hessian: torch.Tensor, widths_per_block: torch.Tensor,
                         damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's sweep over w [out, in] (stored order, `hessian` in the same order) onto MXINT blocks of the
    given widths: (elements q [out, in], exponents e [out, in/32])."""
    prep, W = prepare_hessian(hessian, w, damp)
    q = torch.zeros_like(W)
    e = torch.zeros(W.shape[0], W.shape[1] // BLOCK, dtype=torch.int32, device=W.device)
    steps = torch.zeros(W.shape[0], W.shape[1] // BLOCK, device=W.device)

    def quantize_column(j: int, W1: torch.Tensor, i: int) -> torch.Tensor:
        b, m = j // BLOCK, int(widths_per_block[j // BLOCK])
        if j % BLOCK == 0:  # the block's columns inside this sweep block are updated ones, later ones as they stand
            block = torch.cat([W1[:, i:], W[:, j - i + W1.shape[1]:]], dim=1)[:, :BLOCK]
            e[:, b] = shared_exponents(block, m)
            steps[:, b] = step_size(e[:, b], m)
        q[:, j] = torch.clamp(torch.round(W1[:, i] / steps[:, b]), -qmax(m), qmax(m))
        return q[:, j] * steps[:, b]

    gptq_sweep(W, prep.hinv_u, 4 * BLOCK, quantize_column)
    return q, e


@register_solver("mxint", MXIntOptions, needs_stats=needs_hessian, produces=MXIntFormat)
def mxint(weight: torch.Tensor, stats: LinearStats | None, spec: LayerSpec, opts: MXIntOptions) -> MXIntFormat:
    check_finite(weight)
    widths, columns = resolve_classes(opts.classes, spec.bits, weight.shape[1])
    perm = column_order(opts.order, stats, weight.shape[1], opts.order_seed)
    if not opts.error_feedback:
        return MXIntFormat.quantize(weight, widths, columns, perm)
    w, h = (weight, stats.hessian) if perm is None else (weight[:, perm], stats.hessian[perm][:, perm])
    per_block = torch.repeat_interleave(torch.tensor(widths), torch.tensor(columns) // BLOCK)
    q, e = error_feedback_codes(w, h, per_block, opts.damp)
    return MXIntFormat.from_codes(q, e, widths, columns, perm)
