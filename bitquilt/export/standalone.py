"""Standalone export: a saved model as the kernel layouts themselves, for `bitquilt.runtime.standalone` (no torch at
run time).

The file is what the runtime's kernels read, so loading it is mapping it: nothing is repacked, and the process
holds one copy of each weight (the file's pages). `standalone.safetensors` holds, per linear (HF module names):

  kind "q4"     4- or 2-bit uniform grid: `.codes` uint8 and `.scales` uint8, `bitquilt.kernels.q4_int8.Q4Layout`
                (codes two or four per byte in tiles of 32 rows, fp16 s and uint8 z per row and group)
  kind "u8"     8-bit uniform grid: `.codes` uint8 [out, in], `.scale` and `.scale_zero` fp32 [out, groups]
                (`bitquilt.kernels.uniform8`)
  kind "dense"  a linear kept in full precision: `.weight` fp32 [out, in]
  kind "slices" a MoBiQuant linear, routed per token: per slice p `.slice<p>.planes` and `.slice<p>.coefs`, the
                lookup-table kernel's packed bit-planes and coefficients as bytes (`bitquilt.kernels.cpu.Packed`;
                metadata: each slice's bits and coefficient layout, one block and group), and its router's
                `.router.fc1.weight` [H, in + 1], `.router.fc1.bias`, `.router.fc2.weight` [slices - 1, H],
                `.router.fc2.bias` and saved `.router.threshold` [1] (fp32, `bitquilt.nn.slice_router`)
  and `.bias` fp32 where the linear has one; the input embedding as one more such matrix [vocab, hidden] read by rows
  (or, tied, the LM head's own), the norms' weights, and RoPE's inverse frequencies (`rope.inv_freq`, the native
  runtime's, so scaled RoPE variants need no code of their own at run time). The header's metadata
  "bitquilt.runtime.standalone" is JSON: the dimensions, each linear's kind and shape, what the embedding reads.
  A routed model also holds its routers' curve, `routing.curve` (mean bits per weight at each threshold of
  `routing.taus`, fp32), from which the runtimes set one threshold for an average of bits (`--avg-bits`), and is
  format 4 (`FORMAT_VERSIONS`); a Gemma 2 or 3 model is format 5: its metadata adds the layer types, sliding window,
  activation, embedding scale and logit caps, its file the pre- and post-feedforward norms (and Gemma 3's sliding
  layers' `rope.sliding_attention.inv_freq`); any other model is format 3, as before. Every norm is written as the
  vector it multiplies by (Gemma's 1 + w). A mixture-of-experts model (Mixtral, Qwen3-MoE, OLMoE) is format 6: per
  layer the router `mlp.gate.weight` (fp32 [experts, hidden]) and each expert's `mlp.experts.{e}.{gate,up,down}_proj`
  linears in place of the MLP's, metadata "experts" (count, top_k, renormalize) and "qk_norms_whole" (OLMoE's q/k
  norms over the whole projection); intermediate_size is an expert's.

4/2- and 8-bit weights and routed slices run on int8-rounded activations (the bitquilt runtime's
`--int8-activations` engine; the slices through the same kernel and routing code as the fused torch runtime), so the
standalone runtime computes what `bitquilt generate --int8-activations` does, in another fp32 order.
Exportable: llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3 and MoE models (without q/k/v clipping) (phi3 in its
split layout, RoPE over whole heads: not a partial rotary factor) whose linears are uniform 4- or 2-bit grids (width and
groups multiples of 64 columns, fp16 scales, no act-order g_idx), uniform 8-bit grids (multiples of 32), full precision,
or (decoder layers) MoBiQuant slices with their routers, with no other online modules; the rest is refused with one line
naming the first layer.
The tokenizer and generation files are copied, and a byte-level BPE tokenizer is also written as tables for the
native runner
(`bitquilt.export.tokenizer_tables`; metadata "tokenizer", or why not); the directory is written beside the target
and renamed into place.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from bitquilt.cache import atomic_dir
from bitquilt.errors import UserError
from bitquilt.export.checks import check_layers
from bitquilt.export.tokenizer_tables import Unsupported, tokenizer_tables
from bitquilt.formats.base import WeightFormat
from bitquilt.formats.bitplane import BitplaneFormat
from bitquilt.formats.composite import CompositeFormat
from bitquilt.formats.uniform import UniformFormat, resolve_group_size
from bitquilt.heap import HUGE_PAGE
from bitquilt.io import CONFIG_NAME, check_output, companion_files, is_quantized_dir, load_quantized, saved_config
from bitquilt.kernels import cpu, q4_int8, uniform8
from bitquilt.nn import online
from bitquilt.nn.slice_router import TAU_GRID, has_routers, model_curve
from bitquilt.runtime.lean import GEMMA, MOE_FAMILIES
from bitquilt.runtime.module_tree import ModuleTreeConfig, ModuleTreeLM, inverse_frequencies, rotary_dim
from bitquilt.runtime.standalone.model import FILE, METADATA_KEY, PROJECTIONS
from bitquilt.runtime.tokenizer import TOKENIZER_FILE, FastTokenizer

log = logging.getLogger(__name__)

# a layer's norms, those it has written as the vectors they multiply by
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
         "self_attn.q_norm", "self_attn.k_norm")
EXPORTABLE = ("uniform 4- and 2-bit grids (width and groups multiples of 64 columns, no act-order), uniform 8-bit "
              "grids (multiples of 32), linears in full precision and routed MoBiQuant slices")
SLICE_FORMATS = (BitplaneFormat, UniformFormat)  # what a slice may be: the lookup-table kernel packs both


@dataclass
class StandaloneExport:
    """What `export_standalone` wrote."""

    output: str
    format: str
    kinds: dict[str, int]  # linears (embedding and head included) per kind
    file_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def refusal(fmt: WeightFormat) -> str | None:
    """Why the standalone runtime cannot run `fmt`; None if it can (slices: if their packing does, `_slices`)."""
    if isinstance(fmt, CompositeFormat):
        parts = list(fmt.parts.values())
        if fmt.perm is not None:
            return "permuted input columns"
        if not 2 <= len(parts) <= 8 or not all(isinstance(p, SLICE_FORMATS) for p in parts):
            return "slices other than 2 to 8 bit-plane or uniform parts"
        return None
    if not isinstance(fmt, UniformFormat):
        return f"the standalone runtime runs uniform grids, not {type(fmt).__name__}"
    if fmt.bits not in (*q4_int8.BITS, 8):
        return f"{fmt.bits}-bit codes (the standalone runtime runs 4, 2 and 8 bits)"
    if fmt.g_idx is not None:
        return "act-order columns (g_idx)"
    return None


def _quantized(tensors: dict[str, torch.Tensor], name: str, fmt: WeightFormat) -> dict[str, Any]:
    """The kernel layout of `fmt` into `tensors` under `name`; its metadata entry."""
    why = refusal(fmt)
    if why is None and fmt.bits == 8:
        found = uniform8.operands(fmt)
        if found is not None:
            codes, groups = found
            tensors.update({f"{name}.codes": codes.contiguous(), f"{name}.scale": groups.scale,
                            f"{name}.scale_zero": groups.scale_zero})
            return {"kind": "u8", "group": groups.group}
        why = "8-bit columns or groups that are not multiples of 32"
    elif why is None:
        layout = q4_int8.layout(fmt)
        if layout is not None:
            tensors.update({f"{name}.codes": layout.codes, f"{name}.scales": layout.scales})
            return {"kind": "q4", "bits": layout.bits, "group": layout.group}
        group = resolve_group_size(fmt.group_size, fmt.in_features)
        why = (f"{fmt.in_features} columns in groups of {group} (multiples of 64 needed)"
               if fmt.in_features % 64 or group % 64 else "scales that are not fp16 values or zeros beyond a byte")
    raise UserError(f"cannot export {name} ({fmt.describe()}) to the standalone runtime: {why}; exportable: "
                    f"{EXPORTABLE}")


def _slices(tensors: dict[str, torch.Tensor], name: str, module: nn.Module) -> dict[str, Any]:
    """A MoBiQuant linear's slices and router into `tensors` (kind "slices", module docstring); its metadata entry."""
    fmt, router = module.fmt, online.get(module, "router")
    if router is None or not name.startswith("model.layers."):
        where = "without a router (a mobislice checkpoint)" if router is None else "outside the decoder layers"
        raise UserError(f"cannot export {name} ({fmt.describe()}) to the standalone runtime: sliced weights "
                        f"{where}; it runs routed MoBiQuant slices in decoder layers (exportable: {EXPORTABLE})")
    layouts = cpu.packed_alike(list(fmt.parts.values()))
    if layouts is None:
        raise UserError(f"cannot export {name} ({fmt.describe()}) to the standalone runtime: slices the lookup-table "
                        "kernel does not pack alike (widths and groups multiples of 32 columns)")
    slices = []
    for p, packed in enumerate(layouts):
        tensors[f"{name}.slice{p}.planes"] = packed.planes.contiguous().reshape(-1)
        tensors[f"{name}.slice{p}.coefs"] = packed.coeffs.contiguous().view(torch.uint8).reshape(-1)
        coef = "uniform16" if packed.coeffs.dtype == torch.uint8 else "uniform32" if packed.uniform else "planes"
        slices.append({"bits": packed.bits, "coef": coef})
    for key, value in router.state_dict().items():  # fc1.weight, fc1.bias, fc2.weight, fc2.bias, threshold, curve
        if key != "curve":  # the model's curve is the file's (routing.curve)
            tensors[f"{name}.router.{key}"] = value.detach().float().reshape(value.shape or (1,)).contiguous()
    return {"kind": "slices", "block": layouts[0].block, "group": layouts[0].group, "slices": slices}


