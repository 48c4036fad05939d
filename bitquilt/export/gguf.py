"""GGUF export: a model saved by `bitquilt quantize` as one file that llama.cpp and ollama run.

Weights: each linear's packed codes and scales are copied into GGUF blocks of 32 columns; nothing is re-quantized.
  uniform 4-bit symmetric   → Q4_0  exact: d = s and the 4-bit codes as they are; llama.cpp's x = d·(q − 8) is
                                    bitquilt's s·(q − z) with the symmetric zero z = 8
  uniform 8-bit symmetric   → Q8_0  exact: d = s, int8 q − 128 ∈ [−128, 127] (x = d·q₈; −128 is a valid int8 that
                                    llama.cpp's own quantizer never emits)
  uniform 4-bit asymmetric  → Q4_1  d = s and the codes exact; the block minimum m = −s·z is fp16 like d, so it is
                                    rounded to the nearest fp16 when s·z needs more than 11 significant bits (most
                                    blocks): the block's 32 weights then all move by |Δm| ≤ 2⁻¹¹·|s·z| < 0.8 % of
                                    the step s. `GGUFExport` counts these blocks and their largest shift.
  Each block takes the scale (and zero) of its group, so groups of any multiple of 32 columns (per-channel grids
  included) map unchanged; rows must be a multiple of 32 wide.
  ggml blocks (`formats.ggml`: K-quants and their fallbacks, from `quantize --gguf-type`) → their own type: the
                                    bytes are copied, rows permuted whole where llama.cpp's q/k order asks. The input
                                    embeddings and LM head of such a model are ggml blocks too and are written so.
  Refused, never refitted, with one line naming the layer, its format and what is exportable: 2/3-bit and 8-bit
  asymmetric grids, act-order (g_idx) columns, groups not a multiple of 32, bit-plane, MXINT and composite formats;
  and models with online modules (rotations, activation or KV quantizers), which llama.cpp cannot run.
Full-precision tensors (embeddings, norms, biases, linears kept in full precision, an untied LM head) are F32:
  bitquilt's fp32 values unchanged, which llama.cpp multiplies in F32 (F16 would round the weights, and llama.cpp
  would then round the activations to F16 as well).
Layout and metadata are those of llama.cpp's `convert_hf_to_gguf.py` for the families in `FAMILIES`: tensor names
  from gguf's TensorNameMap; the q/k rows of LLaMA attention permuted from Hugging Face's rotate-half order to
  llama.cpp's interleaved RoPE pairs (whole rows move, so a per-row grouped format stays exact); hyperparameters
  from the saved config. phi3 (Phi-3, Phi-4-mini): q/k/v stacked into `attn_qkv` and gate/up into `ffn_up` (gate rows
  first: llama.cpp's fused SwiGLU), each part's blocks kept as they are (`bitquilt.models.fused.fuse_parts`: parts of
  different types are refused), NeoX-style RoPE over the first partial_rotary_factor·head_dim dimensions, and the
  converter's original context and sliding-window keys; LongRoPE is refused like any RoPE scaling. gemma3 (Gemma 3
  text): NeoX-style RoPE, every norm (the four per layer, q/k norms, final) stored as 1 + w since Gemma's RMSNorm
  scales by (1 + w) and llama.cpp's by the stored weight (the adapter's `norm_offset`; the embedding's √hidden scale
  llama.cpp applies itself), the sliding window and the RoPE base of its layers, and the final logit soft-cap; a
  config llama.cpp's graph computes otherwise (query scale, layer pattern, attention soft-cap) is refused. gemma2
  (Gemma 2) as gemma3 without q/k norms and with a single RoPE base, every second layer global, and both soft-caps
  (attention scores and logits) in its keys. The tokenizer
  and the descriptive `general.*` keys are copied from a GGUF of the same model (the one a fetched packaged model was
  converted from, or `tokenizer_from`) once its vocabulary is checked
  to be the saved tokenizer's; otherwise the tokenizer keys are built from the saved byte-level BPE tokenizer
  (what `convert_hf_to_gguf.py` writes) and `general.name` is the saved directory's name.
The file is written to a temporary sibling and renamed into place: a failure never leaves a partial output.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from torch import nn

from bitquilt.cache import atomic_file, claim_output
from bitquilt.errors import UserError, option
from bitquilt.export.checks import check_layers, check_space, no_space
from bitquilt.export.gguf_experts import expert_stack, moe_keys, moe_refusal
from bitquilt.formats.base import WeightFormat
from bitquilt.formats.ggml import GGMLFormat
from bitquilt.formats.uniform import UniformFormat
from bitquilt.io import check_writable, is_quantized_dir, load_quantized, quantization_record
from bitquilt.models import registry
from bitquilt.models.adapters import architecture_for
from bitquilt.models.fused import fuse_parts
from bitquilt.models.loading import TOKENIZER_FILES
from bitquilt.nn.quant_embedding import QuantEmbedding
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.progress import progress_bar
from bitquilt.runtime.tokenizer import QWEN2_SPLIT, pre_tokenizer_steps

log = logging.getLogger(__name__)

QK = 32  # columns per Q4_0 / Q4_1 / Q8_0 block
EXACT = {(4, True): Q.Q4_0, (8, True): Q.Q8_0, (4, False): Q.Q4_1}  # (bits, symmetric) -> block type
EXPORTABLE = ("uniform 4-bit asymmetric (→ Q4_1), 4-bit symmetric (→ Q4_0) and 8-bit symmetric (→ Q8_0) grids with "
              "groups of a multiple of 32 columns and no act-order, ggml blocks (quantize --gguf-type), and linears "
              "kept in full precision (→ F32)")
# keys of a reference GGUF that describe its own file, not the model: never copied
OWN_KEYS = {gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE, gguf.Keys.General.QUANTIZATION_VERSION,
            gguf.Keys.General.ALIGNMENT}
# config keys that identify a packaged model (its GGUF then supplies the tokenizer)
MATCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads")
# Hugging Face pre-tokenizer steps -> llama.cpp's pre-tokenizer that splits text the same way
PRE_TOKENIZERS = {
    ("ByteLevel regex",): "gpt-2",
    ("Digits individual", "ByteLevel regex"): "smollm",
    (f"Split {QWEN2_SPLIT}", "ByteLevel"): "qwen2",
}

Field = tuple[Any, V, V | None]  # value, GGUF type, element type of an array
Key = tuple[str, Any, V]  # a hyperparameter key with {arch} unfilled, its value and type
Weight = torch.Tensor | UniformFormat | GGMLFormat


@dataclass(frozen=True)
class Stacked:
    """One MoE tensor of llama.cpp (`ffn_gate_exps`, ...): the same linear of every expert, expert 0 first, stored
    as one 3D tensor [experts, rows, columns] of one type."""

    parts: list[Weight]


Planned = tuple[str, Weight | Stacked, torch.Tensor | None]  # GGUF name, value, row order


def _rope(config: Any, layers: str = "full_attention") -> dict[str, Any]:
    """The RoPE parameters of the `layers` attention layers (Gemma 3 has its own for full and sliding-window ones)."""
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", 10000.0)}
    return rope.get(layers, rope)


def _rope_theta(config: Any, layers: str = "full_attention") -> float:
    rope = _rope(config, layers)
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"cannot export to GGUF: RoPE scaling {rope['rope_type']!r} is not supported (plain RoPE only)")
    return float(rope["rope_theta"])


def _phi3_keys(config: Any) -> list[Key]:
    """What convert_hf_to_gguf.py's Phi3MiniModel adds: the original context and the window (0: none)."""
    return [(gguf.Keys.Rope.SCALING_ORIG_CTX_LEN, config.original_max_position_embeddings, V.UINT32),
            (gguf.Keys.Attention.SLIDING_WINDOW, config.sliding_window or 0, V.UINT32)]


