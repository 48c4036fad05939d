"""Giving memory back: tensors that are views of a memory-mapped file, whose pages go once a copy of them serves,
and the allocator's free pages.

A saved model's packed weights are read by the kernels only once, to build each kernel's own layout
(`bitquilt.kernels.layouts.LayoutCache`); from then on the layout serves every call. Read into memory of their own, the
packed tensors would stay resident next to the layouts: two copies of every linear. Mapped instead, their pages
are the file's, faulted in when the layout is built and dropped again right after (`release`, `madvise
MADV_DONTNEED`): the process keeps one copy, and the format stays whole, since a dropped page is read back from
the file whenever anything (saving, the torch reference, another kernel) touches it again.

The mapping is private copy-on-write (`mmap.ACCESS_COPY`): a write into a mapped tensor changes this process's
copy only, never the file. Formats are never written in place; `release` drops only the pages of formats that a
kernel has copied, so no write could be dropped with them.

Freed tensors below glibc's adaptive mmap threshold (up to 32 MB) stay in the heap, resident, between the tensors
that outlive them; `bitquilt.heap.return_free_memory` hands those pages back (after each block of streaming
quantization, and after each kernel layout is built, whose temporaries are a few times the layout).
"""

from __future__ import annotations

import bisect
import mmap
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from bitquilt.heap import return_free_memory

_PAGE = mmap.PAGESIZE
# (first address, end address, mapping) of the live mappings, sorted by address; a mapping closes when the last
# tensor viewing it is freed, and its entry goes at the next `map_file`
_maps: list[tuple[int, int, weakref.ref[mmap.mmap]]] = []


def map_file(path: Path) -> mmap.mmap:
    """A private (copy-on-write) mapping of the whole file, registered so that `release` can find it."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    start = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr() if len(mm) else 0
    _maps[:] = [entry for entry in _maps if entry[2]() is not None]
    bisect.insort(_maps, (start, start + len(mm), weakref.ref(mm)), key=lambda entry: entry[0])
    return mm


def tensor_view(mm: mmap.mmap, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes [offset, offset + nbytes) of the mapping as a tensor (the mapping stays open while it lives); a
    copy when the offset is not aligned to the element size, since the kernels and torch expect aligned data."""
    if not nbytes:  # frombuffer refuses an empty range
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)


def _mapping_of(t: torch.Tensor) -> tuple[int, mmap.mmap] | None:
    """(first address, mapping) of the registered mapping holding t's data, or None."""
    address = t.untyped_storage().data_ptr()
    i = bisect.bisect_right(_maps, address, key=lambda entry: entry[0]) - 1
    mm = _maps[i][2]() if i >= 0 and address < _maps[i][1] else None
    return None if mm is None else (_maps[i][0], mm)


def release(tensors: Iterable[torch.Tensor]) -> int:
    """Drop the resident pages of those `tensors` that are views of a mapped file (others are left alone); returns
    the bytes of whole pages given back. Only pages entirely inside a tensor are dropped (a contiguous view's own
    bytes, e.g. some rows; else its whole storage), so a neighbour that shares a page keeps it. The data stays
    readable: the next touch reads the pages back from the file."""
    released = 0
    for t in tensors:
        found = _mapping_of(t) if t.numel() else None
        if found is None:
            continue
        base, mm = found
        if t.is_contiguous():
            begin, size = t.data_ptr() - base, t.numel() * t.element_size()
        else:
            begin, size = t.untyped_storage().data_ptr() - base, t.untyped_storage().nbytes()
        end = begin + size
        first, last = -(-begin // _PAGE) * _PAGE, end // _PAGE * _PAGE
        if last > first:
            mm.madvise(mmap.MADV_DONTNEED, first, last - first)
            released += last - first
    return released


TRIM_EVERY = 4  # chunks of a layout build between two `return_free_memory` calls (`release_chunk`)


def release_after_calls(module: Any, tensors: list[torch.Tensor]) -> None:
    """Give `tensors`' mapped pages back after every call of `module` (a full-precision embedding table viewing its
    file: a lookup's rows are copies, and a touched page can map far more than the row, see
    `bitquilt.nn.quant_embedding`)."""
    def give_back(*_: Any) -> None:  # a hook's return value would replace the module's output
        release(tensors)

    module.register_forward_hook(give_back)


def release_chunk(index: int, tensors: Iterable[torch.Tensor]) -> None:
    """After chunk `index` of a kernel layout built a few rows at a time: `release` the mapped `tensors` it has
    copied and, every TRIM_EVERY chunks, the allocator's free pages. The chunks' temporaries come back fragmented
    between longer-lived allocations and glibc keeps them, so the peak of building a large layout grows with the chunks
    left untrimmed; a trim costs the next chunk's page faults, so it runs every few chunks, not after each."""
    release(tensors)
    if index % TRIM_EVERY == TRIM_EVERY - 1:
        return_free_memory()
