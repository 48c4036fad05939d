"""Save and load quantized models: safetensors + a readable `quantization_config.json`.

Layout of a saved directory
  config.json             the base model's, with model_type "bitquilt" (its own under "bitquilt"): plain
                          transformers then refuses the directory instead of loading random weights in place of
                          the packed linears (an unknown quantization_config would only be warned about)
  generation_config.json, tokenizer files   the base model's, unchanged
  model.safetensors       every tensor: full-precision parameters under their usual names,
                          packed formats as `<linear>.packed_<tensor>` (+ `<linear>.bias`)
  quantization_config.json  format version, recipe, calibration, per-layer format + meta ("layers"; a
                          quantized input embedding has "kind": "embedding", a tied LM head "tied": the
                          embedding's name, its tensors then stored once, under the embedding),
                          the quantization report, library versions, and the online modules
                          ({host: {slot: {class, config}}}, see `bitquilt.nn.online`)
Writes go to a temporary sibling directory renamed into place, so an interrupted save never
leaves a directory that loads (and the next save removes what a killed one left). Loading checks
every packed layer against the shape its module must have, so an edited or damaged directory is
refused with one line instead of failing at the first forward pass.

Loading never builds the full-precision model: the skeleton has its parameters on the meta device
(`bitquilt.models.loading.empty_model`, shared with streaming quantization); the packed layers' tensors are
views of the file mapped into memory (`bitquilt.mapped`): a kernel reads them once to build its own layout and
their pages are given back right after, so a loaded model running on the kernels holds one copy of its
linears, not two. A full-precision embedding table no LM head reads is mapped too, its pages given back after each
lookup (`_lookup_tables`). The other tensors (norms, biases, a full-precision head) are read into memory of their own.
"""

from __future__ import annotations

import json
import os
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bitquilt.cache import MANIFEST, atomic_dir, claim_output, foreign_entries, written_entries
from bitquilt.errors import UserError, option
from bitquilt.formats import format_class
from bitquilt.formats.base import BUFFER_PREFIX, WeightFormat, split_buffers
from bitquilt.mapped import release_after_calls
from bitquilt.models.fused import split_fused
from bitquilt.models.loading import SAVED_MODEL_TYPE, checked_config, empty_model, load_model, resolve_path
from bitquilt.models.streaming import TensorFiles
from bitquilt.nn import online
from bitquilt.nn.quant_embedding import QuantEmbedding
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.runtime.module_tree import ModuleTreeConfig, ModuleTreeLM
from bitquilt.runtime.tokenizer import FastTokenizer
from bitquilt.tensor_writer import write_tensors

CONFIG_NAME = "quantization_config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 2  # 2: online modules by host and slot (version 1 kept rotations inside quantizers)
GUARD_TYPE = SAVED_MODEL_TYPE  # config.json's model_type in a saved directory; the base model's is kept under this key

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


def _shared_with(fmt: WeightFormat, seen: dict[tuple[int, ...], str], name: str) -> str | None:
    """The name of the layer seen before whose format holds the same tensors as `fmt` (a tied LM head), else None
    (and `name` is remembered as the owner of `fmt`'s tensors)."""
    key = tuple(t.data_ptr() for t in fmt.tensors().values())
    owner = seen.get(key)
    if owner is None:
        seen[key] = name
    return owner


def quantized_layers(model: nn.Module) -> dict[str, tuple[QuantLinear | QuantEmbedding, str | None]]:
    """{name: (module, the earlier layer whose packed tensors it shares, or None)} of every quantized linear and
    embedding, in model order."""
    seen: dict[tuple[int, ...], str] = {}
    return {name: (m, _shared_with(m.fmt, seen, name)) for name, m in model.named_modules()
            if isinstance(m, (QuantLinear, QuantEmbedding))}


