"""compressed-tensors export: a model saved by `bitquilt quantize` as a Hugging Face directory in compressed-tensors'
"pack-quantized" format, which vLLM and transformers (through the `compressed-tensors` package) load.

Weights: each uniform-integer linear's codes, scales and zeros are copied; nothing is re-quantized.
  weight_packed      int32 [out, in·b/32]  the codes q ∈ [0, 2^b) as bitquilt stores them: code j at bit b·j of each
                                           row's little-endian stream of 32-bit words, which is compressed-tensors'
                                           `pack_to_int32` of its signed codes q − 2^(b−1) (it adds that offset back)
  weight_scale       fp32 or fp16 [out, G] bitquilt's fp16 scales: fp32 for an fp32 model (compressed-tensors
                                           dequantizes in the scale's dtype), else fp16 (bf16 would round them)
  weight_zero_point  int32 [⌈out·b/32⌉, G] asymmetric grids only: the zeros z, packed the same way along the rows
                                           (compressed-tensors packs zero points along dim 0)
  weight_shape       int64 [2]             (out, in)
  compressed-tensors computes ŵ = (q_s − z_s)·s with q_s = q − 2^(b−1) and z_s = z − 2^(b−1) (z_s = 0 for
  symmetric grids, whose bitquilt zero is 2^(b−1)): bitquilt's s·(q − z), exactly so in fp32 (b + 11 significant
  bits; in fp16 or bf16 the runtime rounds the product, as it would for any checkpoint).
Groups: one config group per (bits, symmetry), strategy "channel" if every such linear has one group per row,
  else "group" at the largest size that divides every linear's groups and width: compressed-tensors needs the
  size to divide the width (smollm2's width 576 at g128 ends each row with a group of 64, so its g128 model is
  exported at g64), and transformers' dequantizing loader applies one scheme to all dense layers. A linear whose
  groups are wider repeats each scale and zero over the smaller groups: exact, a few more scales. Several config
  groups (mixed bit widths) target their linears by name.
Refused, never refitted, with one line naming the layer and what is exportable: bit-plane, MXINT and composite
  formats; act-order columns with a g_idx (compressed-tensors 0.20 removed actorder "group"; bitquilt's default
  static groups export, recorded as actorder "weight"); 3-bit grids (compressed-tensors packs them differently
  from one version to the next, so a file could be misread); and models with online modules (rotations, activation
  or KV quantizers), which these runtimes do not run.
Mixture-of-experts models (Mixtral, Qwen3-MoE, OLMoE): every expert's linears under their per-expert names, as the
  family's Hub checkpoints, vLLM and llm-compressor spell them (`mlp.experts.{e}.gate_proj`; Mixtral's
  `block_sparse_moe.experts.{e}.w1`/`w3`/`w2` and `block_sparse_moe.gate`), the router in full precision.
  transformers merges them into its 3D expert tensors as it loads, decompressing each expert without a zero point:
  asymmetric expert grids are refused (quantize with --sym).
Fused projections (Phi-3's qkv_proj, gate_up_proj) are written fused, as the family's checkpoints hold them: the parts'
  codes, scales and zeros stacked by rows (`bitquilt.models.fused.fuse_parts`; parts of different grids are refused).
Full-precision tensors (embeddings, norms, biases, linears kept in full precision, an untied LM head) are written in
  the saved config's dtype; casting fp32 to a narrower dtype rounds what AWQ folded into the norms, and the summary
  counts the tensors that changed. Every other file of the saved directory (tokenizer, generation config) is
  copied unchanged. The directory is written beside the target and renamed into place (`bitquilt.cache.atomic_dir`).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from bitquilt.cache import atomic_dir
from bitquilt.errors import UserError
from bitquilt.export.checks import check_layers
from bitquilt.formats.base import WeightFormat, split_buffers
from bitquilt.formats.packing import WORD_BITS, pack
from bitquilt.formats.uniform import UniformFormat, expand_groups
from bitquilt.io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_output,
    companion_files,
    is_quantized_dir,
    load_quantized,
    quantization_record,
    stored_tensors,
)
from bitquilt.models.adapters import architecture_for
from bitquilt.models.fused import checkpoint_name, fuse_parts
from bitquilt.nn.quant_linear import QuantLinear

FORMAT = "pack-quantized"
BITS = (2, 4, 8)  # packed alike by every compressed-tensors version that reads them
EXPORTABLE = (f"uniform {', '.join(map(str, BITS))}-bit grids (symmetric or asymmetric, grouped or per channel, "
              "static groups) and linears kept in full precision")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

Scheme = tuple[int, bool, int | None]  # bits, symmetric, group size (None: per channel)


@dataclass
class CompressedTensorsExport:
    """What `export_compressed_tensors` wrote."""

    output: str
    format: str
    schemes: dict[str, str]  # config group -> its grid and how many linears use it
    regrouped: int  # linears exported at a smaller group size (theirs did not divide the width)
    dtype: str  # of the full-precision tensors
    rounded: int  # full-precision tensors the cast to `dtype` changed
    size_mb: float
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------- weights
def refusal(fmt: WeightFormat) -> str | None:
    """Why `fmt` cannot be written as pack-quantized tensors that every compressed-tensors reader decodes alike."""
    if type(fmt) is not UniformFormat:
        return f"compressed-tensors has no {fmt.name} format"
    if fmt.g_idx is not None:
        return ("act-order (g_idx) columns: compressed-tensors 0.20 removed actorder 'group'; quantize with static "
                "groups (the default) or --no-act-order")
    if fmt.bits not in BITS:
        return (f"{fmt.bits}-bit codes are packed differently by different compressed-tensors versions (a file "
                "could be misread)")
    return None


def plan_schemes(formats: dict[str, UniformFormat]) -> dict[str, Scheme]:
    """The compressed-tensors grid of each linear: one per (bits, symmetry), so that one config group covers them
    (transformers' dequantizing loader applies a single scheme to every dense layer). Its group size is the largest
    that divides every such linear's groups and width; "channel" if they all have one group per row."""
    sizes: dict[tuple[int, bool], list[int | None]] = {}
    for fmt in formats.values():
        whole_row = fmt.group_size >= fmt.in_features
        sizes.setdefault((fmt.bits, fmt.sym), []).append(
            None if whole_row else math.gcd(fmt.group_size, fmt.in_features))
    groups = {}
    for key, found in sizes.items():
        grouped = [g for g in found if g is not None]
        widths = [f.in_features for f in formats.values() if (f.bits, f.sym) == key and f.group_size >= f.in_features]
        groups[key] = math.gcd(*grouped, *widths) if grouped else None
    return {name: (fmt.bits, fmt.sym, groups[fmt.bits, fmt.sym]) for name, fmt in formats.items()}


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] codes packed along the rows: int32 [⌈rows·bits/32⌉, cols] (rows zero-padded to whole words)."""
    rows = values.shape[0]
    padded = torch.zeros(-(-rows // WORD_BITS) * WORD_BITS, values.shape[1], dtype=torch.int64)
    padded[:rows] = values
    return pack(padded.T, bits)[:, : -(-rows * bits // WORD_BITS)].T.contiguous()


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scales are stored in for a model in `dtype`: both hold bitquilt's fp16 scales exactly."""
    return torch.float32 if dtype == torch.float32 else torch.float16


