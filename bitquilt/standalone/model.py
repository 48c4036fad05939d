"""A standalone export loaded for generation: numpy arrays over the mapped file, one C call per forward.

`StandaloneModel(directory)` maps `standalone.safetensors` (`bitquilt.export.standalone` writes it), reads its
metadata and loads the tokenizer; `begin(max_len)` builds the library's model for a sequence of up to `max_len`
positions (RoPE tables for those positions, zeroed key/value caches whose pages are touched only as positions
fill), and `forward(ids)` appends ids at the current position and returns the last one's logits. The weights are
never copied: the library's linears point into the mapping.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bitquilt.errors import UserError
from bitquilt.isa import INT8_ISAS, choose
from bitquilt.models.tokenizer import FastTokenizer
from bitquilt.standalone.file import MappedTensors
from bitquilt.standalone.library import last_error, library

FILE = "standalone.safetensors"  # what bitquilt.export.standalone writes, and its metadata
METADATA_KEY = "bitquilt.standalone"
FORMAT_VERSION = 1
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")  # a layer's linears in the order of csrc/standalone.cpp's bq_add_layer


def _pointer(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def set_threads(threads: int) -> None:
    """Threads of every following call (OpenMP)."""
    if threads < 1:
        raise UserError(f"threads must be at least 1, got {threads}")
    library().bq_set_threads(threads)


def set_isa(isa: str | None = None) -> str:
    """Run the 4- and 2-bit kernel on `isa` ("avx2", "avx512"), or `$BITQUILT_ISA` / the widest when None; the path
    now taken (`bitquilt.isa.choose`)."""
    lib = library()
    chosen = choose("standalone", INT8_ISAS if lib.bq_has_vnni() else INT8_ISAS[:1], isa)
    lib.bq_set_vnni(int(chosen == "avx512"))
    return chosen


def rope_tables(inv_freq: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [max_len, head_dim] of position·ω (the halves repeated): the angle in fp32 as the torch runtimes
    compute it, its cos and sin in fp64 rounded to fp32 (numpy's fp32 cos and sin differ from torch's by an ulp
    here and there; these are, but for rare double roundings, the correctly rounded values)."""
    angles = np.arange(max_len, dtype=np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
    angles = np.concatenate([angles, angles], axis=1).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class StandaloneModel:
    """A standalone export for one sequence at a time (module docstring)."""

    _handle: int | None = None

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not (self.directory / FILE).is_file():
            raise UserError(f"{self.directory} is not a standalone export (no {FILE}); write one with "
                            "`bitquilt export SAVED_DIR -o OUT --to standalone`")
        self.tensors = MappedTensors(self.directory / FILE)
        try:
            self.config: dict[str, Any] = json.loads(self.tensors.metadata[METADATA_KEY])
        except (KeyError, ValueError):
            raise UserError(f"{self.directory / FILE} has no standalone metadata; re-export the model") from None
        if self.config.get("format_version") != FORMAT_VERSION:
            raise UserError(f"{self.directory / FILE} is standalone format {self.config.get('format_version')}; this "
                            f"bitquilt reads {FORMAT_VERSION}: re-export the model")
        self.tokenizer = FastTokenizer(self.directory) if FastTokenizer.available(self.directory) else None
        self.vocab_size: int = self.config["vocab_size"]
        self.max_positions: int = self.config["max_positions"]
        self.pos = 0
        self._keep: list[np.ndarray] = []
        self.caches: list[tuple[np.ndarray, np.ndarray]] = []  # per layer, keys and values [kv_heads, max_len, hd]
        self._lib = library()
        set_isa()

    def begin(self, max_len: int) -> None:
        """Start a sequence of up to `max_len` positions (the previous one, if any, is dropped)."""
        if not 0 < max_len <= self.max_positions:
            raise UserError(f"a sequence of {max_len} positions does not fit the model's {self.max_positions}")
        self.close()
        c, t = self.config, self.tensors
        cos, sin = rope_tables(t["rope.inv_freq"], max_len)
        self._keep = [cos, sin]
        handle = self._lib.bq_new(c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                                  c["intermediate_size"], max_len, c["rms_norm_eps"], c["attention_scaling"],
                                  _pointer(cos), _pointer(sin))
        if not handle:
            raise UserError(f"{self.directory}: {last_error()}")
        self._handle = handle
        cache_shape = (c["num_key_value_heads"], max_len, c["head_dim"])
        for i in range(c["num_hidden_layers"]):
            prefix = f"model.layers.{i}"
            indices = np.array([self._add_linear(f"{prefix}.{p}") for p in PROJECTIONS], dtype=np.int64)
            keys, values = np.zeros(cache_shape, np.float32), np.zeros(cache_shape, np.float32)
            q_norm, k_norm = (t[f"{prefix}.self_attn.q_norm.weight"], t[f"{prefix}.self_attn.k_norm.weight"]) \
                if c["qk_norms"] else (None, None)
            self._keep.append(indices)
            self.caches.append((keys, values))
            self._check(self._lib.bq_add_layer(handle, _pointer(t[f"{prefix}.input_layernorm.weight"]),
                                               _pointer(t[f"{prefix}.post_attention_layernorm.weight"]),
                                               _pointer(q_norm), _pointer(k_norm),
                                               indices.ctypes.data_as(self._lib.bq_add_layer.argtypes[5]),
                                               _pointer(keys), _pointer(values)))
        head = self._add_linear("lm_head")
        embed = head if c["embed"] == "lm_head" else self._add_linear(c["embed"])
        self._check(self._lib.bq_set_ends(handle, embed, _pointer(t["model.norm.weight"]), head))
        self.pos = 0

    def _check(self, result: int) -> int:
        if result < 0:
            raise UserError(f"{self.directory}: {last_error()}")
        return result

    def _add_linear(self, name: str) -> int:
        """Linear `name` added to the library's model from its views; its index."""
        entry, t, lib = self.config["linears"][name], self.tensors, self._lib
        n, k = entry["out"], entry["in"]
        bias = t[f"{name}.bias"] if entry["bias"] else None
        if bias is not None and bias.shape != (n,):
            raise UserError(f"{self.directory}: {name}.bias is {bias.shape}, expected ({n},)")
        if entry["kind"] == "q4":
            codes, scales = t[f"{name}.codes"], t[f"{name}.scales"]
            return self._check(lib.bq_add_q4(self._handle, _pointer(codes), codes.size, _pointer(scales), scales.size,
                                             entry["group"], entry["bits"], n, k, _pointer(bias)))
        if entry["kind"] == "u8":
            codes, scale, scale_zero = t[f"{name}.codes"], t[f"{name}.scale"], t[f"{name}.scale_zero"]
            groups = -(-k // entry["group"])
            if codes.shape != (n, k) or scale.shape != (n, groups) or scale_zero.shape != (n, groups):
                raise UserError(f"{self.directory}: {name}'s 8-bit codes or scales do not match [{n}, {k}]")
            return self._check(lib.bq_add_u8(self._handle, _pointer(codes), _pointer(scale), _pointer(scale_zero),
                                             entry["group"], n, k, _pointer(bias)))
        if entry["kind"] == "dense":
            weight = t[f"{name}.weight"]
            if weight.shape != (n, k) or weight.dtype != np.float32:
                raise UserError(f"{self.directory}: {name}.weight is {weight.dtype} {weight.shape}, expected fp32 "
                                f"[{n}, {k}]")
            return self._check(lib.bq_add_dense(self._handle, _pointer(weight), n, k, _pointer(bias)))
        raise UserError(f"{self.directory}: {name} is of kind {entry['kind']!r}, which this bitquilt does not run")

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [vocab] (fp32) of the last of `ids`, appended at the current position."""
        if self._handle is None:
            raise UserError("call begin(max_len) before forward")
        tokens = np.ascontiguousarray(ids, dtype=np.int64)
        logits = np.empty(self.vocab_size, np.float32)
        self._check(self._lib.bq_forward(self._handle, tokens.ctypes.data_as(self._lib.bq_forward.argtypes[1]),
                                         len(tokens), self.pos, _pointer(logits)))
        self.pos += len(tokens)
        return logits

    def close(self) -> None:
        """Free the library's model (the mapping stays)."""
        if self._handle is not None:
            self._lib.bq_free(self._handle)
            self._handle = None
        self._keep, self.caches = [], []

    def __del__(self) -> None:
        self.close()