def model_summary(model: nn.Module) -> dict[str, float]:
    """Stored size in MB and the mean bits per weight over the quantized weight matrices: the linears, and the LM
    head and input embeddings when they are quantized (a tied pair counted once); 32 (fp32 storage) if none."""
    q = [m.fmt for m, tied in quantized_layers(model).values() if tied is None]
    n_weights = sum(f.in_features * f.out_features for f in q)
    bits = sum(f.bits_per_weight() * f.in_features * f.out_features for f in q)
    return {"size_mb": model_nbytes(model) / 2**20, "bits_per_weight": bits / n_weights if n_weights else 32.0}


def _layer_config(module: QuantLinear | QuantEmbedding, tied: str | None) -> dict[str, Any]:
    if isinstance(module, QuantEmbedding):
        entry = {"format": module.fmt.name, "meta": module.fmt.meta(), "kind": "embedding"}
    else:
        entry = {"format": module.fmt.name, "meta": module.fmt.meta(), "bias": module.bias is not None}
    return entry if tied is None else {**entry, "tied": tied}


def check_output(path: str | Path, overwrite: bool = False, source: str | Path | None = None,
                 foreign_ok: bool = False) -> None:
    """Raise UserError unless the output directory `path` can be written (replaced if `overwrite`) without deleting
    `source` (the directory it is made from, if any), the working directory or files bitquilt did not write there
    (`bitquilt.cache.foreign_entries`; `foreign_ok`: the caller replaces only files of its own names); then claim it
    for this process (`bitquilt.cache.claim_output`). Call it before the work that fills it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"output {path} is a file, not a directory; give a directory path")
    target = path.resolve()
    kept = [(Path.cwd(), "the working directory")]
    if source is not None and Path(source).is_dir():
        kept.append((Path(source), f"the input {source}"))
    for directory, what in kept:
        if target == directory.resolve() or target in directory.resolve().parents:
            raise UserError(f"output {path} is or holds {what}, which writing it would delete; choose another "
                            "directory")
    if path.exists() and not overwrite:
        raise UserError(f"output directory {path} already exists; choose another path or pass "
                        f"{option('--overwrite', 'overwrite=True')}")
    if path.exists() and not foreign_ok and (foreign := foreign_entries(path)):
        raise UserError(f"{option('--overwrite', 'overwrite=True')} replaces only what bitquilt wrote, and {path} "
                        f"holds {', '.join(foreign[:3])}{' and more' if len(foreign) > 3 else ''}, which it did not "
                        "write; choose another directory, or move them away")
    check_writable(path)
    claim_output(path)


# what a save writes beside the weights and configs (the tokenizer's files, the generation config), by name: what an
# export carries over from a directory saved before manifests
COMPANIONS = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
              "chat_template.json")


def companion_files(directory: Path) -> list[Path]:
    """The files of the saved `directory` an export carries over: what the save wrote there but the weights, the
    configs and the manifest (its tokenizer and generation config), never a file someone else put there."""
    written = written_entries(directory)
    names = set(COMPANIONS) if written is None else written - {WEIGHTS_NAME, CONFIG_NAME, "config.json", MANIFEST}
    return [f for f in sorted(directory.iterdir()) if f.name in names and f.is_file()]


def check_writable(path: str | Path) -> None:
    """Raise UserError unless `path` (a file or directory) can be created: its nearest existing ancestor must be
    a directory this process can write into (tried, not guessed from permission bits)."""
    path = Path(path).absolute()
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"cannot write {path}: {parent} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".bitquilt-write-check-", dir=parent))
    except OSError as e:
        raise UserError(f"cannot write {path}: {parent} is not writable ({e.strerror})") from None


def save(model: nn.Module, directory: str | Path, tokenizer: Any = None, extra: dict[str, Any] | None = None,
         overwrite: bool = False) -> Path:
    """Write a quantized (or full-precision) model to `directory` atomically (`bitquilt.cache.atomic_dir`)."""
    directory = Path(directory)
    check_output(directory, overwrite)
    layers = {name: _layer_config(m, tied) for name, (m, tied) in quantized_layers(model).items()}
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
    with atomic_dir(directory) as tmp:
        model.config.save_pretrained(tmp)
        guard_config(tmp / "config.json")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_tensors(tmp / WEIGHTS_NAME, stored_tensors(model), metadata={"format": "pt", "bitquilt": "1"})
        (tmp / CONFIG_NAME).write_text(json.dumps(qconfig, indent=2, default=str))
    return directory


def guard_config(path: Path) -> None:
    """Give the config.json at `path` the model_type "bitquilt", keeping the base model's under "bitquilt":
    transformers' AutoConfig (and so AutoModel, vLLM) refuses an unknown model type with an error naming it."""
    config = json.loads(path.read_text())
    config[GUARD_TYPE] = {"model_type": config["model_type"],
                          "load_with": "bitquilt (bitquilt.load, `bitquilt eval`); for other runtimes: "
                                       "`bitquilt export --to gguf|compressed-tensors`"}
    config["model_type"] = GUARD_TYPE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def saved_config(directory: Path) -> dict[str, Any]:
    """The config.json of a saved directory as a dict, with the base model_type restored (a directory saved before
    the guard has it unchanged)."""
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not a readable model config: {e}") from None
    if config.get("model_type") == GUARD_TYPE:
        model_type = (config.pop(GUARD_TYPE, None) or {}).get("model_type")
        config["model_type"] = model_type
    return config


