"""The LM head and the input embeddings in low bits (`Recipe.head_bits`): RTN on the uniform grid; with a GGUF mix
(`Recipe.gguf_type`) the block types llama.cpp's mix gives them (`gguf_matrix`).

Run once, after the decoder blocks (their calibration inputs start from the full-precision embeddings, and nothing
downstream of the head is calibrated): the input embedding becomes a `QuantEmbedding`, the LM head a
`QuantLinear`, both grouped along the hidden dimension (`head_group_size`). The grid is symmetric at 8 bits
(8-bit RTN loses nothing measurable to the missing zero point, and GGUF then holds it exactly as Q8_0) and
asymmetric at 4 bits (there the zero points are worth their 8 bits per group). With tied embeddings the shared
matrix is quantized once and one format serves both modules (`bitquilt.io` stores it once). What was done goes
into the quantization report under `stages["head_quant"]`, each matrix with its weight-space error
‖W − Ŵ‖²_F / ‖W‖²_F (the linears' `rel_error` with H = I: the head's calibrated inputs are not collected).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from bitquilt.formats.base import WeightFormat
from bitquilt.formats.ggml import GGMLFormat
from bitquilt.formats.ggml_blocks import with_fallback
from bitquilt.formats.uniform import UniformFormat
from bitquilt.models.adapters import Architecture, architecture_of
from bitquilt.nn.online import swap_host
from bitquilt.nn.quant_embedding import QuantEmbedding
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.policies.gguf_mix import tensor_type
from bitquilt.recipes import Recipe, head_spec
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec
from bitquilt.solvers.ggml_search import fit

HEAD_STAGE = "head_quant"  # its entry in QuantReport.stages
ROW_CHUNK = 8192  # rows quantized at a time: RTN is row-wise, so chunks bound the temporaries (a 150k vocabulary)


def _rtn(weight: torch.Tensor, spec: LayerSpec) -> UniformFormat:
    """RTN of `weight` [rows, in] a chunk of rows at a time, into tensors allocated once: the same format as in one
    go (rows are independent), without whole-matrix temporaries."""
    solver = get_solver("rtn")
    first = solver(weight[:ROW_CHUNK], None, spec)
    rows = weight.shape[0]
    if rows <= ROW_CHUNK:
        return first
    tensors = {k: t.new_empty((rows, *t.shape[1:])) for k, t in first.tensors().items()}
    for i in range(0, rows, ROW_CHUNK):
        part = first if i == 0 else solver(weight[i:i + ROW_CHUNK], None, spec)
        for k, t in part.tensors().items():
            tensors[k][i:i + t.shape[0]] = t
    return UniformFormat.from_tensors(tensors, first.meta())


@torch.no_grad()
def weight_error(weight: torch.Tensor, fmt: WeightFormat) -> float:
    """‖W − Ŵ‖²_F / ‖W‖²_F, dequantizing a chunk of rows at a time."""
    err = norm = 0.0
    for i in range(0, weight.shape[0], ROW_CHUNK):
        w = weight[i:i + ROW_CHUNK].float()
        err += float((fmt.dequantize_rows(torch.arange(i, i + w.shape[0])) - w).pow(2).sum())
        norm += float(w.pow(2).sum())
    return err / norm if norm else 0.0


def _entry(name: str, kind: str, fmt: WeightFormat, error: float | None, tied_to: str | None = None) -> dict:
    return {"name": name, "kind": kind, "format": fmt.describe(), "bits_per_weight": fmt.bits_per_weight(),
            "nbytes": 0 if tied_to else fmt.nbytes(), "rel_error": error, "tied_to": tied_to}


def gguf_matrix(weight: torch.Tensor, mix: str, role: str) -> GGMLFormat:
    """The embedding table or LM head as llama.cpp's mix `mix` quantizes it (`policies.gguf_mix.tensor_type`, role
    token_embd, tied_embd or output): its grid search without an importance matrix, rows in chunks."""
    t = with_fallback(tensor_type(mix, role), weight.shape[1])
    return GGMLFormat.from_fields(t, fit(weight.detach(), t))


@torch.no_grad()
def quantize_head(model: nn.Module, recipe: Recipe, arch: Architecture | None = None) -> dict[str, Any] | None:
    """Quantize `model`'s LM head and input embeddings in place as `recipe.head_bits` (or its `gguf_type` mix) says;
    what was done (None if they stay in full precision)."""
    if recipe.head_bits >= 16 and recipe.gguf_type is None:
        return None
    start = time.perf_counter()
    arch = arch or architecture_of(model)
    embed, head = model.get_submodule(arch.embed), model.get_submodule(arch.lm_head)
    if type(head) is not nn.Linear or not isinstance(embed, nn.Embedding) or isinstance(embed, QuantEmbedding):
        raise ValueError(f"head_bits: the LM head ({type(head).__name__}) and embeddings ({type(embed).__name__}) "
                         "must be full precision (nn.Linear, nn.Embedding); they are quantized once")
    tied = head.weight.data_ptr() == embed.weight.data_ptr()
    if recipe.gguf_type is not None:
        done: dict[str, Any] = {"gguf_type": recipe.gguf_type}

        def quantize(weight: torch.Tensor, role: str) -> WeightFormat:
            return gguf_matrix(weight, recipe.gguf_type, role)
    else:
        spec = head_spec(recipe.head_bits, recipe.head_group_size)
        done = {"bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym}

        def quantize(weight: torch.Tensor, role: str) -> WeightFormat:
            return _rtn(weight, spec)
    embed_fmt = quantize(embed.weight, "tied_embd" if tied else "token_embd")
    layers = [_entry(arch.embed, "embedding", embed_fmt, weight_error(embed.weight, embed_fmt))]
    if tied:
        head_fmt = embed_fmt
        layers.append(_entry(arch.lm_head, "linear", head_fmt, layers[0]["rel_error"], tied_to=arch.embed))
    else:
        head_fmt = quantize(head.weight, "output")
        layers.append(_entry(arch.lm_head, "linear", head_fmt, weight_error(head.weight, head_fmt)))
    parent, _, child = arch.embed.rpartition(".")
    setattr(model.get_submodule(parent), child, QuantEmbedding.from_embedding(embed, embed_fmt))
    swap_host(model, arch.lm_head, QuantLinear(head_fmt, head.bias))
    return {**done, "tied": tied, "layers": layers, "seconds": time.perf_counter() - start}