def _gemma3_keys(config: Any) -> list[Key]:
    """What convert_hf_to_gguf.py's Gemma3Model adds: the window and RoPE base of the sliding-window layers, if any
    (which layers they are llama.cpp knows: `_gemma3_refusal`), and the final logit soft-cap, if any."""
    keys: list[Key] = []
    if "sliding_attention" in config.layer_types:
        keys += [(gguf.Keys.Attention.SLIDING_WINDOW, config.sliding_window, V.UINT32),
                 (gguf.Keys.Rope.FREQ_BASE_SWA, _rope_theta(config, "sliding_attention"), V.FLOAT32)]
    if config.final_logit_softcapping:
        keys.append((gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING, config.final_logit_softcapping, V.FLOAT32))
    return keys


def _gemma2_keys(config: Any) -> list[Key]:
    """What convert_hf_to_gguf.py's Gemma2Model adds: the window and both soft-caps."""
    return [(gguf.Keys.Attention.SLIDING_WINDOW, config.sliding_window, V.UINT32),
            (gguf.Keys.LLM.ATTN_LOGIT_SOFTCAPPING, config.attn_logit_softcapping, V.FLOAT32),
            (gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING, config.final_logit_softcapping, V.FLOAT32)]


ORDINALS = {2: "second", 6: "sixth"}


