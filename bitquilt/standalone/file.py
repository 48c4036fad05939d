"""A safetensors file as read-only numpy views of its memory map (no torch, nothing read ahead of use).

The layout: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__":
{str: str}}, then the tensors' bytes. Every tensor here is a view of the mapping, so its pages are the page cache's
and count once, as they are first touched.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from bitquilt.errors import UserError

DTYPES = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "I8": np.int8, "I32": np.int32, "I64": np.int64}


class MappedTensors:
    """The tensors of one safetensors file (module docstring); `metadata` is the header's string map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            (length,) = struct.unpack("<Q", self._map[:8])
            header = json.loads(self._map[8:8 + length])
        except (OSError, ValueError, struct.error) as e:
            raise UserError(f"{self.path} is not a readable safetensors file: {e}") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._entries: dict[str, Any] = header
        self._start = 8 + length

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> np.ndarray:
        entry = self._entries.get(name)
        if entry is None:
            raise UserError(f"{self.path} has no tensor {name!r}; the file is incomplete or not a standalone export")
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise UserError(f"{self.path}: tensor {name!r} is {entry['dtype']}; the standalone runtime reads "
                            f"{', '.join(DTYPES)}")
        begin, end = entry["data_offsets"]
        count = int(np.prod(entry["shape"], dtype=np.int64))
        if end - begin != count * np.dtype(dtype).itemsize or self._start + end > len(self._map):
            raise UserError(f"{self.path}: tensor {name!r} does not fit its offsets; the file is truncated or corrupt")
        return np.frombuffer(self._map, dtype, count, self._start + begin).reshape(entry["shape"])