def base_config(directory: Path, config: dict[str, Any] | None = None) -> Any:
    """The transformers config of a saved directory, from its `saved_config` (read here unless given)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = saved_config(directory) if config is None else config
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise UserError(f"{directory / 'config.json'} is corrupt or was edited: its base model type {model_type!r} is "
                        "not one transformers knows; quantize the model again")
    return checked_config(directory / "config.json", lambda: CONFIG_MAPPING[model_type].from_dict(config))


def is_quantized_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG_NAME).is_file()


_MISSING = object()


def _json_kind(value: Any) -> str:
    """What a message calls the JSON value `value` (null, a list, a string...; "nothing" for `_MISSING`, a key the
    file lacks)."""
    if value is None or value is _MISSING:
        return "null" if value is None else "nothing"
    kinds = ((bool, "a boolean"), (dict, "an object"), (list, "a list"), (str, "a string"), ((int, float), "a number"))
    return next(name for cls, name in kinds if isinstance(value, cls))


def _check_qconfig(path: Path, qconfig: Any) -> None:
    """Raise UserError naming the first entry of a quantization config whose JSON type is not the one loading and
    `bitquilt inspect` read it as (the values themselves are checked against the model when it loads)."""
    def bad(entry: str, expected: str, value: Any) -> UserError:
        return UserError(f"{path}: {entry} must be {expected}, got {_json_kind(value)}; the file is damaged or was "
                         "edited")

    if not isinstance(qconfig, dict):
        raise bad("the file", "an object of quantization settings", qconfig)
    layers = qconfig.get("layers", _MISSING)
    if not isinstance(layers, dict):
        raise bad("'layers'", "an object of layer entries", layers)
    for name, info in layers.items():
        if not isinstance(info, dict):
            raise bad(f"layer entry {name!r}", "an object", info)
        for key, expected, required in (("format", str, True), ("meta", dict, True), ("kind", str, False),
                                        ("tied", str, False)):
            if (required or key in info) and not isinstance(info.get(key), expected):
                raise bad(f"{key!r} of layer {name!r}", "a string" if expected is str else "an object",
                          info.get(key, _MISSING))
    hosts = qconfig.get("online", {})
    if not isinstance(hosts, dict):
        raise bad("'online'", "an object of online modules by host", hosts)
    for host, slots in hosts.items():
        if not isinstance(slots, dict):
            raise bad(f"'online' entry {host!r}", "an object of online modules by slot", slots)
        for slot, entry in slots.items():
            if not (isinstance(entry, dict) and isinstance(entry.get("class"), str)
                    and isinstance(entry.get("config"), dict)):
                raise bad(f"online module {host}.{slot}", "an object with a string 'class' and an object 'config'",
                          entry)
    for key in ("recipe", "calibration", "report", "versions"):
        if not isinstance(qconfig.get(key), (dict, type(None))):
            raise bad(repr(key), "an object or null", qconfig[key])


def read_qconfig(directory: str | Path) -> dict[str, Any]:
    """The quantization_config.json of a saved directory; a UserError if it is unreadable, of another format version
    or not shaped as `save` writes it."""
    path = Path(directory) / CONFIG_NAME
    try:
        qconfig = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not a readable bitquilt quantization config: {e}") from None
    if isinstance(qconfig, dict) and qconfig.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: format version {qconfig.get('format_version')} is not supported (expected "
                        f"{FORMAT_VERSION}); quantize the model again with this version of bitquilt")
    _check_qconfig(path, qconfig)
    return qconfig


KINDS = {"linear": nn.Linear, "embedding": nn.Embedding}  # a saved layer's "kind" -> the module it replaces


def _layer_shape(directory: Path, model: nn.Module, name: str, kind: Any) -> tuple[int, int]:
    """[out, in] of the module a saved layer `name` of `kind` replaces; a UserError if the model has none there."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    if kind not in KINDS or not isinstance(module, KINDS[kind]):
        what = f"a layer of unknown kind {kind!r}" if kind not in KINDS else f"a quantized {kind} {name!r}"
        raise UserError(f"{directory} is corrupt or was edited: its config names {what}, which is not "
                        f"{'an' if kind == 'embedding' else 'a'} {kind} of this model")
    if kind == "embedding":
        return module.num_embeddings, module.embedding_dim
    return module.out_features, module.in_features