def _gemma_refusal(config: Any, large_layers: int, period: int, caps: bool) -> str | None:
    """What of a Gemma config llama.cpp's graph does not compute, or None. The graph scales queries by 1/√head_dim
    (1/√(hidden/heads) for the largest model, of `large_layers` layers), makes every `period`-th layer global when
    there is a window, has no bidirectional attention, and soft-caps the scores and logits only where `caps`."""
    n, head_dim = config.num_hidden_layers, config.head_dim
    scalar = config.hidden_size // config.num_attention_heads if n == large_layers else head_dim
    pattern = ["full_attention" if i % period == period - 1 else "sliding_attention" for i in range(n)]
    if config.query_pre_attn_scalar != scalar:
        return f"queries scaled by 1/√{config.query_pre_attn_scalar} (llama.cpp scales them by 1/√{scalar})"
    if config.layer_types not in (pattern, ["full_attention"] * n):
        return f"sliding-window layers other than llama.cpp's (every {ORDINALS[period]} layer global)"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if not caps and config.attn_logit_softcapping:
        return "attention logit soft-capping"
    if caps and not (config.attn_logit_softcapping and config.final_logit_softcapping):
        return "no soft-caps (llama.cpp's gemma2 graph caps scores and logits)"
    return None


def _gemma3_refusal(config: Any) -> str | None:
    """llama.cpp's gemma3 graph: the 62-layer 27B scales by hidden/heads, every sixth layer is global, no score cap."""
    return _gemma_refusal(config, 62, 6, caps=False)


def _gemma2_refusal(config: Any) -> str | None:
    """llama.cpp's gemma2 graph: the 46-layer 27B scales by hidden/heads, every second layer is global, both caps."""
    return _gemma_refusal(config, 46, 2, caps=True)


@dataclass(frozen=True)
class Family:
    arch: gguf.MODEL_ARCH
    rotary_rows: bool  # q/k rows permuted to llama.cpp's interleaved RoPE pairs (LLaMA; the others are NeoX-style)
    keys: Callable[[Any], list[Key]] = lambda config: []  # what the family's converter adds to the common keys
    refusal: Callable[[Any], str | None] = lambda config: None  # what of a config llama.cpp's graph lacks


FAMILIES = {"llama": Family(gguf.MODEL_ARCH.LLAMA, True), "qwen2": Family(gguf.MODEL_ARCH.QWEN2, False),
            "phi3": Family(gguf.MODEL_ARCH.PHI3, False, _phi3_keys),  # fused attn_qkv and ffn_up (`fuse_parts`)
            "gemma2": Family(gguf.MODEL_ARCH.GEMMA2, False, _gemma2_keys, _gemma2_refusal),
            "gemma3_text": Family(gguf.MODEL_ARCH.GEMMA3, False, _gemma3_keys, _gemma3_refusal),
            # mixture of experts (`bitquilt.export.gguf_experts`): Mixtral is llama.cpp's llama with experts
            "mixtral": Family(gguf.MODEL_ARCH.LLAMA, True, moe_keys, moe_refusal),
            "qwen3_moe": Family(gguf.MODEL_ARCH.QWEN3MOE, False, moe_keys, moe_refusal),
            "olmoe": Family(gguf.MODEL_ARCH.OLMOE, False, moe_keys, moe_refusal)}


