"""Streaming quantization's model side: a model skeleton whose weights stay on disk until a block needs them.

`StreamingCheckpoint(folder)` builds the model from its config.json without allocating any weight (parameters on
the meta device, buffers such as RoPE frequencies computed as usual) and reads tensors one at a time from the
folder's safetensors files. The embeddings, the final norm and other small tensors outside the decoder blocks
load at once (calibration starts from them); block i loads when the engine reaches it (`load`) and, once its
linears are quantized, keeps only their packed formats (`release`); the LM head loads last (`finish`). Peak memory
is then the embeddings, one block in fp32, the packed blocks so far and the calibration activations, instead of
the whole fp32 model.

Whole-model stages reach the blocks through two hooks and one more step: transforms registered with `on_load`
run on each block as it is read (QuaRot's rotation), those registered with `on_finish` on the LM head once it is
read, and a pre-pass over the blocks reads each and drops it again (`unload`: back on the meta device) before
the quantization pass reads it once more (`bitquilt.calib.stages.ModelContext.walk_blocks`).

A block not loaded yet is the identity: capturing calibration inputs only needs block 0's input and the keyword
arguments every block receives (positions, masks), which do not depend on any block's weights.

Tensors are read with plain file reads into fresh memory rather than through a memory map, so that a block's
file pages do not stay mapped (and counted in RSS) after the block is freed.

With a `spill_dir` (the CLI gives the output's folder), what the run holds only to save it at the end leaves
memory: each block's packed linears once the block is done, and the embedding table once the calibration inputs
are captured (until `finish`, which reads it back). They are written to a file there (`bitquilt.tensor_writer`),
replaced by views of it mapped into memory (`bitquilt.mapped`) whose pages are given back, and the file is unlinked
at once (the mapping keeps its data): memory then stays at one block's working set however many blocks the model
has, and nothing is left on disk.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bitquilt.errors import UserError
from bitquilt.heap import return_free_memory
from bitquilt.mapped import map_file, release, tensor_view
from bitquilt.models.adapters import architecture_of, decoder_layers
from bitquilt.models.fused import checkpoint_name, fused_source, split_fused
from bitquilt.models.loading import TOKENIZER_FILES, _load_tokenizer, checked_config, empty_model
from bitquilt.nn.finite import all_finite
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.tensor_header import DTYPE_BYTES, read_header
from bitquilt.tensor_writer import SAFETENSORS_DTYPES, write_tensors

READ_CHUNK_BYTES = 64 * 2**20  # a tensor converted while it is read goes through a buffer of this size
DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}  # safetensors' dtype names -> torch's


@dataclass(frozen=True)
class _Entry:
    """Where one tensor lies in a safetensors file."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class TensorFiles:
    """The tensors of a folder's safetensors files (or of `files` in it) by name, each read from disk only when asked
    for, or mapped (also how `bitquilt.io.load_quantized` reads a saved model)."""

    def __init__(self, directory: Path, files: list[Path] | None = None):
        files = sorted(directory.glob("*.safetensors")) if files is None else files
        if not files:
            raise UserError(f"{directory} has no .safetensors weights; --stream (streaming quantization) reads a "
                            "Hugging Face folder with safetensors files")
        self.entries: dict[str, _Entry] = {}
        for path in files:
            header = read_header(path, {name: DTYPE_BYTES[name] for name in DTYPES})
            for name, e in header.entries.items():
                self.entries[name] = _Entry(path, DTYPES[e.dtype], e.shape, e.start, e.nbytes)
        self.nbytes = sum(f.stat().st_size for f in files)
        self._maps: dict[Path, mmap.mmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def mapped(self, name: str) -> torch.Tensor:
        """Tensor `name` in its stored dtype as a view of its file mapped into memory (`bitquilt.mapped`): its pages
        are read when first touched and can be given back with `bitquilt.mapped.release`."""
        e = self.entries[name]
        if e.path not in self._maps:
            self._maps[e.path] = map_file(e.path)
        return tensor_view(self._maps[e.path], e.start, e.nbytes, e.dtype, e.shape)

    def read(self, name: str, dtype: torch.dtype | None = None, rows: slice | None = None,
             row_shape: tuple[int, ...] = ()) -> torch.Tensor:
        """Tensor `name` in memory of its own, in its stored dtype or converted to `dtype` a chunk at a time (a bf16
        LM head read as fp32 never holds both copies whole); with `rows`, only those rows of it viewed as
        [rows, *row_shape] (a fused part, an expert's slice of a 3D tensor), read alone from the file."""
        e = self.entries[name]
        width = math.prod(row_shape)
        first, shape = (0, e.shape) if rows is None else (rows.start * width, (rows.stop - rows.start, *row_shape))
        numel = math.prod(shape)
        size = e.dtype.itemsize
        if dtype is None or dtype == e.dtype or not numel:
            raw = torch.empty(numel * size, dtype=torch.uint8)
            self._read_bytes(e, name, first * size, raw)
            return raw.view(e.dtype).reshape(shape).to(dtype or e.dtype)
        out = torch.empty(numel, dtype=dtype)
        chunk = max(READ_CHUNK_BYTES // size, 1)
        raw = torch.empty(min(chunk, numel) * size, dtype=torch.uint8)
        for start in range(0, numel, chunk):
            count = min(chunk, numel - start)
            self._read_bytes(e, name, (first + start) * size, raw[: count * size])
            out[start: start + count] = raw[: count * size].view(e.dtype)
        return out.reshape(shape)

    @staticmethod
    def _read_bytes(e: _Entry, name: str, offset: int, into: torch.Tensor) -> None:
        with open(e.path, "rb") as f:
            f.seek(e.start + offset)
            if f.readinto(into.numpy()) != into.numel():
                raise UserError(f"{e.path} ended inside tensor {name}; re-fetch or re-save the model")


def _identity(hidden_states: torch.Tensor, *_args: Any, **_kwargs: Any) -> torch.Tensor:
    return hidden_states


def _put(root: nn.Module, name: str, t: torch.Tensor, requires_grad: bool = False) -> None:
    """Make `t` the parameter or buffer `name` (relative to `root`) of `root`."""
    owner, _, leaf = name.rpartition(".")
    module = root.get_submodule(owner)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(t, requires_grad=requires_grad)
    else:
        module._buffers[leaf] = t


def fp_weights_held(module: nn.Module) -> int:
    """Full-precision linear weights `module` (a block, or all of them) holds in memory, in elements: loaded
    `nn.Linear` weights and the dequantized copies its QuantLinears cache."""
    count = 0
    for m in module.modules():
        if isinstance(m, nn.Linear) and not m.weight.is_meta:
            count += m.weight.numel()
        elif isinstance(m, QuantLinear) and m._dequantized is not None:
            count += m._dequantized.numel()
    return count


class StreamingCheckpoint:
    """A Hugging Face folder opened for streaming quantization: `model` is its skeleton, filled by `load(i)` /
    `release(i)` (the engine's block source, `bitquilt.calib.stages.BlockSource`) and `finish()`."""

    def __init__(self, directory: str | Path, dtype: torch.dtype = torch.float32, spill_dir: str | Path | None = None):
        from transformers import AutoConfig, GenerationConfig

        directory = Path(directory)
        if not (directory / "config.json").is_file():
            kind = "a .gguf file" if directory.suffix == ".gguf" else "not a Hugging Face model folder"
            raise UserError(f"{directory} is {kind}; --stream (streaming quantization) reads a Hugging Face folder "
                            "(config.json + .safetensors); quantize it without --stream")
        self.directory, self.dtype = directory, dtype
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        self._spilled_embedding = False
        self.files = TensorFiles(directory)
        config = checked_config(directory / "config.json",
                                lambda: AutoConfig.from_pretrained(directory, local_files_only=True))
        try:
            self.model = split_fused(empty_model(config, dtype))
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"cannot build the model in {directory}: {str(e).splitlines()[0]}") from None
        self.model.eval()
        if (directory / "generation_config.json").is_file():
            self.model.generation_config = GenerationConfig.from_pretrained(directory)
        has_tokenizer = any((directory / f).is_file() for f in TOKENIZER_FILES)
        self.tokenizer = _load_tokenizer(directory) if has_tokenizer else None
        self.arch = architecture_of(self.model)
        self.layers = decoder_layers(self.model, self.arch)
        self.peak_fp_weights = 0  # most fp linear weight elements the blocks held at once (see fp_weights_held)
        self.finished = False
        self.tied_head = bool(getattr(config, "tie_word_embeddings", False))  # as the checkpoint was saved
        self._on_load: list[Callable[[int, nn.Module], None]] = []
        self._on_finish: list[Callable[[nn.Module], None]] = []
        for layer in self.layers:
            layer.forward = _identity
        self._materialize(self.model, "", skip=(f"{self.arch.lm_head}.", f"{self.arch.layers}."))

    def on_load(self, fn: Callable[[int, nn.Module], None]) -> None:
        """Run fn(index, block) on every block `load` reads from now on."""
        self._on_load.append(fn)

    def on_finish(self, fn: Callable[[nn.Module], None]) -> None:
        """Run fn(model) in `finish`, once the LM head is read."""
        self._on_finish.append(fn)

    def _read(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor `name` from the folder, checked against the `shape` the config implies; floating point ones in
        `self.dtype` and finite; a part of a fused projection or an expert's linear (`bitquilt.models.fused`) is its
        rows of the checkpoint's tensor that holds it."""
        stored_name, stored_shape, rows = name, shape, None
        source = None if self._stored(name) else fused_source(self.model, name)
        if source is not None:
            stored_name, rows, lead = source
            stored_shape = (*lead, *shape[1:])
        stored_name = self._stored(stored_name) or stored_name
        if stored_name not in self.files:
            raise UserError(f"{self.directory} has no tensor {stored_name!r}; streaming reads checkpoints whose tensor "
                            "names match the model's modules; quantize without --stream")
        stored = self.files.entries[stored_name]
        if tuple(stored.shape) != tuple(stored_shape):
            raise UserError(f"{self.directory} is corrupt or was edited: tensor {stored_name} has shape "
                            f"{tuple(stored.shape)}, the config implies {tuple(stored_shape)}")
        t = self.files.read(stored_name, self.dtype if stored.dtype.is_floating_point else None, rows, shape[1:])
        if t.is_floating_point():
            if not all_finite(t):
                raise UserError(f"parameter {name} contains NaN/Inf values; refusing to quantize a corrupted model")
        return t

    def _stored(self, name: str) -> str | None:
        """The folder's name for tensor `name`: its own, or its name in the family's per-expert checkpoint layout
        (`bitquilt.models.fused.checkpoint_name`); None if the folder has neither."""
        return next((n for n in (name, checkpoint_name(self.model, name)) if n is not None and n in self.files), None)

    def _materialize(self, root: nn.Module, prefix: str, skip: tuple[str, ...] = ()) -> None:
        """Read every tensor of `root` still on the meta device (its model-level name is `prefix` + its own),
        except those whose name starts with one of `skip`."""
        meta = [(n, t) for n, t in [*root.named_parameters(), *root.named_buffers()] if t.is_meta]
        for name, old in meta:
            if not (prefix + name).startswith(skip):
                _put(root, name, self._read(prefix + name, tuple(old.shape)), old.requires_grad)

    def load(self, index: int) -> None:
        """Read block `index`'s weights from disk (before its stages run) and run the `on_load` functions on it."""
        layer = self.layers[index]
        self._materialize(layer, f"{self.arch.layers}.{index}.")
        vars(layer).pop("forward", None)
        for fn in self._on_load:
            fn(index, layer)
        self.peak_fp_weights = max(self.peak_fp_weights, fp_weights_held(self.layers))

    def unload(self, index: int) -> None:
        """Put block `index`'s weights back on the meta device (after a pre-pass visit): it is the identity again
        and the next `load` reads it afresh. Online modules the `on_load` functions attached stay (the next load
        replaces them)."""
        layer, prefix = self.layers[index], f"{self.arch.layers}.{index}."
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
            if self._stored(prefix + name) or fused_source(self.model, prefix + name) is not None:
                _put(layer, name, torch.empty(t.shape, dtype=t.dtype, device="meta"), t.requires_grad)
        layer.forward = _identity
        return_free_memory()

    def release(self, index: int) -> None:
        """Free what block `index` holds in full precision beyond its packed linears (the dequantized weights its
        QuantLinears cached while computing the next block's inputs); linears kept in full precision stay. With a
        spill directory the packed linears leave memory too (module docstring)."""
        linears = [m for m in self.layers[index].modules() if isinstance(m, QuantLinear)]
        for module in linears:
            module._dequantized = None
        if self.spill_dir is not None:
            self._spill_linears(linears, f"block{index}")
        return_free_memory()

    def _spill_linears(self, linears: list[QuantLinear], tag: str) -> None:
        """The packed tensors of `linears` replaced by mapped views of their spill (`_spill`); tensors that two of
        them share stay in memory, shared."""
        packed = {f"{i}.{name}": t for i, m in enumerate(linears) for name, t in m.named_buffers(recurse=False)}
        owned = [t.data_ptr() for t in packed.values() if t.numel()]
        if not packed or len(set(owned)) != len(owned):
            return
        views = self._spill(packed, tag)
        for i, module in enumerate(linears):
            for name in list(module._buffers):
                module._buffers[name] = views[f"{i}.{name}"]
            module.rebuild_format()

    def inputs_captured(self) -> None:
        """The calibration inputs of block 0 are taken: with a spill directory the embedding table leaves memory
        until `finish` (module docstring)."""
        embed = self.model.get_submodule(self.arch.embed)
        if self.spill_dir is None or embed.weight.is_meta:
            return
        view = self._spill({"weight": embed.weight.detach()}, "embedding")["weight"]
        _put(embed, "weight", view, embed.weight.requires_grad)
        self._spilled_embedding = True
        return_free_memory()

    def _restore_embedding(self) -> None:
        """The spilled embedding table copied into memory of its own, a chunk at a time with its mapped pages given
        back; the mapping closes on return (its address space counts against a process limit too)."""
        embed = self.model.get_submodule(self.arch.embed)
        mapped = embed.weight.detach()
        copy = torch.empty_like(mapped)
        rows = max(READ_CHUNK_BYTES // max(mapped[0].numel() * mapped.element_size(), 1), 1)
        for first in range(0, mapped.shape[0], rows):
            copy[first: first + rows] = mapped[first: first + rows]
            release([mapped[first: first + rows]])
        _put(embed, "weight", copy, embed.weight.requires_grad)
        self._spilled_embedding = False

    def _spill(self, tensors: dict[str, torch.Tensor], tag: str) -> dict[str, torch.Tensor]:
        """`tensors` (none sharing memory) written to a file in the spill directory and mapped back, the file
        unlinked: views with the same values whose pages the system may drop."""
        path = self.spill_dir / f".bitquilt-spill-{os.getpid()}-{tag}.safetensors"
        try:
            write_tensors(path, tensors)
            files = TensorFiles(self.spill_dir, [path])
            views = {name: files.mapped(name) for name in tensors}
        finally:
            path.unlink(missing_ok=True)
        return views

    def finish(self) -> nn.Module:
        """Load the LM head, tied to the embeddings if the config says so, or a copy of the embedding's tensor on
        disk if a stage untied a tied head (QuaRot), and run the `on_finish` functions; the model is then complete."""
        if self._spilled_embedding:  # back into memory of its own: stages may change it in place from here on
            self._restore_embedding()
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        elif self.tied_head:
            head = self.model.get_submodule(self.arch.lm_head)
            _put(head, "weight", self._read(f"{self.arch.embed}.weight", tuple(head.weight.shape)),
                 head.weight.requires_grad)
        self._materialize(self.model, "")
        for fn in self._on_finish:
            fn(self.model)
        self.finished = True
        return self.model
