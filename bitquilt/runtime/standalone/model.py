"""A standalone export loaded for generation: the C library's model of the file, one C call per forward, no array
library.

`StandaloneModel(directory)` maps `standalone.safetensors` (`bitquilt.export.standalone` writes it), reads its
metadata, loads the tokenizer and has the library open the file (`bq_file_open`: one mapping for every sequence);
`begin(max_len)` builds the library's model of it for a sequence of up to `max_len` positions (`bq_open`: the same
loader as the native runner's; its RoPE tables for those positions and zeroed key/value caches whose pages are
touched only as positions fill), and `forward(ids)` appends ids at the current position and returns the last one's
logits (`array.array` of fp32). The weights are never copied: the library's linears point into its mapping. A
MoBiQuant export routes each token at its routers' saved thresholds, or at the one `set_avg_bits` sets.
"""

from __future__ import annotations

import ctypes
import json
import math
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bitquilt.errors import UserError
from bitquilt.flag_checks import INT32_MAX, MAX_THREADS, is_integer
from bitquilt.isa import INT8_ISAS, choose, int8_supported
from bitquilt.runtime.standalone.file import MappedTensors
from bitquilt.runtime.standalone.library import last_error, library
from bitquilt.runtime.tokenizer import FastTokenizer

FILE = "standalone.safetensors"  # what bitquilt.export.standalone writes, and its metadata
METADATA_KEY = "bitquilt.runtime.standalone"
# 3: 4- and 2-bit linears in 32-row tiles (csrc/kernels/q4_int8.h); 4: also routed MoBiQuant slices (kind "slices",
# written only for a model that has them, so that a model without them still reads where only 3 does); 5: a Gemma 2
# or 3 model (its layer types, window, RoPE tables, activation, embedding scale and caps; written only for one); 6: a
# mixture of experts (router and experts per layer)
FORMAT_VERSIONS = (3, 4, 5, 6)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")  # a layer's linears, as csrc/runtime/standalone.cpp's loader reads them

def _floats(address: int, shape: tuple[int, ...]) -> memoryview:
    """fp32 values [shape] at `address` (the library's memory), in place."""
    return memoryview((ctypes.c_float * math.prod(shape)).from_address(address)).cast("B").cast("f", shape)


def set_threads(threads: int) -> None:
    """Threads of every following call (OpenMP)."""
    if not 1 <= threads <= MAX_THREADS:
        raise UserError(f"threads must be between 1 and {MAX_THREADS}, got {threads}")
    library().bq_set_threads(threads)


def set_isa(isa: str | None = None) -> str:
    """Run the 4- and 2-bit kernel on `isa` ("avx2", "avxvnni", "avx512"), or `$BITQUILT_ISA` / the widest when
    None; the path now taken (`bitquilt.isa.choose`)."""
    lib = library()
    chosen = choose("standalone", int8_supported(lib.bq_isa_supported), isa)
    lib.bq_set_isa(INT8_ISAS.index(chosen))
    return chosen


SIZES = ("vocab_size", "max_positions")  # the metadata's sizes this side reads itself (the library checks the rest)


def _check_config(path: Path, config: Any) -> None:
    """UserError unless the standalone metadata `config` has its sizes as integers in [1, 2^31 - 1] and its linears as
    an object: a size of 2^62 would be an allocation, a float one a wrong index."""
    if not isinstance(config, dict):
        raise UserError(f"{path}'s standalone metadata is not an object: the file is damaged; re-export the model")
    missing = [key for key in (*SIZES, "linears") if key not in config]
    if missing:
        raise UserError(f"{path}'s standalone metadata lacks {', '.join(missing)}: the file is damaged or was not "
                        "written by bitquilt; re-export the model")
    for key in SIZES:
        if not (is_integer(config[key]) and 1 <= config[key] <= INT32_MAX):
            raise UserError(f"{path}'s standalone metadata has {key} {config[key]!r:.40}, not an integer in [1, "
                            f"{INT32_MAX}]: the file is damaged or was edited; re-export the model")
    if not isinstance(config["linears"], dict):
        raise UserError(f"{path}'s standalone metadata has no object of linears: the file is damaged; re-export it")


