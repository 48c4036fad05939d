"""Save and load quantized models: safetensors + a readable `quantization_config.json`.

Layout of a saved directory
  config.json, generation_config.json, tokenizer files   the base model's, unchanged
  model.safetensors       every tensor: full-precision parameters under their usual names,
                          packed formats as `<linear>.packed_<tensor>` (+ `<linear>.bias`)
  quantization_config.json  format version, recipe, calibration, per-linear format + meta,
                          the quantization report, library versions, and the online modules
                          ({host: {slot: {class, config}}}, see `bitquilt.nn.online`)
Writes go to a temporary sibling directory renamed into place, so an interrupted save never
leaves a directory that loads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from bitquilt.errors import UserError
from bitquilt.formats import format_class
from bitquilt.formats.base import split_buffers
from bitquilt.nn import online
from bitquilt.nn.quant_linear import QuantLinear

CONFIG_NAME = "quantization_config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 2  # 2: online modules by host and slot (version 1 kept rotations inside quantizers)

_records: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


def set_quantization_record(model: nn.Module, record: dict[str, Any]) -> None:
    """Remember how `model` was quantized (recipe, calibration, report): saved with it, read by evaluation."""
    _records[model] = record


def quantization_record(model: nn.Module) -> dict[str, Any] | None:
    """{"recipe", "calibration", "report", ...} of a model quantized in this process or loaded from disk."""
    return _records.get(model)


def versions() -> dict[str, str]:
    import transformers

    from bitquilt import __version__

    return {"bitquilt": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def stored_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """All tensors to store; a tied LM head is stored once (under the embedding)."""
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    seen: dict[int, str] = {}
    for name in list(tensors):
        ptr = tensors[name].data_ptr()
        if ptr in seen and tensors[name].numel():
            del tensors[name]  # shared storage (tied weights): safetensors refuses aliases
        else:
            seen[ptr] = name
    return tensors


def model_nbytes(model: nn.Module) -> int:
    """Bytes the model occupies as stored (packed formats, tied weights counted once)."""
    return sum(t.numel() * t.element_size() for t in stored_tensors(model).values())


def model_summary(model: nn.Module) -> dict[str, float]:
    """Stored size in MB and the mean bits per weight over the quantized linears (32: fp32 storage, if none)."""
    q = [m for m in model.modules() if isinstance(m, QuantLinear)]
    n_weights = sum(m.in_features * m.out_features for m in q)
    bits = sum(m.fmt.bits_per_weight() * m.in_features * m.out_features for m in q)
    return {"size_mb": model_nbytes(model) / 2**20, "bits_per_weight": bits / n_weights if n_weights else 32.0}


def save(model: nn.Module, directory: str | Path, tokenizer: Any = None, extra: dict[str, Any] | None = None,
         overwrite: bool = False) -> Path:
    """Write a quantized (or full-precision) model to `directory` atomically."""
    directory = Path(directory)
    if directory.exists() and not overwrite:
        raise UserError(f"output directory {directory} already exists; choose another path or pass overwrite")
    directory.parent.mkdir(parents=True, exist_ok=True)
    layers = {
        name: {"format": m.fmt.name, "meta": m.fmt.meta(), "bias": m.bias is not None}
        for name, m in model.named_modules()
        if isinstance(m, QuantLinear)
    }
    record = quantization_record(model) or {}
    qconfig = {
        "format_version": FORMAT_VERSION,
        "layers": layers,
        "online": online.online_state(model),
        "recipe": record.get("recipe"),
        "calibration": record.get("calibration"),
        "report": record.get("report"),
        "versions": versions(),
        **(extra or {}),
    }
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        save_file(stored_tensors(model), str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "bitquilt": "1"})
        (tmp / CONFIG_NAME).write_text(json.dumps(qconfig, indent=2, default=str))
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old)
        else:
            os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def is_quantized_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG_NAME).is_file()


def read_qconfig(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_NAME
    try:
        qconfig = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not a readable bitquilt quantization config: {e}") from None
    if qconfig.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: format version {qconfig.get('format_version')} is not supported (expected "
                        f"{FORMAT_VERSION}); quantize the model again with this version of bitquilt")
    return qconfig


def load_quantized(directory: str | Path) -> tuple[nn.Module, Any]:
    """Rebuild a model saved by `save` (no recalibration); returns (model, tokenizer or None)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    qconfig = read_qconfig(directory)
    try:
        tensors = load_file(str(directory / WEIGHTS_NAME))
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {directory / WEIGHTS_NAME} (missing or corrupted): {e}") from None
    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, info in qconfig["layers"].items():
        fmt_tensors = split_buffers(tensors, name)
        fmt = format_class(info["format"]).from_tensors(fmt_tensors, info["meta"])
        bias = tensors.pop(f"{name}.bias", None)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, QuantLinear(fmt, bias))
    online.restore(model, qconfig.get("online", {}))  # before the tensors: some own buffers (key centres)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    quantized = tuple(f"{name}." for name in qconfig["layers"])
    missing = [k for k in missing if k not in tied and not k.startswith(quantized)]
    if missing or unexpected:
        raise UserError(f"{directory} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
    model.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError):
        tokenizer = None
    set_quantization_record(model, qconfig)
    return model, tokenizer