def _checked_format(directory: Path, shape: tuple[int, int], name: str, info: Any, tensors: dict[str, torch.Tensor],
                    bias: torch.Tensor | None, checked: set[tuple]) -> WeightFormat:
    """The saved format of layer `name`, rebuilt and checked against the [out, in] `shape` its module has; a
    UserError naming the layer, what it should be and what was found if they disagree (`checked`: layouts already
    tried)."""
    try:
        return _rebuild_format(info, tensors, bias, shape, checked)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        found = f"missing {e}" if isinstance(e, KeyError) else str(e)
        stored = {k: tuple(v.shape) for k, v in tensors.items()}
        raise UserError(f"{directory} is corrupt or was edited: layer {name} should be a {shape[0]}×{shape[1]} "
                        f"weight, but {found} (stored {info}, tensors {stored}); quantize the model again") from None


def _rebuild_format(info: Any, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None, shape: tuple[int, int],
                    checked: set[tuple]) -> WeightFormat:
    """`from_tensors` of one layer, then its [out, in] shape and bias checked; raises what the format raises, or
    ValueError. Each distinct layout is dequantized once, so a meta that does not fit its tensors (bits, group
    size) fails here rather than at the first forward pass (a few rows, for a format that dequantizes rows apart:
    a whole LM head or embedding table in fp32 would be most of a small model)."""
    fmt = format_class(info["format"]).from_tensors(tensors, info["meta"])
    if (fmt.out_features, fmt.in_features) != shape:
        raise ValueError(f"its format describes a {fmt.out_features}×{fmt.in_features} weight")
    if bool(info.get("bias")) != (bias is not None) or (bias is not None and tuple(bias.shape) != shape[:1]):
        raise ValueError("its bias is missing" if bias is None else f"its bias has shape {tuple(bias.shape)}")
    layout = (json.dumps(info, sort_keys=True), tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in tensors.items())))
    if layout not in checked:
        if hasattr(fmt, "dequantize_rows"):
            rows = min(shape[0], 8)
            got = (shape[0], *fmt.dequantize_rows(torch.arange(rows)).shape[1:]) if rows else (0, shape[1])
        else:
            got = tuple(fmt.dequantize().shape)
        if got != shape:
            raise ValueError(f"its tensors dequantize to a {got[0]}×{got[1]} matrix")
        checked.add(layout)
    return fmt