class StandaloneModel:
    """A standalone export for one sequence at a time (module docstring)."""

    _handle: int | None = None
    _file: int | None = None
    routing_threshold = math.nan  # the routers' threshold of new sequences (NaN: each router's saved one)

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
        if self.config.get("format_version") not in FORMAT_VERSIONS:
            raise UserError(f"{self.directory / FILE} is standalone format {self.config.get('format_version')}; this "
                            f"bitquilt reads {' and '.join(map(str, FORMAT_VERSIONS))}: re-export the model")
        _check_config(self.directory / FILE, self.config)
        self.tokenizer = FastTokenizer(self.directory) if FastTokenizer.available(self.directory) else None
        self.vocab_size: int = self.config["vocab_size"]
        self.max_positions: int = self.config["max_positions"]
        self.pos = 0
        self.max_len = 0
        self._lib = library()
        set_isa()
        self._file = self._lib.bq_file_open(str(self.directory / FILE).encode())  # one mapping for every sequence
        if not self._file:
            raise UserError(last_error())

    def begin(self, max_len: int) -> None:
        """Start a sequence of up to `max_len` positions (the previous one, if any, is dropped)."""
        self.close()
        self._handle, self.max_len, self.pos = self.open_sequence(max_len), max_len, 0
        self._lib.bq_set_threshold(self._handle, self.routing_threshold)

    def open_sequence(self, max_len: int) -> int:
        """The library's model of the file for a sequence of up to `max_len` positions, its own caches (`bq_open`: a
        handle for `bq_forward` and `bq_step`, which the caller frees with `bq_free`); UserError if it cannot."""
        if not is_integer(max_len):
            raise UserError(f"max_len must be an integer number of positions, got {max_len!r}")
        if not 1 <= max_len <= INT32_MAX:  # the library takes an int64: a larger count would wrap
            raise UserError(f"a sequence of {max_len} positions does not fit the model's {self.max_positions}")
        handle = self._lib.bq_open(self._file, max_len)
        if not handle:
            raise UserError(last_error())
        rows = self._lib.bq_vocab(handle)
        if rows != self.vocab_size:  # the logits buffers are sized by the metadata
            self._lib.bq_free(handle)
            raise UserError(f"{self.directory / FILE}: its metadata's vocab_size {self.vocab_size} is not its "
                            f"embedding's {rows} rows; the file is damaged or was edited; re-export the model")
        return handle

    def threshold(self, avg_bits: float) -> float:
        """The routers' threshold at which the model uses `avg_bits` bits per weight on average (`bq_threshold`);
        UserError for a model without routers or a value outside its range."""
        tau = ctypes.c_float()
        if not isinstance(avg_bits, int | float) or \
                self._lib.bq_threshold(self._file, float(avg_bits), ctypes.byref(tau)) < 0:
            raise UserError(last_error() if isinstance(avg_bits, int | float) else
                            f"avg_bits must be a number, got {avg_bits!r:.40}")
        return tau.value

    def routed_range(self) -> tuple[float, float] | None:
        """The lowest and highest average bits per weight the routers reach (the export's `routing.curve`); None
        without routers."""
        if "routing.curve" not in self.tensors:
            return None
        curve = self.tensors["routing.curve"].values()
        return min(curve), max(curve)

    def set_avg_bits(self, avg_bits: float | None) -> None:
        """Route every token of the next sequences so that the model uses `avg_bits` bits per weight on average
        (None: at each router's saved threshold); UserError for a model without routers or a value outside its
        range."""
        self.routing_threshold = math.nan if avg_bits is None else self.threshold(avg_bits)
        if self._handle is not None:
            self._lib.bq_set_threshold(self._handle, self.routing_threshold)

    def routed_bits(self) -> float | None:
        """The bits per weight the sequence's tokens used on average in the routed linears; None without any."""
        bits = None if self._handle is None else self._lib.bq_routed_bits(self._handle)
        return None if bits is None or math.isnan(bits) else bits

    def bits_per_weight(self) -> float:
        """Bits per weight as the export stores them, counted as `bitquilt.io.model_summary` counts: the decoder's
        linears, plus the embedding and LM head when quantized (a tied table once)."""
        bits = weights = 0
        for name, entry in self.config["linears"].items():
            if entry["kind"] == "dense" and not name.startswith("model.layers."):
                continue
            tensors = [f"{name}.{t}" for t in ("codes", "scales", "scale", "scale_zero", "weight")]
            slices = range(len(entry.get("slices", ())))
            tensors += [f"{name}.slice{p}.{t}" for p in slices for t in ("planes", "coefs")]
            bits += sum(8 * self.tensors[t].nbytes for t in tensors if t in self.tensors)
            weights += entry["out"] * entry["in"]
        return bits / weights

    def size_mb(self) -> float:
        """The export's weights, MiB: its tensors but the tokenizer tables (the native runner's, `tokenizer.*`)."""
        return sum(self.tensors[name].nbytes for name in self.tensors.names() if not name.startswith("tokenizer.")) \
            / 2**20

    def forward(self, ids: Sequence[int]) -> array:
        """Logits [vocab] (fp32 `array.array`) of the last of `ids`, appended at the current position."""
        if self._handle is None:
            raise UserError("call begin(max_len) before forward")
        try:
            tokens = array("q", ids)
        except (TypeError, OverflowError):
            raise UserError(f"token ids must be a sequence of integers, got {ids!r:.80}") from None
        if not tokens:
            raise UserError("forward needs at least one token id")
        logits = array("f", bytes(4 * self.vocab_size))
        if self._lib.bq_forward(self._handle, tokens.buffer_info()[0], len(tokens), self.pos,
                                logits.buffer_info()[0]) < 0:
            raise UserError(f"{self.directory}: {last_error()}")
        self.pos += len(tokens)
        return logits

    def cache(self, layer: int) -> tuple[memoryview, memoryview]:
        """Layer `layer`'s keys and values, fp32 [kv_heads, max_len, head_dim], in place (for inspection)."""
        if self._handle is None:
            raise UserError("call begin(max_len) before reading the caches")
        shape = (self.config["num_key_value_heads"], self.max_len, self.config["head_dim"])
        keys, values = (self._lib.bq_cache(self._handle, layer, which) for which in (0, 1))
        if not keys:
            raise UserError(f"layer {layer} is outside the model's {self.config['num_hidden_layers']}")
        return _floats(keys, shape), _floats(values, shape)

    def rope(self) -> tuple[memoryview, memoryview]:
        """The cos and sin tables in use, fp32 [max_len, head_dim], in place."""
        if self._handle is None:
            raise UserError("call begin(max_len) before reading the RoPE tables")
        shape = (self.max_len, self.config["head_dim"])
        return _floats(self._lib.bq_rope(self._handle, 0), shape), _floats(self._lib.bq_rope(self._handle, 1), shape)

    def close(self) -> None:
        """Free the library's model (the mapping stays)."""
        if self._handle is not None:
            self._lib.bq_free(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()
        if self._file:
            self._lib.bq_file_free(self._file)  # the mapping goes with the last model opened on it