def _linear(tensors: dict[str, torch.Tensor], name: str, module: nn.Module) -> dict[str, Any]:
    """A linear (QuantLinear or nn.Linear) or embedding table into `tensors`; its metadata entry."""
    fmt = getattr(module, "fmt", None)
    if isinstance(fmt, CompositeFormat):
        entry = _slices(tensors, name, module)
        shape = (fmt.out_features, fmt.in_features)
    elif fmt is not None:
        entry = _quantized(tensors, name, fmt)
        shape = (fmt.out_features, fmt.in_features)
    else:
        weight = module.weight.detach().float().contiguous()
        tensors[f"{name}.weight"] = weight
        entry, shape = {"kind": "dense"}, tuple(weight.shape)
    bias = module._parameters.get("bias")  # None for embeddings
    if bias is not None:
        tensors[f"{name}.bias"] = bias.detach().float().contiguous()
    return {**entry, "out": shape[0], "in": shape[1], "bias": bias is not None}


def _norm_vector(norm: nn.Module) -> torch.Tensor:
    """What an RMSNorm multiplies by: its weight plus the family's offset (Gemma's 1 + w), fp32."""
    return (norm.weight.detach().float() + norm.offset).contiguous()


def _same_table(embedding: nn.Module, head: nn.Module) -> bool:
    """Whether the embedding reads the head's own weight (tied): the same format or the same tensor."""
    fmt = getattr(embedding, "fmt", None)
    if fmt is not None:
        return fmt is getattr(head, "fmt", None)
    return isinstance(head, nn.Linear) and embedding.weight is head.weight