def _open_weights(directory: Path) -> TensorFiles:
    path = directory / WEIGHTS_NAME
    try:
        if not path.is_file():
            raise UserError("no such file")
        return TensorFiles(directory, [path])
    except (UserError, OSError) as e:
        raise UserError(f"cannot read {path} (missing or corrupted): {e}") from None


def _quantized_module(kind: str, fmt: WeightFormat, bias: torch.Tensor | None, old: nn.Module) -> nn.Module:
    if kind == "embedding":
        return QuantEmbedding.from_embedding(old, fmt)
    return QuantLinear(fmt, bias)


RUNTIMES = ("transformers", "bitquilt", "auto")


def _check_runtime(runtime: str) -> None:
    if runtime not in RUNTIMES:
        raise UserError(f"unknown runtime {runtime!r}; accepted: {', '.join(RUNTIMES)}")


def _skeleton(directory: Path, runtime: str) -> tuple[nn.Module, Any]:
    """(model without weights, its config) for `runtime`: transformers' model class, or bitquilt's own module tree
    (`bitquilt.runtime.module_tree`: no transformers import); "auto" takes the module tree where it covers the model."""
    _check_runtime(runtime)
    saved = saved_config(directory)
    if runtime != "transformers":
        try:
            tree = ModuleTreeConfig.from_dict(saved)
        except ValueError as e:
            raise UserError(f"{directory} is corrupt or was edited: {e}; quantize the model again") from None
        reason = tree.unsupported_reason()
        if reason is None:
            return ModuleTreeLM(tree), tree
        if runtime == "bitquilt":
            raise UserError(f"the bitquilt runtime cannot run {directory}: {reason}; use runtime 'transformers'")
    config = base_config(directory, saved)
    return split_fused(empty_model(config, torch.float32)), config


def _saved_tokenizer(directory: Path, model: nn.Module, config: Any) -> Any:
    """The tokenizer saved with the model (None if there is none): `FastTokenizer` for the bitquilt runtime,
    transformers' AutoTokenizer otherwise."""
    if isinstance(model, ModuleTreeLM):
        return FastTokenizer(directory) if FastTokenizer.available(directory) else None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, config=config)
    except (OSError, ValueError):
        return None


