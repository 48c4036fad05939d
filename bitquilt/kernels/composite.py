"""Multi-part weights through their parts' kernels, tokens grouped by how many parts they use.

For a `CompositeFormat` with parts P_1..P_E (and optional column permutation perm),

    y_t = Σ_{e ≤ k_t} x_t[perm] P_eᵀ

with k_t = `ctx.slices[t]` (every part without a per-token context). Tokens are sorted by k_t
descending once, so the tokens that use part e are a leading run of the sorted batch: part e is
one call of its own kernel (e.g. the bit-plane LUT kernel for MoBiQuant slices) on the first
n_e = #{t : k_t ≥ e} rows, and a token costs only the bits of the slices it uses. A part no
kernel takes runs its format's torch reference. When the parts pack alike (MoBiQuant's slices),
the tokens are instead grouped by k_t and each group runs its k slices as one call
(`cpu.matmul_parts`): one set of activation tables for a few tokens, or, for a batch (prefill,
calibration), rows of Σ_{e ≤ k} P_e dequantized and multiplied once: one sgemm instead of k.
Tested against `CompositeFormat.reference_matmul`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from bitquilt.formats.base import MatmulContext, WeightFormat
from bitquilt.formats.composite import CompositeFormat
from bitquilt.kernels.options import options
from bitquilt.kernels.registry import dispatch, register_kernel


def part_matmul(part: WeightFormat, x: torch.Tensor) -> torch.Tensor:
    """x @ P_eᵀ by the part's kernel, else its reference."""
    y = dispatch(part, x) if options().enabled else None
    return part.reference_matmul(x) if y is None else y


def count_range(x: torch.Tensor, counts: torch.Tensor, n_parts: int) -> tuple[int, int]:
    """(min, max) of the per-token part counts of x [T, in], after checking there is one per token in [0, n_parts]
    (a single count serves every token)."""
    if counts.numel() != 1 and counts.shape != x.shape[:1]:
        raise ValueError(f"per-token slices of shape {tuple(counts.shape)} for {x.shape[0]} tokens")
    low, high = (int(counts),) * 2 if counts.numel() == 1 else (int(counts.min()), int(counts.max()))
    if low < 0 or high > n_parts:
        raise ValueError(f"per-token slice counts must lie in [0, {n_parts}]")
    return low, high


def grouped_matmul(x: torch.Tensor, counts: torch.Tensor, parts: Sequence[Callable[[torch.Tensor], torch.Tensor]],
                   out_features: int) -> torch.Tensor:
    """y_t = Σ_{e ≤ counts[t]} parts[e − 1](x_t) for x [T, in]: each part called once, on the tokens that use it."""
    low, high = count_range(x, counts, len(parts))
    if low == high:  # every token the same count (static precision, batch-1 decode): no regrouping
        if high == 0:
            return x.new_zeros(x.shape[0], out_features)
        y = parts[0](x)
        for part in parts[1:high]:
            y += part(x)
        return y
    ordered, order = torch.sort(counts, descending=True, stable=True)
    sorted_x = x[order].contiguous()
    y = x.new_zeros(x.shape[0], out_features)
    for e, part in enumerate(parts[:high], start=1):
        n = int((ordered >= e).sum())
        y[:n] += part(sorted_x[:n])
    out = torch.empty_like(y)
    out[order] = y
    return out


def per_count(x: torch.Tensor, counts: torch.Tensor, n_parts: int, out_features: int,
              product: Callable[[int, torch.Tensor], torch.Tensor | None]) -> torch.Tensor | None:
    """y_t = product(k_t, x_t) for x [T, in], the tokens grouped by their count k_t: one call per count present
    (count 0 gives zeros); None as soon as a call returns None."""
    low, high = count_range(x, counts, n_parts)
    if low == high:  # every token the same count: no regrouping
        return x.new_zeros(x.shape[0], out_features) if high == 0 else product(high, x)
    y = x.new_zeros(x.shape[0], out_features)
    for k in torch.unique(counts).tolist():
        if k == 0:
            continue
        rows = (counts == k).nonzero().squeeze(1)
        part = product(k, x[rows])
        if part is None:
            return None
        y[rows] = part.to(y.dtype)  # under autocast a product may come back in bf16
    return y


def prefix_matmul(x: torch.Tensor, counts: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """y_t = x_t (Σ_{e ≤ counts[t]} W_e)ᵀ for dense weights W_e [out, in]: one product per count present with the
    running sum of the weights (every token multiplied once, whatever its count)."""
    @functools.cache
    def prefix_sum(k: int) -> torch.Tensor:  # counts come in ascending order: each sum extends the one before
        return weights[0] if k == 1 else prefix_sum(k - 1) + weights[k - 1]

    return per_count(x, counts, len(weights), weights[0].shape[0], lambda k, rows: rows @ prefix_sum(k).t())


def matmul(fmt: WeightFormat, x: torch.Tensor, ctx: MatmulContext | None = None) -> torch.Tensor | None:
    """x [T, in] @ Ŵᵀ of a composite format, per-token slice counts honoured (module docstring)."""
    if not isinstance(fmt, CompositeFormat) or x.dim() != 2:
        return None
    if fmt.perm is not None:
        x = x[:, fmt.perm.long()]
    formats = list(fmt.parts.values())
    counts = torch.tensor(len(formats)) if ctx is None or ctx.slices is None else ctx.slices
    y = by_count(formats, x, counts, fmt.out_features) if options().enabled else None
    if y is not None:
        return y
    return grouped_matmul(x, counts, [functools.partial(part_matmul, p) for p in formats], fmt.out_features)


def by_count(formats: list[WeightFormat], x: torch.Tensor, counts: torch.Tensor, out_features: int
             ) -> torch.Tensor | None:
    """y_t = x_t (Σ_{e ≤ k_t} P_e)ᵀ with the tokens grouped by k_t, each group's slices in one `cpu.matmul_parts`
    call; None when the parts do not pack alike (the caller then runs them part by part)."""
    from bitquilt.kernels import cpu  # builds the extension on first use, like every kernel

    return per_count(x, counts, len(formats), out_features, lambda k, rows: cpu.matmul_parts(formats[:k], rows))


def register() -> bool:
    """Register the by-parts kernel (it needs no extension: its parts' kernels decide)."""
    register_kernel("composite", "by_parts", matmul)
    return True