@dataclass
class GGUFExport:
    """What `export_gguf` wrote."""

    output: str
    arch: str
    tensors: dict[str, int]  # GGUF tensor type -> number of tensors
    size_mb: float
    tokenizer: str  # where the vocabulary came from
    q4_1_blocks: int = 0
    q4_1_rounded_minima: int = 0  # Q4_1 blocks whose minimum −s·z was rounded to fp16
    q4_1_max_shift_steps: float = 0.0  # the largest of those roundings, in quantization steps s
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------- weights
def refusal(fmt: WeightFormat) -> str | None:
    """Why `fmt` has no exact GGUF block type, or None."""
    if type(fmt) is GGMLFormat:
        return None
    if type(fmt) is not UniformFormat:
        return f"GGUF has no {fmt.name} format"
    if fmt.g_idx is not None:
        return "act-order (g_idx) columns do not form contiguous blocks"
    if fmt.group_size % QK or fmt.in_features % QK:
        return f"groups of {fmt.group_size} columns in rows of {fmt.in_features} do not split into blocks of {QK}"
    if (fmt.bits, fmt.sym) not in EXACT:
        return f"GGUF has no block type for {fmt.bits}-bit {'symmetric' if fmt.sym else 'asymmetric'} grids"
    return None


def block_type(fmt: UniformFormat | GGMLFormat) -> Q:
    return Q[fmt.type.name] if isinstance(fmt, GGMLFormat) else EXACT[fmt.bits, fmt.sym]


def rotary_order(rows: int, heads: int) -> torch.Tensor:
    """Rows of a q/k projection in llama.cpp's order: `convert_hf_to_gguf.py`'s permute, which moves row
    h·D + i·D/2 + j (Hugging Face's rotate-half halves i of head h) to h·D + 2j + i (interleaved pairs)."""
    return torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)


