"""A safetensors file mapped into memory, its tensors as addresses in the mapping (no torch, no numpy, nothing read
ahead of use).

The layout: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__":
{str: str}}, then the tensors' bytes. The mapping is private and never written, so its pages are the page cache's
and count once, as they are first touched; a tensor is where it lies (`MappedTensor.address`), handed to the C
library as a pointer, or read as a memoryview (`values`).
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bitquilt.errors import UserError

# safetensors dtype: (bytes per value, the struct format of memoryview.cast)
DTYPES = {"F32": (4, "f"), "U8": (1, "B"), "I8": (1, "b"), "I32": (4, "i"), "I64": (8, "q")}


@dataclass(frozen=True)
class MappedTensor:
    """One tensor of the mapping: dtype (safetensors' name), shape, address and size in bytes."""

    dtype: str
    shape: tuple[int, ...]
    address: int
    nbytes: int
    _buffer: Any  # the ctypes array over the tensor's bytes: keeps the mapping alive and gives `values`

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def values(self) -> memoryview:
        """The tensor's values in place, shaped (numpy.asarray of it is a view)."""
        return memoryview(self._buffer).cast("B").cast(DTYPES[self.dtype][1], self.shape or [1])


class MappedTensors:
    """The tensors of one safetensors file (module docstring); `metadata` is the header's string map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = self.path.stat().st_size
                if size < 8:
                    raise ValueError(f"it is {size} bytes long, shorter than a safetensors header (truncated?)")
                (length,) = struct.unpack("<Q", f.read(8))
                if 8 + length > size:
                    raise ValueError(f"its header length {length} runs past the end of the file")
                header = json.loads(f.read(length))
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError, struct.error) as e:
            raise UserError(f"{self.path} is not a readable safetensors file: {e}") from None
        if not isinstance(header, dict):
            raise UserError(f"{self.path} is not a readable safetensors file: its header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._entries: dict[str, Any] = header
        self._start = 8 + length

    def names(self) -> list[str]:
        """The tensors' names, in the header's order."""
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> MappedTensor:
        entry = self._entries.get(name)
        if entry is None:
            raise UserError(f"{self.path} has no tensor {name!r}; the file is incomplete or not a standalone export")
        dtype = entry.get("dtype")
        if dtype not in DTYPES:
            raise UserError(f"{self.path}: tensor {name!r} " + (f"is {dtype}" if dtype else "has no dtype") +
                            f"; the standalone runtime reads {', '.join(DTYPES)}")
        try:
            begin, end = (int(o) for o in entry["data_offsets"])
            shape = tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{self.path}: tensor {name!r} has no valid shape and offsets; the file is corrupt") \
                from None
        if begin < 0 or end - begin != math.prod(shape) * DTYPES[dtype][0] or self._start + end > len(self._map):
            raise UserError(f"{self.path}: tensor {name!r} does not fit its offsets; the file is truncated or corrupt")
        buffer = (ctypes.c_char * (end - begin)).from_buffer(self._map, self._start + begin)
        return MappedTensor(dtype, shape, ctypes.addressof(buffer), end - begin, buffer)
