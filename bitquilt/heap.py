"""Memory from the system: the allocator's free pages given back, and huge pages asked for (no torch: the
standalone runtime's tokenizer uses it too).

Freed blocks below glibc's adaptive mmap threshold (up to 32 MB) stay in the heap, resident, until the heap is
trimmed: after a kernel layout is built, after a block of streaming quantization, after a tokenizer's JSON is
parsed. Kernel layouts, which a batch-1 kernel streams whole at every call, ask for transparent huge pages
(`advise_huge_pages`): on 4 KB pages every 4 KB of the stream is another TLB entry.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64
MADV_HUGEPAGE = 14


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask Linux to back the whole 2 MB pages inside [address, address + nbytes) with transparent huge pages
    (`madvise(MADV_HUGEPAGE)`, which applies where the system's THP mode is "always" or "madvise"); pages not yet
    touched are then faulted in 2 MB at a time. False where nothing was advised (no whole huge page, no libc)."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    madvise = _libc_function("madvise")
    if end <= start or madvise is None:
        return False
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0


def return_free_memory() -> None:
    """Give the allocator's free pages back to the system (glibc `malloc_trim`, about a millisecond; a no-op
    elsewhere)."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


@functools.cache
def _libc_function(name: str) -> Any:
    library = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(library, use_errno=True), name, None) if library else None