def gguf_blocks(fmt: UniformFormat, order: torch.Tensor | None = None) -> tuple[np.ndarray, torch.Tensor]:
    """`fmt` as GGUF blocks of its `block_type`, uint8 [out, in/32 · block bytes], rows in `order`; and per block the
    fp16 rounding of its minimum in steps (|Δm|/s; zero except for Q4_1)."""
    out, nb = fmt.out_features, fmt.in_features // QK
    group = torch.arange(nb) * QK // fmt.group_size  # the group of each block
    d, q = fmt.scales[:, group], fmt.codes()  # fp16 [out, nb], uint8 [out, in]
    z = fmt.zeros[:, group] if fmt.zeros is not None else None
    if order is not None:
        d, q, z = d[order], q[order], None if z is None else z[order]
    q = q.view(out, nb, QK)
    parts = [d.unsqueeze(-1).view(torch.uint8)]
    shift = torch.zeros(out, nb)
    if block_type(fmt) == Q.Q8_0:
        parts.append((q.to(torch.int16) - 128).to(torch.int8).view(torch.uint8))
    else:  # byte j holds element j (low nibble) and element j + 16 (high nibble)
        if z is not None:  # Q4_1
            exact = -(d.float() * z.float())  # exact in fp32: 11 + 4 significant bits
            m = exact.to(torch.float16)
            shift = (m.float() - exact).abs() / d.float().clamp(min=2**-24)
            parts.append(m.unsqueeze(-1).view(torch.uint8))
        parts.append(q[..., : QK // 2] | (q[..., QK // 2 :] << 4))
    return torch.cat(parts, dim=-1).reshape(out, -1).numpy(), shift


# ---------------------------------------------------------------- model
def check_exportable(model: nn.Module) -> Family:
    """The model's GGUF family; a one-line UserError naming the first layer that cannot be exported exactly."""
    config = model.config
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise UserError(f"cannot export a {config.model_type!r} model to GGUF: supported families: "
                        f"{', '.join(FAMILIES)}")
    if getattr(config, "use_sliding_window", False):
        raise UserError("cannot export to GGUF: sliding-window attention is not supported")
    for layers in dict.fromkeys(getattr(config, "layer_types", None) or ["full_attention"]):
        _rope_theta(config, layers)
    why = family.refusal(config)
    if why is not None:
        raise UserError(f"cannot export this {config.model_type!r} model to GGUF: {why}")
    table = next((n for n, m in model.named_modules() if isinstance(m, QuantEmbedding)
                  and not isinstance(m.fmt, GGMLFormat)), None)
    if table is not None:
        raise UserError(f"cannot export {table} to GGUF: quantized input embeddings (--head-bits) are not exported "
                        "yet; quantize with --head-bits 16, or with --gguf-type for llama.cpp's own types")
    check_layers(model, "GGUF", "which llama.cpp cannot run", refusal, EXPORTABLE, quantized_embeddings=True)
    return family


def tensor_plan(model: nn.Module, family: Family) -> list[Planned]:
    """(GGUF name, fp tensor or packed format, row order or None) of every tensor llama.cpp loads, in model order.
    A tied LM head is the embedding, stored once (llama.cpp then reuses `token_embd`). Norm weights are stored as
    the scale llama.cpp's RMSNorm multiplies by: offset + w for a family whose RMSNorm scales by (offset + w)."""
    config = model.config
    offset = architecture_for(config.model_type).norm_offset
    names = gguf.get_tensor_name_map(family.arch, config.num_hidden_layers)
    heads = {"self_attn.q_proj": config.num_attention_heads,
             "self_attn.k_proj": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    experts = architecture_for(config.model_type).experts
    plan, seen, stacks = [], set(), {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        packed = isinstance(module, QuantLinear | QuantEmbedding)
        own: list[tuple[str, Any]] = [(f"{prefix}weight", module.fmt)] if packed else []
        own += [(prefix + n, p) for n, p in module.named_parameters(recurse=False)]
        n_head = next((h for suffix, h in heads.items() if module_name.endswith(suffix)), None)
        for hf_name, value in own:
            if id(value) in seen:
                continue
            seen.add(id(value))
            stacked = expert_stack(hf_name, experts)
            if stacked in stacks:
                stacks[stacked].parts.append(value)
                continue
            name = names.get_name(stacked or hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise UserError(f"cannot export {hf_name} to GGUF: llama.cpp's {gguf.MODEL_ARCH_NAMES[family.arch]} "
                                "architecture has no such tensor")
            rows = value.out_features if isinstance(value, WeightFormat) else value.shape[0]
            order = rotary_order(rows, n_head) if family.rotary_rows and n_head else None
            if offset and name.endswith("norm.weight"):
                value = value.detach() + offset
            if stacked is not None:
                value = stacks[stacked] = Stacked([value])
            plan.append((name, value, order))
    for name, value in stacks.items():
        types = sorted({_type_name(v) for v in value.parts})
        if len(types) > 1:
            raise UserError(f"cannot export {name} to GGUF: its experts are of different types ({', '.join(types)}) "
                            "and llama.cpp stores them as one tensor of one type; quantize every expert alike")
    return plan


def _type_name(value: Weight) -> str:
    """The GGUF type `value` is written as."""
    return block_type(value).name if isinstance(value, WeightFormat) else "F32"


def model_fields(config: Any, family: Family) -> dict[str, Field]:
    """The architecture keys llama.cpp reads, from the saved config."""
    arch = gguf.MODEL_ARCH_NAMES[family.arch]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    keys = gguf.Keys
    fields = [(keys.LLM.VOCAB_SIZE, config.vocab_size, V.UINT32),
              (keys.LLM.CONTEXT_LENGTH, config.max_position_embeddings, V.UINT32),
              (keys.LLM.EMBEDDING_LENGTH, config.hidden_size, V.UINT32),
              (keys.LLM.BLOCK_COUNT, config.num_hidden_layers, V.UINT32),
              (keys.LLM.FEED_FORWARD_LENGTH, config.intermediate_size, V.UINT32),
              (keys.Attention.HEAD_COUNT, heads, V.UINT32),
              (keys.Attention.HEAD_COUNT_KV, getattr(config, "num_key_value_heads", None) or heads, V.UINT32),
              (keys.Attention.LAYERNORM_RMS_EPS, config.rms_norm_eps, V.FLOAT32),
              (keys.Rope.FREQ_BASE, _rope_theta(config), V.FLOAT32),
              (keys.Rope.DIMENSION_COUNT, int(head_dim * _rope(config).get("partial_rotary_factor", 1.0)),
               V.UINT32)]
    if head_dim != config.hidden_size // heads:
        fields += [(keys.Attention.KEY_LENGTH, head_dim, V.UINT32), (keys.Attention.VALUE_LENGTH, head_dim, V.UINT32)]
    fields += family.keys(config)
    return {key.format(arch=arch): (value, vtype, None) for key, value, vtype in fields}


# ---------------------------------------------------------------- tokenizer
def hf_tokens(tokenizer: Any, vocab_size: int) -> list[str]:
    """The tokenizer's tokens by id over the model's `vocab_size` rows; ids it lacks are `[PAD<id>]`, as
    `convert_hf_to_gguf.py` names them."""
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    if max(by_id) >= vocab_size:
        raise UserError(f"the saved tokenizer has token id {max(by_id)}, beyond the model's {vocab_size} embeddings")
    return [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]


def pre_tokenizer_name(pre: dict[str, Any] | None) -> str | None:
    """llama.cpp's name for a Hugging Face pre-tokenizer (tokenizer.json's `pre_tokenizer`), if it has one."""
    return PRE_TOKENIZERS.get(pre_tokenizer_steps(pre))


def tokenizer_fields(tokenizer: Any, vocab_size: int) -> dict[str, Field]:
    """llama.cpp's tokenizer keys for a byte-level BPE Hugging Face tokenizer, as `convert_hf_to_gguf.py` writes
    them (tokens, types, merges, special ids, whether BOS is added, chat template)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    pre = pre_tokenizer_name(spec.get("pre_tokenizer"))
    if spec.get("model", {}).get("type") != "BPE" or pre is None:
        raise UserError("cannot describe the saved tokenizer to llama.cpp (only byte-level BPE tokenizers with a "
                        "GPT-2, SmolLM or Qwen2 pre-tokenizer are known); pass a GGUF file of the same model with "
                        "--tokenizer-from (tokenizer_from=)")
    tokens = hf_tokens(tokenizer, vocab_size)
    added = tokenizer.added_tokens_decoder
    types = [gguf.TokenType.CONTROL if i in added and added[i].special else gguf.TokenType.USER_DEFINED if i in added
             else gguf.TokenType.UNUSED if token == f"[PAD{i}]" else gguf.TokenType.NORMAL
             for i, token in enumerate(tokens)]
    keys = gguf.Keys.Tokenizer
    fields: dict[str, Field] = {
        keys.MODEL: ("gpt2", V.STRING, None), keys.PRE: (pre, V.STRING, None),
        keys.LIST: (tokens, V.ARRAY, V.STRING), keys.TOKEN_TYPE: ([int(t) for t in types], V.ARRAY, V.INT32),
        keys.MERGES: ([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]], V.ARRAY, V.STRING),
    }
    for key, token_id in ((keys.BOS_ID, tokenizer.bos_token_id), (keys.EOS_ID, tokenizer.eos_token_id),
                          (keys.UNK_ID, tokenizer.unk_token_id), (keys.PAD_ID, tokenizer.pad_token_id)):
        if token_id is not None:
            fields[key] = (token_id, V.UINT32, None)
    ids, plain = tokenizer("a")["input_ids"], tokenizer("a", add_special_tokens=False)["input_ids"]
    fields[keys.ADD_BOS] = (len(ids) > len(plain) and ids[0] == tokenizer.bos_token_id, V.BOOL, None)
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        fields[keys.CHAT_TEMPLATE] = (tokenizer.chat_template, V.STRING, None)
    return fields


def reference_fields(path: Path) -> dict[str, Field]:
    """The tokenizer and descriptive `general.*` keys of the GGUF file `path`."""
    if not path.is_file():
        raise UserError(f"tokenizer source {path} is not a file")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise UserError(f"{path} is not a readable GGUF file: {e}") from None
    return {name: (f.contents(), f.types[0], f.types[-1] if f.types[0] == V.ARRAY else None)
            for name, f in reader.fields.items()
            if name.startswith(("tokenizer.", "general.")) and name not in OWN_KEYS}


def packaged_gguf(config: Any) -> Path | None:
    """The GGUF file a fetched packaged model was converted from, if `config` describes that model."""
    ours = config.to_dict()
    for name, spec in registry.MODELS.items():
        folder = registry.model_dir(name)
        if registry.is_fetched(name) and (folder / spec.file).is_file():
            packaged = json.loads((folder / "config.json").read_text())
            if all(packaged.get(k) == ours.get(k) for k in MATCH_KEYS):
                return folder / spec.file
    return None


def same_tokens(a: list[str], b: list[str]) -> bool:
    """Whether two vocabularies are the same, SentencePiece's space symbol ▁ taken as the space it stands for (a
    Gemma GGUF stores its runs of spaces as spaces, transformers' tokenizer made from it as runs of ▁)."""
    return a == b or [t.replace("▁", " ") for t in a] == [t.replace("▁", " ") for t in b]


def tokenizer_metadata(config: Any, tokenizer: Any, tokenizer_from: str | Path | None) -> tuple[dict[str, Field], str]:
    """The tokenizer (and, from a reference GGUF, descriptive general.*) keys, and where they came from."""
    reference = Path(tokenizer_from) if tokenizer_from is not None else packaged_gguf(config)
    if reference is not None:
        fields = reference_fields(reference)
        tokens = fields.get(gguf.Keys.Tokenizer.LIST, (None,))[0]
        if tokens is not None and len(tokens) == config.vocab_size and (
                tokenizer is None or same_tokens(tokens, hf_tokens(tokenizer, config.vocab_size))):
            return fields, str(reference)
        if tokenizer_from is not None:
            raise UserError(f"{reference} does not have the saved model's vocabulary; pass a GGUF file of the same "
                            "model")
    if tokenizer is None:
        log.warning("the saved model has no tokenizer: the GGUF file gets no vocabulary (llama.cpp can run it on "
                    "token ids only); pass --tokenizer-from a GGUF file of the same model")
        return {gguf.Keys.Tokenizer.MODEL: ("none", V.STRING, None)}, "none"
    return tokenizer_fields(tokenizer, config.vocab_size), "saved Hugging Face tokenizer"


# ---------------------------------------------------------------- writing
def check_output_file(path: Path, overwrite: bool, source: Path) -> None:
    """Raise UserError unless the file `path` can be written (replaced if `overwrite`) without replacing a file of
    `source`, the saved model it is made from: call it before the work."""
    if path.is_dir():
        raise UserError(f"output {path} is a directory; give a file path such as {path / 'model.gguf'}")
    if path.exists() and source.resolve() in path.resolve().parents:
        raise UserError(f"output {path} is a file of the input {source}, which writing it would replace; give a new "
                        "file name")
    if path.exists() and not overwrite:
        raise UserError(f"output file {path} already exists; choose another path or pass "
                        f"{option('--overwrite', 'overwrite=True')}")
    if path.exists() and path.open("rb").read(4) != b"GGUF":  # the magic every GGUF file starts with
        raise UserError(f"{option('--overwrite', 'overwrite=True')} replaces only a GGUF file, and {path} is not one; "
                        "choose another file name")
    check_writable(path)
    claim_output(path, directory=False)


def file_type(plan: list[Planned], mix: str | None) -> gguf.LlamaFileType:
    """general.file_type: the GGUF mix the model was quantized for, else the type most weights have."""
    if mix is not None:
        return gguf.LlamaFileType[f"MOSTLY_{mix}"]
    weights: Counter[Q] = Counter()
    for _, value, _ in plan:
        for v in value.parts if isinstance(value, Stacked) else [value]:
            if isinstance(v, WeightFormat):
                weights[block_type(v)] += v.out_features * v.in_features
    name = mix or (weights.most_common(1)[0][0].name if weights else "F32")
    members = gguf.LlamaFileType.__members__  # a K-quant type names its _M mix
    return members.get(f"MOSTLY_{name}", members.get(f"MOSTLY_{name}_M", gguf.LlamaFileType.ALL_F32))


def tensor_data(value: Weight, order: torch.Tensor | None) -> tuple[np.ndarray, torch.Tensor | None]:
    """`value` as the array GGUF stores (its blocks, or F32 values), rows in `order`; and for Q4_1 the fp16 shift of
    each block's minimum in steps (`gguf_blocks`), else None."""
    if isinstance(value, GGMLFormat):
        return (value.blocks if order is None else value.blocks[order]).numpy(), None
    if isinstance(value, UniformFormat):
        blocks, shift = gguf_blocks(value, order)
        return blocks, shift if block_type(value) == Q.Q4_1 else None
    t = value.detach().float()
    return (t if order is None else t[order]).contiguous().numpy(), None


def write_gguf(model: nn.Module, tokenizer: Any, output: str | Path, name: str,
               tokenizer_from: str | Path | None = None, progress: bool = False,
               mix: str | None = None) -> GGUFExport:
    """Write the (quantized) `model` as the GGUF file `output`, atomically; see the module docstring. `mix`: the
    llama.cpp mix its ggml blocks were chosen by (`quantize --gguf-type`), for general.file_type."""
    t0 = time.perf_counter()
    output = Path(output)
    family = check_exportable(model)
    arch = gguf.MODEL_ARCH_NAMES[family.arch]
    plan = tensor_plan(model, family)
    fields, source = tokenizer_metadata(model.config, tokenizer, tokenizer_from)
    fields.setdefault(gguf.Keys.General.NAME, (name, V.STRING, None))
    fields[gguf.Keys.General.QUANTIZED_BY] = ("bitquilt", V.STRING, None)
    fields |= model_fields(model.config, family)
    types: Counter[str] = Counter()
    shifts = [torch.zeros(0)]
    with atomic_file(output) as tmp, progress_bar(total=len(plan), desc="export gguf", unit="tensor",
                                                  disable=not progress) as bar:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            for key, (value, vtype, sub_type) in fields.items():
                if vtype != V.ARRAY or len(value):  # GGUF has no empty arrays (gguf's add_array skips them too)
                    writer.add_key_value(key, value, vtype, sub_type)
            writer.add_file_type(file_type(plan, mix))
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            for tensor_name, value, order in plan:
                bar.update()
                parts = [tensor_data(v, order) for v in (value.parts if isinstance(value, Stacked) else [value])]
                data = parts[0][0] if len(parts) == 1 else np.stack([p[0] for p in parts])
                first = value.parts[0] if isinstance(value, Stacked) else value
                writer.add_tensor(tensor_name, data,
                                  raw_dtype=block_type(first) if isinstance(first, WeightFormat) else None)
                types[_type_name(first)] += 1
                shifts += [p[1].flatten() for p in parts if p[1] is not None]
            bar.close()  # its last line drawn before anything the write may say
            need = sum(ti.nbytes for shard in writer.tensors for ti in shard.values()) + 2**20  # + header, metadata
            free = check_space(output, need)
            try:
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_tensors_to_file()
            except OSError as e:  # numpy's tofile names no file, only byte counts
                raise no_space(output, need, free, e) from None
        finally:
            writer.close()
    shift = torch.cat(shifts)
    return GGUFExport(output=str(output), arch=arch, tensors=dict(types), size_mb=output.stat().st_size / 2**20,
                      tokenizer=source, q4_1_blocks=shift.numel(), q4_1_rounded_minima=int((shift > 0).sum()),
                      q4_1_max_shift_steps=float(shift.max()) if shift.numel() else 0.0,
                      seconds=time.perf_counter() - t0)


def export_gguf(directory: str | Path, output: str | Path, overwrite: bool = False,
                tokenizer_from: str | Path | None = None, progress: bool = False) -> GGUFExport:
    """Export the model saved by `bitquilt.io.save` in `directory` to the GGUF file `output`."""
    directory, output = Path(directory), Path(output)
    check_output_file(output, overwrite, directory)
    if not is_quantized_dir(directory):
        raise UserError(f"{directory} is not a model saved by bitquilt (no quantization_config.json); export takes "
                        "the output directory of `bitquilt quantize`")
    model, tokenizer = load_quantized(directory)
    check_exportable(model)  # what GGUF cannot hold, named by part before fusing them could fail on it instead
    fuse_parts(model)  # the family's fused tensors, where llama.cpp reads them so (phi3)
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = None  # transformers makes up an empty one for a folder without tokenizer files
    mix = ((quantization_record(model) or {}).get("recipe") or {}).get("gguf_type")
    return write_gguf(model, tokenizer, output, directory.resolve().name, tokenizer_from, progress, mix)
