"""MXSens allocation: which columns of each linear get 8-, 6- or 4-bit MXINT elements.

A whole-model pre-pass policy (Harma et al., 2026, "MXSens"):

1. Layer sensitivity. For each quantized linear l alone, its weight is replaced by its MXINT-b
   version (b = the linear's base width, 4) and the model's final output (the normed last
   hidden state) is compared with the full-precision one on calibration windows:
       s_l = ‖Y_l − Y‖² / ‖Y‖²,   normalised to mean 1 over the linears (ŝ_l = s_l / mean s).
   Only the blocks from l's on are re-run, from the full-precision hidden state at l's block,
   in passes over the blocks that carry many linears' streams at once (`layer_sensitivities`;
   under streaming each block is read from disk once per pass). The result depends only on the
   model and the calibration windows, so it is kept on disk (`$BITQUILT_CACHE/mx_sens/`), keyed
   by a hash of the full-precision output itself: a sweep over targets or ablations measures it
   once.
2. Triplet allocation. In every linear the `top_columns` (32) most sensitive columns by the
   Hessian diagonal get `top_bits` (8); then
       n_l = min(K_l − 32, R · ŝ_l · (K_l − 32))   columns get `middle_bits` (6), rounded to
   whole 32-column blocks, and the rest the base width. One global R is found by bisection so
   that the element bits averaged over all quantized weights,
       B = Σ_l out_l·(m_top·32 + m_mid·n_l + m_base·(K_l − 32 − n_l)) / Σ_l out_l·K_l,
   hit `target_bits` (R is solved on the continuous n_l, then each n_l is rounded to the
   nearest block: B is within one block per linear of the target). Like the paper, B counts
   element bits; the shared 8-bit exponent adds 8/32 = 0.25 bits to every weight alike.
3. The classes and the column order ("hessian": decreasing diag(H), decided by the solver from
   the statistics it collects) go into each linear's plan params, which the `mxint` solver reads.

Ablations: `layers="uniform"` gives every linear the same ŝ = 1, `columns="random"` a random
column order, `middle_bits=8` the 4/8-only split at the same average.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bitquilt import cache
from bitquilt.calib.capture import capture_block_inputs, run_block
from bitquilt.calib.stages import ModelContext, register_stage
from bitquilt.formats import mxint
from bitquilt.registry import option

BLOCK = mxint.BLOCK


@dataclass(frozen=True)
class MXSensOptions:
    target_bits: float = option(4.25, "average element bits per weight over the quantized linears (shared exponents "
                                "excluded, as in the paper)")
    top_bits: int = option(8, "width of each linear's most sensitive columns")
    top_columns: int = option(32, "columns at top_bits in every linear (whole 32-column blocks)")
    middle_bits: int = option(6, "width of the columns shared out by layer sensitivity (8: the 4/8-only split)")
    layers: str = option("sensitivity", "how the middle columns are shared among linears: sensitivity (measured) "
                         "or uniform (the same fraction everywhere)")
    columns: str = option("hessian", "which columns take the wider classes: hessian (decreasing diag(H)) or random")
    samples: int = option(4, "calibration windows the layer sensitivity is measured on")
    stream_mb: float = option(256, "MB of perturbed hidden states the sensitivity pass holds at once; linears "
                              "beyond them take further passes over the blocks (same result)")


@dataclass(frozen=True)
class LinearShape:
    out_features: int
    in_features: int
    base_bits: int


def _middle(shape: LinearShape, top: int, weight: float, r: float) -> float:
    room = shape.in_features - top
    return min(float(room), r * weight * room)


def element_bits(shapes: dict[str, LinearShape], classes: dict[str, tuple]) -> float:
    """Σ out·Σ_c m_c·n_c / Σ out·in over the linears: the average element bits of an allocation."""
    total = sum(s.out_features * s.in_features for s in shapes.values())
    return sum(shapes[n].out_features * sum(m * c for m, c in cls) for n, cls in classes.items()) / total


def bits_range(shapes: dict[str, LinearShape], top_bits: int = 8, middle_bits: int = 6,
               top_columns: int = BLOCK) -> tuple[float, float]:
    """The reachable average element bits: only the top columns wide, and every other column at middle_bits."""
    top = {n: min(top_columns, s.in_features) for n, s in shapes.items()}

    def with_rest(bits_of) -> float:
        return element_bits(shapes, {n: ((top_bits, top[n]), (bits_of(s), s.in_features - top[n]))
                                     for n, s in shapes.items()})

    return with_rest(lambda s: s.base_bits), with_rest(lambda s: middle_bits)


def model_shapes(model: nn.Module, names: list[str], base_bits: int) -> dict[str, LinearShape]:
    """The LinearShape of each named linear of `model`."""
    return {n: LinearShape(*model.get_submodule(n).weight.shape, base_bits) for n in names}


def check_target(shapes: dict[str, LinearShape], target_bits: float, top_bits: int = 8, middle_bits: int = 6,
                 top_columns: int = BLOCK) -> None:
    """Raise ValueError unless the widths nest (base < middle ≤ top) and `target_bits` is reachable for `shapes`
    (`bits_range`): what `allocate` needs, known from the shapes alone, so checked before any measurement."""
    narrow = sorted({s.base_bits for s in shapes.values() if not s.base_bits < middle_bits <= top_bits})
    if narrow:
        raise ValueError(f"mx_sens needs base bits < middle_bits ({middle_bits}) ≤ top_bits ({top_bits}); linears "
                         f"with base bits {narrow} do not fit (set --w-bits 4, the base width)")
    low, high = bits_range(shapes, top_bits, middle_bits, top_columns)
    if not low - 1e-9 <= target_bits <= high + 1e-9:
        raise ValueError(f"target of {target_bits:g} element bits per weight is out of reach for this model: "
                         f"{low:.3f} (only the top {top_columns} columns of each linear at {top_bits} bits) to "
                         f"{high:.3f} (every other column at {middle_bits} bits)")


def allocate(shapes: dict[str, LinearShape], weights: dict[str, float], target_bits: float, top_bits: int = 8,
             middle_bits: int = 6, top_columns: int = BLOCK) -> tuple[dict[str, tuple], float]:
    """Classes ((top_bits, 32), (middle_bits, n_l), (base, rest)) per linear and the global R hitting
    `target_bits` (see the module docstring); raises if the target is out of reach (`check_target`)."""
    check_target(shapes, target_bits, top_bits, middle_bits, top_columns)
    top = {n: min(top_columns, s.in_features) for n, s in shapes.items()}
    total = sum(s.out_features * s.in_features for s in shapes.values())

    def bits(r: float) -> float:
        return sum(s.out_features * (s.base_bits * s.in_features + (top_bits - s.base_bits) * top[n]
                                     + (middle_bits - s.base_bits) * _middle(s, top[n], weights[n], r))
                   for n, s in shapes.items()) / total

    r_max = 1.0 / max(min(weights.values()), 1e-12)  # every linear's middle class full
    lo, hi = 0.0, r_max
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if bits(mid) <= target_bits else (lo, mid)
    r = (lo + hi) / 2
    classes = {}
    for n, s in shapes.items():
        n_mid = BLOCK * round(_middle(s, top[n], weights[n], r) / BLOCK)
        n_base = s.in_features - top[n] - n_mid
        classes[n] = ((top_bits, top[n]), (middle_bits, n_mid), (s.base_bits, n_base))
    return classes, r


def memo_file(key: str) -> Path:
    """Where the sensitivities measured under `key` (a hash of the reference output and the linears) are kept."""
    return cache.cache_dir() / "mx_sens" / f"{key}.json"


def _block_of(arch_layers: str, name: str) -> int:
    """The decoder block index of linear `name` (`<arch.layers>.<i>.…`)."""
    return int(name[len(arch_layers) + 1:].split(".")[0])


def _groups(names: list[str], size: int) -> list[list[str]]:
    """`names` in block order, in runs of `size` (the linears one pass over the blocks carries)."""
    return [names[k:k + size] for k in range(0, len(names), size)]


@contextmanager
def _quantized_alone(linear: nn.Linear, bits: int) -> Iterator[None]:
    """Within: `linear`'s weight is its MXINT-`bits` version."""
    original = linear.weight.data
    linear.weight.data = mxint.fake_quantize(original.float(), bits).to(original.dtype)
    try:
        yield
    finally:
        linear.weight.data = original


