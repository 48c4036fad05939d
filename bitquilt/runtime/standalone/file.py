"""A safetensors file mapped into memory, its tensors as addresses in the mapping (no torch, no numpy, nothing read
ahead of use).

The layout: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__":
{str: str}}, then the tensors' bytes. The mapping is private and never written, so its pages are the page cache's
and count once, as they are first touched; a tensor is where it lies (`MappedTensor.address`), handed to the C
library as a pointer, or read as a memoryview (`values`).
"""

from __future__ import annotations

import ctypes
import math
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bitquilt.errors import UserError
from bitquilt.tensor_header import DTYPE_BYTES, read_header

# the safetensors dtypes a standalone export holds: the struct format of memoryview.cast
FORMATS = {"F32": "f", "U8": "B", "I8": "b", "I32": "i", "I64": "q"}


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
        return memoryview(self._buffer).cast("B").cast(FORMATS[self.dtype], self.shape or [1])


class MappedTensors:
    """The tensors of one safetensors file (module docstring); `metadata` is the header's string map. The header is
    validated whole when the file opens (`bitquilt.tensor_header`: sizes, overlaps, alignment), so every address
    handed to the C library lies inside the mapping."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        header = read_header(self.path, {name: DTYPE_BYTES[name] for name in FORMATS}, aligned=True)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise UserError(f"{self.path} is not a readable safetensors file: {e}") from None
        if len(self._map) != header.size:
            raise UserError(f"{self.path} changed while it was read; run again")
        self.metadata: dict[str, str] = header.metadata
        self._entries = header.entries

    def names(self) -> list[str]:
        """The tensors' names, in the header's order."""
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> MappedTensor:
        entry = self._entries.get(name)
        if entry is None:
            raise UserError(f"{self.path} has no tensor {name!r}; the file is incomplete or not a standalone export")
        buffer = (ctypes.c_char * entry.nbytes).from_buffer(self._map, entry.start)
        return MappedTensor(entry.dtype, entry.shape, ctypes.addressof(buffer), entry.nbytes, buffer)
