"""The one validation of a safetensors header that every reader of one goes through (loading a Hugging Face folder,
a saved model, streaming quantization, the standalone runtime; csrc/runtime/standalone_file.h does the same for the
C++ readers).

A safetensors file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets},
"__metadata__": {str: str}}, then the tensors' bytes. `read_header` refuses, with one line naming the file (and the
tensor), anything a reader could trust into a wrong or out-of-bounds read: a header length past the end, JSON that
is not an object or nests too deep, metadata that is not strings, a dtype the reader does not take, dimensions that
are not non-negative integers (`true`, `2.0`, `1e999`), offsets that are not integers, do not match the shape's
byte count, overlap another tensor's, leave a gap, or end anywhere but at the end of the file, and (for readers
that hand the bytes to C) a tensor whose bytes are not aligned to its element size. Python's integers do not
overflow, so a `[2^62, 4]` shape fails as a byte count that does not match its offsets.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bitquilt.errors import UserError

# safetensors dtype name -> bytes per element
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit


@dataclass(frozen=True)
class Entry:
    """One tensor: dtype (safetensors' name), shape, and where its bytes lie, absolute in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A validated header: the tensors by name (in the header's order), the string metadata, the file's size."""

    path: Path
    entries: dict[str, Entry]
    metadata: dict[str, str]
    size: int


def _integer(value: Any) -> bool:
    return type(value) is int  # not bool, not a float such as 2.0 or 1e999


def _entry(name: str, info: Any, dtypes: dict[str, int], data_start: int) -> tuple[Entry, int, int]:
    """(entry, begin, end) of one header entry; ValueError saying what is wrong with it."""
    if not isinstance(info, dict):
        raise ValueError("is not an object")
    dtype = info.get("dtype")
    if dtype is None:
        raise ValueError("has no dtype")
    if dtype not in dtypes:
        raise ValueError(f"is {dtype}; this reader takes {', '.join(dtypes)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_integer(d) and d >= 0 for d in shape):
        raise ValueError(f"has shape {shape!r:.60}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_integer(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"has data_offsets {offsets!r:.60}, not [begin, end] integers with 0 ≤ begin ≤ end")
    begin, end = offsets
    nbytes = math.prod(shape) * dtypes[dtype]
    if end - begin != nbytes:
        raise ValueError(f"does not fit its offsets: shape {shape} of {dtype} is {nbytes} bytes, its offsets span "
                         f"{end - begin}")
    return Entry(dtype, tuple(shape), data_start + begin, nbytes), begin, end


def _parse(path: Path, dtypes: dict[str, int], aligned: bool) -> Header:
    with open(path, "rb") as f:
        size = path.stat().st_size
        if size < 8:
            raise ValueError(f"it is {size} bytes long, shorter than a safetensors header (truncated?)")
        (length,) = struct.unpack("<Q", f.read(8))
        if length > size - 8:
            raise ValueError(f"its header length {length} runs past the end of the file ({size} bytes)")
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"its header length {length} exceeds {MAX_HEADER_BYTES} bytes")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except RecursionError:
        raise ValueError("its header nests too deeply to be a tensor table") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("its __metadata__ is not an object of strings")
    data_start = 8 + length
    entries, spans = {}, []
    for name, info in header.items():
        try:
            entry, begin, end = _entry(name, info, dtypes, data_start)
        except ValueError as e:
            raise UserError(f"{path}: tensor {name!r} {e}; the file is truncated or corrupt, or was edited") from None
        if aligned and entry.start % dtypes[entry.dtype]:
            raise UserError(f"{path}: tensor {name!r} starts at byte {entry.start}, not a multiple of its "
                            f"{dtypes[entry.dtype]}-byte elements; the file was not written by safetensors")
        if data_start + end > size:
            raise UserError(f"{path} is truncated or corrupt: tensor {name!r} ends at byte {data_start + end}, "
                            f"past the end of the file ({size} bytes)")
        entries[name] = entry
        spans.append((begin, end, name))
    position, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin != position:
            what = f"overlaps tensor {previous!r}" if begin < position else f"leaves a gap after {previous!r}"
            raise UserError(f"{path}: tensor {name!r} {what} (bytes {begin}..{end}); the file is damaged or was "
                            "edited")
        position, previous = end, name
    if data_start + position != size:
        raise UserError(f"{path} is truncated or corrupted: {size} bytes, its header describes "
                        f"{data_start + position}; re-fetch, re-save or re-export it")
    return Header(path, entries, metadata, size)


def read_header(path: str | Path, dtypes: dict[str, int] | None = None, aligned: bool = False) -> Header:
    """The validated header of the safetensors file at `path` (module docstring): `dtypes` are the ones the reader
    takes (default every `DTYPE_BYTES`), `aligned` asks each tensor to start at a multiple of its element size. A
    UserError with one line naming the file otherwise."""
    path = Path(path)
    try:
        return _parse(path, DTYPE_BYTES if dtypes is None else dtypes, aligned)
    except (OSError, ValueError, struct.error) as e:
        raise UserError(f"{path} is not a readable safetensors file: {e}") from None