def _lookup_tables(model: nn.Module, files: TensorFiles, expected: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
    """{weight key: module} of the full-precision embedding tables stored in the model's own dtype, which load as
    views of the file (`bitquilt.mapped`) whose pages go back after each lookup: a lookup reads a few rows, so the
    rest of the table (qwen2.5-1.5b's fp32 one: 933 MB) need never be resident. Not for a table an LM head also
    reads (tied): every step reads it whole."""
    tables = {}
    for name, module in model.named_modules():
        key = f"{name}.weight"
        if isinstance(module, nn.Embedding) and key in files and key in expected \
                and files.entries[key].dtype == expected[key].dtype:
            tables[key] = module
    return tables


def load_quantized(directory: str | Path, runtime: str = "transformers") -> tuple[nn.Module, Any]:
    """Rebuild a model saved by `save` (no recalibration); returns (model, tokenizer or None). No full-precision
    copy of the model is built (see the module's docstring). runtime: "transformers" (the model class of
    transformers, with `generate`, masks and caches), "bitquilt" (`bitquilt.runtime.module_tree`: generation through
    `LeanDecoder` without importing transformers; llama, mistral, qwen2, qwen3), or "auto" (the module tree where it
    covers the model)."""
    directory = Path(directory)
    qconfig = read_qconfig(directory)
    files = _open_weights(directory)
    model, config = _skeleton(directory, runtime)
    checked: set[tuple] = set()
    formats: dict[str, WeightFormat] = {}
    consumed: set[str] = set()
    layers = qconfig["layers"]
    for name, info in sorted(layers.items(), key=lambda item: "tied" in item[1]):  # the tensors' owners first
        kind = info.get("kind", "linear")
        shape = _layer_shape(directory, model, name, kind)
        keys = [k for k in files.entries if k.startswith(f"{name}.{BUFFER_PREFIX}") and "." not in k[len(name) + 1:]]
        bias_key = f"{name}.bias" if kind == "linear" and f"{name}.bias" in files else None
        consumed.update(keys + [bias_key] * (bias_key is not None))
        bias = files.read(bias_key) if bias_key else None
        if "tied" in info:
            fmt = formats.get(info["tied"])
            if fmt is None or keys or (fmt.out_features, fmt.in_features) != shape or "tied" in layers[info["tied"]]:
                raise UserError(f"{directory} is corrupt or was edited: layer {name} is tied to {info['tied']!r}, "
                                f"which is no quantized {shape[0]}×{shape[1]} layer stored in it; quantize the model "
                                "again")
            if bool(info.get("bias")) != (bias is not None):
                raise UserError(f"{directory} is corrupt or was edited: layer {name}'s bias is missing")
        else:
            tensors = split_buffers({k: files.mapped(k) for k in keys}, name)
            fmt = _checked_format(directory, shape, name, info, tensors, bias, checked)
        formats[name] = fmt
        parent, _, child = name.rpartition(".")
        host = model.get_submodule(parent)
        setattr(host, child, _quantized_module(kind, fmt, bias, getattr(host, child)))
    read_by_heads = {info["tied"] for info in layers.values() if "tied" in info}
    for name, info in layers.items():  # a table no LM head reads in place gives its pages back after lookups
        if info.get("kind") == "embedding" and name not in read_by_heads:
            model.get_submodule(name).returns_pages = True
    try:  # before the tensors: some own buffers (key centres)
        online.restore(model, qconfig.get("online", {}))
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a host, slot or setting the model cannot have
        raise UserError(f"{directory} is corrupt or was edited: its online modules cannot be restored ({e}); "
                        "quantize the model again") from None
    expected = model.state_dict(keep_vars=True)
    head = "lm_head"  # tied to the embedding when the config says so and it is neither quantized nor stored
    tied = getattr(config, "tie_word_embeddings", False) and head not in layers and f"{head}.weight" not in files
    tables = {} if tied else _lookup_tables(model, files, expected)
    rest = {}
    for key in files.entries.keys() - consumed:
        t = files.mapped(key) if key in tables else files.read(key)
        want = expected.get(key)
        rest[key] = t.to(want.dtype) if want is not None and t.is_floating_point() and want.is_floating_point() else t
    try:
        missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    except RuntimeError as e:  # a tensor of the wrong shape
        raise UserError(f"{directory} is corrupt or was edited: {str(e).splitlines()[-1].strip()}") from None
    del rest, expected
    for module in tables.values():
        release_after_calls(module, [module.weight])
    missing = [k for k in missing if not (tied and k == f"{head}.weight") and k.rpartition(".")[0] not in layers]
    if tied:
        model.tie_weights()
    missing += [k for k, t in [*model.named_parameters(remove_duplicate=False),
                               *model.named_buffers(remove_duplicate=False)] if t.is_meta and k not in missing]
    if missing or unexpected:
        raise UserError(f"{directory} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.eval()
    set_quantization_record(model, qconfig)
    return model, _saved_tokenizer(directory, model, config)


def load(spec: str | Path, runtime: str = "transformers") -> tuple[nn.Module, Any]:
    """A packaged model name, HF directory, .gguf file, or saved quantized directory. runtime (saved directories):
    "transformers" (default; the transformers model class), "bitquilt" (bitquilt's own module tree: generation without
    importing transformers, less memory and a faster start) or "auto" (the module tree where it covers the model); see
    `load_quantized`. Defined here, with the runtime, so that loading imports no calibration code."""
    _check_runtime(runtime)
    path = resolve_path(spec)
    if is_quantized_dir(path):
        return load_quantized(path, runtime)
    if runtime == "bitquilt":
        raise UserError(f"the bitquilt runtime runs directories saved by bitquilt; {spec} is not one (use runtime "
                        "'transformers' or 'auto')")
    return load_model(path)