def _perturbed_streams(ctx: ModelContext, group: list[str], h: list[torch.Tensor], kwargs: list[dict[str, Any]],
                       until: int, desc: str) -> tuple[dict[str, list[torch.Tensor]], list[torch.Tensor]]:
    """(the final hidden states with each linear of `group` (in block order) quantized alone, the full-precision
    input of block `until`): one pass from the block of the first, `h` the full-precision input of that block;
    `until` is at least the block of the last (where the next pass starts)."""
    arch = ctx.arch
    streams: dict[str, list[torch.Tensor]] = {}
    for i, block in ctx.walk_blocks(desc, start=_block_of(arch.layers, group[0])):
        streams = {name: run_block(block, s, kwargs[i]) for name, s in streams.items()}
        for name in (n for n in group if _block_of(arch.layers, n) == i):
            with _quantized_alone(ctx.model.get_submodule(name), ctx.plan.weight(name).bits):
                streams[name] = run_block(block, h, kwargs[i])
        if i < until:
            h = run_block(block, h, kwargs[i])
    return streams, h


@torch.no_grad()
def layer_sensitivities(ctx: ModelContext, names: list[str], samples: int, stream_mb: float) -> dict[str, float]:
    """s_l = ‖Y_l − Y‖² / ‖Y‖² of the final normed hidden state, linear l alone at MXINT-(its base bits).

    Passes over the blocks (`ctx.walk_blocks`: under streaming each block is read for its step): one computes Y;
    then each pass carries the perturbed streams of as many linears as `stream_mb` of hidden states hold, from the
    block of the first to the last block, starting each linear's stream at its own block from the full-precision
    input, which the pass carries on to the block where the next one starts. Every stream sees the same block
    forwards as if it were computed alone, so the result does not depend on the grouping.
    """
    arch = ctx.arch
    final_norm = ctx.model.get_submodule(arch.final_norm)
    inputs, kwargs = capture_block_inputs(ctx.model, arch, ctx.calib_ids[:samples])
    stream_bytes = sum(x.numel() * x.element_size() for x in inputs)
    groups = _groups(sorted(names, key=lambda n: _block_of(arch.layers, n)),
                     max(1, int(stream_mb * 2**20 // stream_bytes)))
    starts = [_block_of(arch.layers, g[0]) for g in groups]
    h = inputs
    for i, block in ctx.walk_blocks("mx_sens reference"):
        if i == starts[0]:
            start = h
        h = run_block(block, h, kwargs[i])
    reference = [final_norm(y).float() for y in h]
    scale = sum(float(y.pow(2).sum()) for y in reference)
    key = hashlib.sha256()
    for y in reference:
        key.update(y.cpu().numpy().tobytes())
    key.update(json.dumps([[n, ctx.plan.weight(n).bits] for n in names]).encode())
    memo = memo_file(key.hexdigest()[:32])
    if memo.exists():
        return json.loads(memo.read_text())
    out, h = {}, start
    for k, group in enumerate(groups):
        until = starts[k + 1] if k + 1 < len(groups) else _block_of(arch.layers, group[-1])
        streams, h = _perturbed_streams(ctx, group, h, kwargs, until, f"mx_sens sensitivity {k + 1}/{len(groups)}")
        for name, ys in streams.items():
            out[name] = sum(float((final_norm(y).float() - ref).pow(2).sum()) for y, ref in zip(ys, reference)) / scale
    out = {n: out[n] for n in names}
    with cache.atomic_file(memo) as tmp:
        tmp.write_text(json.dumps(out))
    return out


@register_stage("mx_sens", scope="prepass", kind="policy", options=MXSensOptions, streams=True)
def mx_sens(ctx: ModelContext, opts: MXSensOptions) -> dict[str, Any]:
    """Measure layer sensitivities, allocate the MXINT classes and set them in every linear's plan."""
    if opts.layers not in ("sensitivity", "uniform") or opts.columns not in ("hessian", "random"):
        raise ValueError(f"mx_sens: layers must be sensitivity|uniform and columns hessian|random, got "
                         f"{opts.layers!r} and {opts.columns!r}")
    mxint.check_bits(opts.top_bits)
    mxint.check_bits(opts.middle_bits)
    if opts.top_columns < 0 or opts.top_columns % BLOCK:
        raise ValueError(f"mx_sens: top_columns must be a multiple of {BLOCK}, got {opts.top_columns}")
    names = ctx.plan.quantized()
    shapes = {n: model_shapes(ctx.model, [n], ctx.plan.weight(n).bits)[n] for n in names}
    check_target(shapes, opts.target_bits, opts.top_bits, opts.middle_bits, opts.top_columns)  # before measuring
    if opts.layers == "sensitivity":
        raw = layer_sensitivities(ctx, names, opts.samples, opts.stream_mb)
        mean = sum(raw.values()) / len(raw)
        weights = {n: v / mean if mean > 0 else 1.0 for n, v in raw.items()}
    else:
        raw, weights = {}, dict.fromkeys(names, 1.0)
    classes, r = allocate(shapes, weights, opts.target_bits, opts.top_bits, opts.middle_bits, opts.top_columns)
    for n in names:
        ctx.plan[n].params.update(classes=classes[n], order=opts.columns)
    decision = {"target_bits": opts.target_bits, "element_bits": element_bits(shapes, classes), "R": r,
                "sensitivity": raw, "middle_columns": {n: c[1][1] for n, c in classes.items()}}
    ctx.plan.decisions["mx_sens"] = decision
    return {k: v for k, v in decision.items() if k not in ("sensitivity", "middle_columns")}