def standalone_tensors(model: ModuleTreeLM) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of the standalone file and its metadata (module docstring)."""
    check_layers(model, "the standalone runtime", "which the standalone runtime does not run", refusal, EXPORTABLE,
                 quantized_embeddings=True, runs_online=("router",))
    config = model.config
    tensors: dict[str, torch.Tensor] = {}
    linears: dict[str, Any] = {}
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        experts = getattr(layer.mlp, "experts", None)
        for proj in PROJECTIONS if experts is None else PROJECTIONS[:4]:
            linears[f"{prefix}.{proj}"] = _linear(tensors, f"{prefix}.{proj}", layer.get_submodule(proj))
        if experts is not None:  # the router fp32 [experts, hidden], each expert's linears
            tensors[f"{prefix}.mlp.gate.weight"] = layer.mlp.gate.weight.detach().float().contiguous()
            for e, expert in enumerate(experts):
                for part in ("gate_proj", "up_proj", "down_proj"):
                    name = f"{prefix}.mlp.experts.{e}.{part}"
                    linears[name] = _linear(tensors, name, getattr(expert, part))
        modules = dict(layer.named_modules())
        for name in NORMS:
            if name in modules:
                tensors[f"{prefix}.{name}.weight"] = _norm_vector(modules[name])
    tensors["model.norm.weight"] = _norm_vector(model.model.norm)
    linears["lm_head"] = _linear(tensors, "lm_head", model.lm_head)
    embedding = model.model.embed_tokens
    embed = "lm_head" if _same_table(embedding, model.lm_head) else "model.embed_tokens"
    if embed != "lm_head":
        linears[embed] = _linear(tensors, embed, embedding)
    tensors["rope.inv_freq"] = inverse_frequencies(config).float().contiguous()
    gemma = config.model_type in GEMMA
    if config.rope_by_type:  # gemma3's sliding layers rotate by their own base
        tensors["rope.sliding_attention.inv_freq"] = inverse_frequencies(config, "sliding_attention").float()
    routed = has_routers(model)
    if routed:
        tensors["routing.curve"] = model_curve(model).float().contiguous()
        tensors["routing.taus"] = TAU_GRID.float().contiguous()
    window = config.sliding_window if config.model_type in ("mistral", "phi3", "mixtral") or config.use_sliding_window \
        else None
    moe = config.model_type in MOE_FAMILIES
    metadata = {
        "format_version": 6 if moe else 5 if gemma else 4 if routed else 3, "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.expert_size if moe else config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "vocab_size": config.vocab_size,
        "attention_scaling": model.model.layers[0].self_attn.scaling,
        "max_positions": min(config.max_position_embeddings, window or config.max_position_embeddings),
        "qk_norms": hasattr(model.model.layers[0].self_attn, "q_norm"), "embed": embed, "linears": linears,
    }
    if moe:
        metadata["experts"] = {"count": config.num_experts, "top_k": config.experts_per_token,
                               "renormalize": config.norm_topk_prob}
        metadata["qk_norms_whole"] = config.model_type == "olmoe"
    if gemma:
        metadata.update({"layer_types": list(config.layer_types), "sliding_window": config.sliding_window,
                         "activation": config.hidden_act, "embed_scale": config.hidden_size ** 0.5,
                         "final_logit_softcapping": config.final_logit_softcapping,
                         "attn_logit_softcapping": config.attn_logit_softcapping})
    return tensors, metadata


def copy_in_huge_pages(source: Path, target: Path) -> None:
    """`source` copied to `target` in 2 MB writes at 2 MB offsets, so that the page cache holds the new file in 2 MB
    folios where the file system makes them (ext4 does), which the runtime's mapping then gets as huge pages: as
    safetensors writes it, the file sits in small folios and every decode step pays TLB misses over its weights
    (docs/memory.md)."""
    buffer = bytearray(HUGE_PAGE)
    view = memoryview(buffer)
    with open(source, "rb", buffering=0) as src, open(target, "wb", buffering=0) as dst:
        while n := src.readinto(buffer):
            dst.write(view[:n])


def export_standalone(directory: str | Path, output: str | Path, overwrite: bool = False) -> StandaloneExport:
    """Write the model saved in `directory` as a standalone directory at `output` (module docstring)."""
    directory, output = Path(directory), Path(output)
    if not is_quantized_dir(directory):
        raise UserError(f"{directory} is not a directory saved by bitquilt (no {CONFIG_NAME}); quantize a model first")
    check_output(output, overwrite, source=directory)
    try:  # what the standalone runtime covers is what bitquilt's module tree covers, heads rotated whole: asked
        config = ModuleTreeConfig.from_dict(saved_config(directory))  # before any weight loads
        reason = config.unsupported_reason()
        if reason is None and rotary_dim(config) != config.head_dim:
            reason = f"a partial rotary factor of {config.partial_rotary_factor}, where it rotates whole heads"
        if reason is None and config.rope["rope_type"] == "longrope":
            reason = "LongRoPE (its attention factor and its switch of factors past the original context)"
        if reason is None and config.clip_qkv is not None:
            reason = "q/k/v clipping (clip_qkv)"
    except ValueError as e:
        reason = str(e)
    if reason is not None:
        raise UserError(f"cannot export {directory} to the standalone runtime: {reason} (it runs llama, mistral, "
                        "qwen2, qwen3, gemma2, gemma3, phi3 and MoE models)")
    model, _ = load_quantized(directory, runtime="bitquilt")
    tensors, metadata = standalone_tensors(model)
    try:
        tables, metadata["tokenizer"] = tokenizer_tables(directory)
        tensors.update(tables)
    except Unsupported as e:
        if FastTokenizer.available(directory):
            advice = "run the export with bitquilt-run"
        else:
            advice = ("neither bitquilt-run nor bitquilt-native can generate text from it (`bitquilt bench` runs it on "
                      "token ids): export a saved model that has its tokenizer files")
            log.warning("%s has no %s: %s", directory, TOKENIZER_FILE, advice)
        metadata["tokenizer"] = {"unsupported": str(e), "advice": advice}  # the native runner's error says both
    with atomic_dir(output) as tmp:
        staging = tmp / f"{FILE}.staging"
        save_file(tensors, str(staging), metadata={METADATA_KEY: json.dumps(metadata)})
        copy_in_huge_pages(staging, tmp / FILE)
        staging.unlink()
        for f in companion_files(directory):  # the tokenizer and generation config, not other files found there
            shutil.copy2(f, tmp / f.name)
    kinds: dict[str, int] = {}
    for entry in metadata["linears"].values():
        kinds[entry["kind"]] = kinds.get(entry["kind"], 0) + 1
    return StandaloneExport(str(output), "standalone", kinds, (output / FILE).stat().st_size)
