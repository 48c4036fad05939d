"""Solvers onto llama.cpp's block types (`formats.ggml`): the grid of each block is searched as llama.cpp searches it
(`solvers.ggml_search`: sub-block scales and minimums, then their own quantization to 4/6/8-bit integers under an
fp16 super-block scale), so the result is exactly what a GGUF file holds.

  gguf_rtn   every value rounded to nearest on that grid: llama-quantize itself, with the importance matrix
             (`imatrix`: each input channel's mean square on the calibration text, what `llama-imatrix` collects)
             or without
  gguf_gptq  the same grid, fitted with the importance matrix before the sweep (GPTQ's static groups), then GPTQ's
             column sweep with inverse-Hessian error feedback rounds each column onto it: the codes minimise the
             layer's output error tr(ΔW H ΔWᵀ) given the grid, not each value's own error

The block type is the `ggml_type` option (set per linear by the `gguf_mix` policy from `--gguf-type`), else the
K-quant of `--w-bits` (8: Q8_0); rows that do not split into 256 values get llama.cpp's 32-value fallback type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitquilt.formats.ggml import GGMLFormat
from bitquilt.formats.ggml_blocks import TYPES, BlockType, with_fallback
from bitquilt.registry import option
from bitquilt.solvers.base import LayerSpec, LinearStats, check_finite, register_solver
from bitquilt.solvers.ggml_search import column_steps, fit, round_to_grid
from bitquilt.solvers.gptq import check_block_size, check_damp, gptq_sweep
from bitquilt.solvers.hessian import invert_permutation, prepare_hessian

K_TYPE = {2: "Q2_K", 3: "Q3_K", 4: "Q4_K", 5: "Q5_K", 6: "Q6_K", 8: "Q8_0"}  # a --w-bits width's block type


def check_type(name: str | None, solver: str) -> None:
    if name is not None and name not in TYPES:
        raise ValueError(f"solver {solver!r}: unknown ggml_type {name!r}; use one of {', '.join(TYPES)}")


def layer_type(name: str | None, spec: LayerSpec, in_features: int) -> BlockType:
    """The block type a linear of `in_features` inputs gets (module docstring)."""
    return with_fallback(name or K_TYPE[spec.bits], in_features)


@dataclass(frozen=True)
class GGUFRTNOptions:
    ggml_type: str | None = option(None, "llama.cpp block type (Q2_K-Q6_K, Q4_0, Q5_0, Q5_1, Q8_0); None: the "
                                   "K-quant of --w-bits (--gguf-type sets it per linear)")
    imatrix: bool = option(True, "weigh the grid search by each input channel's mean square on the calibration "
                           "text (llama.cpp's importance matrix)")

    def __post_init__(self) -> None:
        check_type(self.ggml_type, "gguf_rtn")


@dataclass(frozen=True)
class GGUFGPTQOptions:
    ggml_type: str | None = option(None, "llama.cpp block type (Q2_K-Q6_K, Q4_0, Q5_0, Q5_1, Q8_0); None: the "
                                   "K-quant of --w-bits (--gguf-type sets it per linear)")
    damp: float = option(0.01, "Hessian dampening, a fraction of its mean diagonal")
    block_size: int = option(128, "columns per lazy update of the sweep")
    act_order: bool = option(True, "sweep columns by decreasing Hessian diagonal (the grid is fixed first)")

    def __post_init__(self) -> None:
        check_type(self.ggml_type, "gguf_gptq")
        check_damp(self.damp, "gguf_gptq")
        check_block_size(self.block_size, "gguf_gptq")


def importance(stats: LinearStats | None) -> torch.Tensor | None:
    """llama.cpp's importance matrix entry of each input channel: mean x² on the calibration text, diag(XᵀX/n)."""
    return None if stats is None or stats.hessian is None else torch.diagonal(stats.hessian).float()


@register_solver("gguf_rtn", GGUFRTNOptions, needs_stats=lambda o: o.imatrix, produces=GGMLFormat)
def gguf_rtn(weight: torch.Tensor, stats: LinearStats | None, spec: LayerSpec, opts: GGUFRTNOptions) -> GGMLFormat:
    check_finite(weight)
    t = layer_type(opts.ggml_type, spec, weight.shape[1])
    return GGMLFormat.from_fields(t, fit(weight, t, importance(stats) if opts.imatrix else None))


@register_solver("gguf_gptq", GGUFGPTQOptions, produces=GGMLFormat)
def gguf_gptq(weight: torch.Tensor, stats: LinearStats | None, spec: LayerSpec, opts: GGUFGPTQOptions) -> GGMLFormat:
    check_finite(weight)
    t = layer_type(opts.ggml_type, spec, weight.shape[1])
    blocks = fit(weight, t, importance(stats))
    a, b = column_steps(blocks, t)
    prep, W = prepare_hessian(stats.hessian, weight, opts.damp, opts.act_order)
    if prep.perm is not None:
        a, b = a[:, prep.perm], b[:, prep.perm]
    codes = torch.zeros_like(W)

    def quantize_column(j: int, W1: torch.Tensor, i: int) -> torch.Tensor:
        codes[:, j] = round_to_grid(W1[:, i], a[:, j], b[:, j], t)
        return a[:, j] * (codes[:, j] - t.code_zero) - b[:, j]

    gptq_sweep(W, prep.hinv_u, opts.block_size, quantize_column)
    if prep.perm is not None:
        codes = codes[:, invert_permutation(prep.perm)]
    blocks.q = codes.to(torch.uint8).view_as(blocks.q)
    return GGMLFormat.from_fields(t, blocks)