def packed_tensors(fmt: UniformFormat, group: int | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The pack-quantized tensors of one linear (local names, `weight_*`) at `group` columns per scale (None: per
    channel) for a model in `dtype`."""
    scales, zeros = fmt.scales, fmt.zeros
    if group is not None and group != fmt.group_size:  # repeat each (row, group) value over the smaller groups
        columns = torch.arange(0, fmt.in_features, group)
        scales = expand_groups(scales, fmt.group_size, fmt.in_features)[:, columns]
        zeros = None if zeros is None else expand_groups(zeros, fmt.group_size, fmt.in_features)[:, columns]
    out = {"weight_packed": fmt.qweight.contiguous(), "weight_scale": scales.to(scale_dtype(dtype)).contiguous(),
           "weight_shape": torch.tensor([fmt.out_features, fmt.in_features], dtype=torch.int64)}
    if zeros is not None:
        out["weight_zero_point"] = pack_rows(zeros.to(torch.int64), fmt.bits)
    return out


# ---------------------------------------------------------------- model
def check_exportable(model: nn.Module) -> None:
    """A one-line UserError naming the first thing in `model` that compressed-tensors cannot hold exactly."""
    check_layers(model, "compressed-tensors", "which vLLM and transformers do not run", refusal, EXPORTABLE)
    arch = architecture_for(model.config.model_type)
    inside = None if arch is None or arch.experts is None else f".{arch.experts.module}."
    asymmetric = next((name for name, m in model.named_modules() if inside and inside in name
                       and isinstance(m, QuantLinear) and not m.fmt.sym), None)
    if asymmetric is not None:
        raise UserError(f"cannot export {asymmetric} ({model.get_submodule(asymmetric).fmt.describe()}) to "
                        "compressed-tensors: transformers decompresses expert weights without zero points, so an "
                        "MoE model's experts must be symmetric grids; quantize with --sym")
    if not any(isinstance(m, QuantLinear) for m in model.modules()):
        raise UserError("cannot export to compressed-tensors: the model has no quantized linears (a full-precision "
                        "model needs no export)")


def weight_args(scheme: Scheme, act_order: bool) -> dict[str, Any]:
    """compressed-tensors' QuantizationArgs of a weight grid, as config.json spells them."""
    bits, sym, group = scheme
    args = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
            "strategy": "channel" if group is None else "group", "group_size": group}
    if act_order:
        args["actorder"] = "weight"  # columns were swept in act-order; groups stay contiguous (no g_idx)
    return args


def by_scheme(schemes: dict[str, Scheme]) -> list[tuple[Scheme, list[str]]]:
    """The linears of each grid, the most used grid first: config group i is entry i."""
    groups: dict[Scheme, list[str]] = {}
    for name, scheme in schemes.items():
        groups.setdefault(scheme, []).append(name)
    return sorted(groups.items(), key=lambda item: -len(item[1]))


