"""DynamicPTQ: 8-bit activations only in the decoder layers where the residual stream jumps.

A whole-model policy run after the backbone's model transforms (QuaRot's rotation), before any
block is solved. In one pass over the blocks (under streaming each is read from disk for its step)
it measures every layer's residual-stream metrics on calibration windows
(`bitquilt.calib.residual`: Jump Ratio, Historical-Feature SNR under the recipe's activation
quantizer) and gives the inputs of every linear of the chosen layers `bits` (8) instead of the
recipe's activation bits; weights and KV cache are unchanged.

Choice (`select`): "jr" (default) the highest Jump Ratio, "snr" the layers with the lowest SNR at the
recipe's activation bits (the history drowns in the rounding noise of the quantized stream). On
smollm2-135m (quarot+rtn W4A4KV4, K = 4) JR's choice gained most of the two (see docs/benchmarks.md);
"random" and "ends" (the first K − 1 layers and the last: for K = 4 the paper's hand-picked first
three + last) are the baselines the benchmark compares with. How many: the `layers` worst, or (`snr_db`) every layer
whose SNR is below the threshold.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from bitquilt.calib.residual import LayerPhase, residual_phases
from bitquilt.calib.stages import ModelContext, register_stage
from bitquilt.models.adapters import decoder_layers
from bitquilt.nn.act_quant import ActQuantConfig
from bitquilt.registry import option

SELECTIONS = ("snr", "jr", "random", "ends")


@dataclass(frozen=True)
class DynamicA8Options:
    layers: int = option(0, "how many decoder layers get wider activations")
    snr_db: float | None = option(None, "instead of a count: every layer whose SNR is below this many dB")
    select: str = option("jr", "how layers are chosen: jr (highest Jump Ratio), snr (lowest historical SNR), "
                         "random, ends (the first layers + the last)")
    bits: int = option(8, "activation bits of the chosen layers")
    samples: int = option(8, "calibration windows the metrics are measured on")
    seed: int = option(0, "seed of select=random")


def check_layer_count(layers: int, n_layers: int) -> None:
    """Raise ValueError unless `layers` (--a8-layers) is at most the model's `n_layers` decoder layers."""
    if layers > n_layers:
        raise ValueError(f"a8_layers (--a8-layers) is {layers}, more than the model's {n_layers} decoder layers; "
                         f"use at most {n_layers}")


def selection_order(phases: list[LayerPhase], bits: int, select: str = "jr", k: int = 0, seed: int = 0) -> list[int]:
    """The decoder layers in the order `select` widens them (SNR taken at `bits`): `--a8-layers K` takes the first K
    ("ends" depends on `k`: the first k − 1 layers and the last)."""
    n = len(phases)
    if select not in SELECTIONS:
        raise ValueError(f"dynamic_a8: unknown selection {select!r}; use one of {', '.join(SELECTIONS)}")
    if select == "snr":
        return sorted(range(n), key=lambda i: phases[i].snr_db[bits])
    if select == "jr":
        return sorted(range(n), key=lambda i: -phases[i].jump_ratio)
    if select == "random":
        return random.Random(seed).sample(range(n), n)
    return list(range(k - 1)) + [n - 1] if k else []


def choose_layers(phases: list[LayerPhase], bits: int, opts: DynamicA8Options) -> list[int]:
    """The decoder layers `opts` selects from the measured `phases` (SNR taken at `bits`)."""
    if opts.select not in SELECTIONS:
        raise ValueError(f"dynamic_a8: unknown selection {opts.select!r}; use one of {', '.join(SELECTIONS)}")
    if opts.snr_db is not None:
        return sorted(p.layer for p in phases if p.snr_db[bits] < opts.snr_db)
    check_layer_count(opts.layers, len(phases))
    return sorted(set(selection_order(phases, bits, opts.select, opts.layers, opts.seed)[:opts.layers]))


@register_stage("dynamic_a8", scope="model", kind="policy", options=DynamicA8Options, streams=True)
def dynamic_a8(ctx: ModelContext, opts: DynamicA8Options) -> dict[str, Any]:
    """Measure the residual stream and widen the activations of the chosen layers in the plan."""
    check_layer_count(opts.layers, len(decoder_layers(ctx.model, ctx.arch)))  # before the measurements
    s = ctx.settings
    a_bits = s.get("a_bits", 16)
    if a_bits >= opts.bits:
        raise ValueError(f"dynamic_a8 widens activations to {opts.bits} bits, but the recipe's activations are "
                         f"{a_bits}-bit; use it with --a-bits 4 (or 6)")
    config = ActQuantConfig(a_bits, s.get("a_sym", False), -1, 1.0, s.get("a_format") or "int")
    phases = residual_phases(ctx.model, ctx.arch, ctx.calib_ids[:opts.samples], {a_bits: config},
                             ctx.walk_blocks("dynamic_a8 pre-pass"))
    chosen = choose_layers(phases, a_bits, opts)
    prefixes = tuple(f"{ctx.arch.layers}.{i}." for i in chosen)
    widened = 0
    for name, plan in ctx.plan.linears.items():
        if plan.act is not None and name.startswith(prefixes):
            plan.act = replace(plan.act, bits=opts.bits)
            widened += 1
    decision = {"layers": chosen, "select": opts.select, "bits": opts.bits, "linears": widened,
                "phases": [p.to_dict() for p in phases]}
    ctx.plan.decisions["dynamic_a8"] = decision
    return {"layers": chosen, "linears": widened}
