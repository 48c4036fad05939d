"""The allocator's free pages given back to the system (no torch: the standalone runtime's tokenizer uses it too).

Freed blocks below glibc's adaptive mmap threshold (up to 32 MB) stay in the heap, resident, until the heap is
trimmed: after a kernel layout is built, after a block of streaming quantization, after a tokenizer's JSON is
parsed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


def return_free_memory() -> None:
    """Give the allocator's free pages back to the system (glibc `malloc_trim`, about a millisecond; a no-op
    elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