def quantization_config(model: nn.Module, schemes: dict[str, Scheme]) -> dict[str, Any]:
    """config.json's `quantization_config`: one config group per grid; full-precision linears ignored. A single
    grid targets every Linear; several target their linears by name."""
    ordered = by_scheme(schemes)
    options = ((quantization_record(model) or {}).get("recipe") or {}).get("options") or {}
    act_order = options.get("act_order") is True
    groups = {f"group_{i}": {"targets": ["Linear"] if len(ordered) == 1 else _checkpoint_names(model, names),
                             "weights": weight_args(scheme, act_order), "input_activations": None,
                             "output_activations": None, "format": FORMAT}
              for i, (scheme, names) in enumerate(ordered)}
    ignore = _checkpoint_names(model, [name for name, m in model.named_modules() if type(m) is nn.Linear])
    return {"quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
            "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None}


def _checkpoint_names(model: nn.Module, names: list[str]) -> list[str]:
    """Module names as the family's checkpoints spell them (Mixtral's experts: `block_sparse_moe.experts.{e}.w1`)."""
    return [(checkpoint_name(model, f"{n}.weight") or f"{n}.weight").removesuffix(".weight") for n in names]


def describe(scheme: Scheme, count: int) -> str:
    bits, sym, group = scheme
    return f"w{bits} {'per-channel' if group is None else f'g{group}'} {'sym' if sym else 'asym'} ({count} linears)"


def export_dtype(config: Any) -> torch.dtype:
    """The dtype of the saved config (bitquilt computes in fp32; the original checkpoint's dtype is kept)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    name = str(dtype).removeprefix("torch.")
    return DTYPES.get(name, torch.float32)


def model_tensors(model: nn.Module, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Scheme], int]:
    """Every tensor to write (pack-quantized linears, full-precision tensors in `dtype`), each quantized linear's
    scheme, and how many full-precision tensors the cast changed."""
    tensors = stored_tensors(model)
    formats = {name: m.fmt for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    schemes = plan_schemes(formats)
    out: dict[str, torch.Tensor] = {}
    for name, fmt in formats.items():
        split_buffers(tensors, name)  # bitquilt's own layout: replaced by compressed-tensors'
        out |= {f"{name}.{k}": v for k, v in packed_tensors(fmt, schemes[name][2], dtype).items()}
    rounded = 0
    for name, t in tensors.items():
        if t.is_floating_point():
            cast = t.to(dtype)
            rounded += not torch.equal(cast.to(t.dtype), t)
            t = cast
        out[name] = t.contiguous()
    return {checkpoint_name(model, n) or n: t for n, t in out.items()}, schemes, rounded


def write_compressed_tensors(model: nn.Module, source: Path, output: Path, overwrite: bool = False
                             ) -> CompressedTensorsExport:
    """Write the (quantized) `model` as a compressed-tensors directory `output`, atomically, with every other file
    of its saved directory `source` (tokenizer, generation config); see the module docstring."""
    t0 = time.perf_counter()
    check_exportable(model)
    dtype = export_dtype(model.config)
    tensors, schemes, rounded = model_tensors(model, dtype)
    qconfig = quantization_config(model, schemes)
    check_output(output, overwrite, source=source)
    with atomic_dir(output) as tmp:
        model.config.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        config["quantization_config"] = qconfig
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        for f in companion_files(source):  # the tokenizer and generation config, not other files found there
            shutil.copy2(f, tmp / f.name)
    described = {f"group_{i}": describe(scheme, len(names)) for i, (scheme, names) in enumerate(by_scheme(schemes))}
    regrouped = sum(1 for name, m in model.named_modules() if isinstance(m, QuantLinear)
                    and schemes[name][2] not in (None, m.fmt.group_size))
    size = sum(f.stat().st_size for f in output.iterdir())
    return CompressedTensorsExport(output=str(output), format=FORMAT, schemes=described,
                                   regrouped=regrouped, dtype=str(dtype).removeprefix("torch."), rounded=rounded,
                                   size_mb=size / 2**20, seconds=time.perf_counter() - t0)


def export_compressed_tensors(directory: str | Path, output: str | Path, overwrite: bool = False
                              ) -> CompressedTensorsExport:
    """Export the model saved by `bitquilt.io.save` in `directory` to the compressed-tensors directory `output`."""
    directory, output = Path(directory), Path(output)
    check_output(output, overwrite, source=directory)
    if not is_quantized_dir(directory):
        raise UserError(f"{directory} is not a model saved by bitquilt (no {CONFIG_NAME}); export takes the output "
                        "directory of `bitquilt quantize`")
    model, _ = load_quantized(directory)
    check_exportable(model)  # what compressed-tensors cannot hold, named by part before fusing them could fail on it
    fuse_parts(model)  # the family's own checkpoint layout (phi3: qkv_proj, gate_up_proj)
    return write_compressed_tensors(model, directory, output, overwrite)
