"""Load a model and its tokenizer from anything a user may point at, with one-line errors.

Accepted: a packaged model name (fetched beforehand, never downloaded here), a local Hugging
Face folder (config.json + .safetensors), a .gguf file (dequantized once into the cache, keyed by its sha256:
`gguf_cache`), or a folder saved by `bitquilt.io.save` (it has a quantization_config.json). Weights load in fp32
by default because bf16 matmuls are very slow on CPU.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from bitquilt.cache import cache_dir
from bitquilt.errors import UserError
from bitquilt.models import registry
from bitquilt.models.fused import split_fused
from bitquilt.progress import route_transformers_bars
from bitquilt.tensor_header import read_header

SAVED_MODEL_TYPE = "bitquilt"  # config.json's model_type in a directory bitquilt saved (see bitquilt.io)

ACCEPTED = ("a packaged model name ({names}), a Hugging Face model folder (config.json + .safetensors), "
            "a .gguf file, or a folder saved by `bitquilt quantize`")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
T = TypeVar("T")


def _accepted() -> str:
    return ACCEPTED.format(names=", ".join(registry.MODELS))


def resolve_model_name(spec: str | Path) -> str:
    """A short display name: the packaged name, else the folder or file name (without .gguf)."""
    if isinstance(spec, str) and spec in registry.MODELS:
        return spec
    path = Path(spec).expanduser().resolve()
    if path.parent == cache_dir().resolve() / "models" and path.name in registry.MODELS:
        return path.name
    return path.stem if path.suffix == ".gguf" else path.name


def source_fingerprint(spec: str | Path) -> str:
    """Cache key for results computed from a model source: its path and its weights' sizes/mtimes, or the name."""
    p = Path(spec)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else ([p] if p.exists() else [])
    stamp = ",".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    return f"{p.resolve() if p.exists() else spec}|{stamp}"


def check_safetensors(path: Path) -> None:
    """Raise UserError unless `path` is a complete, consistent safetensors file (`bitquilt.tensor_header`)."""
    read_header(path)


def check_gguf(path: Path) -> None:
    """Raise UserError unless `path` reads as a whole GGUF file (header, metadata, tensor table, and every tensor's
    bytes inside the file: gguf's reader maps them all): a truncated download or copy fails here with one line,
    not deep in the loader."""
    from gguf import GGUFReader

    try:
        GGUFReader(path)
    except (ValueError, KeyError, IndexError, struct.error) as e:
        raise UserError(f"{path} is not a readable GGUF file (truncated or damaged; the reader says: "
                        f"{' '.join(str(e).split())})") from None


def empty_model(config: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The causal LM `config` describes, without its weights: every parameter on the meta device (nothing
    allocated), buffers such as RoPE frequencies and Gemma's embedding scale computed as usual (the non-persistent
    ones are in no checkpoint). The skeleton streaming quantization (`bitquilt.models.streaming`) and
    `bitquilt.io.load_quantized` fill from safetensors files; tied weights share one meta parameter."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def checked_config(path: Path, build: Callable[[], T]) -> T:
    """`build()`, transformers making a config from the config.json at `path`; a UserError naming the file, with
    the library's reason on one line, if it refuses it (a field of the wrong type, an unknown model type, no JSON)."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        return build()
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StrictDataclassError) as e:
        raise UserError(f"{path} is not a valid model config: {' '.join(str(e).split())}") from None


def config_model_type(config_path: Path) -> Any:
    """The "model_type" of the JSON config.json at `config_path` (None when the file holds no such field); a
    UserError naming the file when it is not JSON."""
    raw = checked_config(config_path, lambda: json.loads(config_path.read_text()))
    return raw.get("model_type") if isinstance(raw, dict) else None


def _load_tokenizer(path: Path, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"cannot load the tokenizer from {path}: {e}") from None


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    route_transformers_bars()
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise UserError(f"{path} has a config.json but no .safetensors weights; accepted: {_accepted()}")
    for w in weights:
        check_safetensors(w)
    config_path = path / "config.json"
    if config_model_type(config_path) == SAVED_MODEL_TYPE:
        raise UserError(f"{path} was saved by bitquilt but its quantization_config.json is missing: the directory is "
                        "incomplete; save or copy it again")
    config = checked_config(config_path, lambda: AutoConfig.from_pretrained(path, local_files_only=True))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise UserError(f"cannot load the model in {path}: {str(e).splitlines()[0]}") from None
    has_tokenizer = any((path / f).is_file() for f in TOKENIZER_FILES)
    return model, _load_tokenizer(path) if has_tokenizer else None


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    """The model and tokenizer of a GGUF file, from its fp32 conversion in the cache (`gguf_cache`: made once)."""
    from bitquilt.models import gguf_cache

    check_gguf(path)
    try:
        folder = gguf_cache.converted(path)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise UserError(f"cannot load the GGUF file {path}: {str(e).splitlines()[0]}") from None
    return _load_hf_dir(folder, dtype)


def resolve_path(spec: str | Path) -> Path:
    """The files behind a packaged model name or a path; an error naming what is accepted otherwise."""
    if not isinstance(spec, (str, Path)):
        raise UserError(f"a model is named by a string or a path, got {type(spec).__name__}; accepted: {_accepted()}")
    if isinstance(spec, str) and spec in registry.MODELS:
        return registry.fetched_dir(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"{str(spec)!r} is neither a packaged model nor an existing path; accepted: {_accepted()}")
    return path


def load_model(spec: str | Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    """(model in eval mode, tokenizer or None) from a packaged name, HF folder or .gguf file (a folder
    saved by `bitquilt.io.save` loads through `bitquilt.io.load_quantized`); fused projections split
    (`bitquilt.models.fused`)."""
    path = resolve_path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        model, tokenizer = _load_hf_dir(path, dtype)
    elif path.is_file() and path.suffix == ".gguf":
        model, tokenizer = _load_gguf(path, dtype)
    else:
        raise UserError(f"{path} is not a model; accepted: {_accepted()}")
    model.eval()
    return split_fused(model), tokenizer
