"""Memory for kernel layouts on transparent huge pages: a batch-1 kernel streams its whole layout at every call,
so its pages are 2 MB ones where the kernel asks (`layout_empty`), set off by `$BITQUILT_HUGE_PAGES=0`."""

from __future__ import annotations

import os
import threading

import torch

from bitquilt.heap import HUGE_PAGE, advise_huge_pages


def huge_pages() -> bool:
    """Whether kernel layouts ask for transparent huge pages: yes unless `$BITQUILT_HUGE_PAGES` is 0."""
    return os.environ.get("BITQUILT_HUGE_PAGES", "1").strip() != "0"


def _huge_block(nbytes: int) -> torch.Tensor:
    """`nbytes` uninitialised bytes starting on a huge-page boundary, their whole 2 MB pages advised to be
    transparent huge pages before anything touches them (the allocation is up to 2 MB longer, never touched)."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    out = raw[skip:skip + nbytes]
    advise_huge_pages(out.data_ptr(), nbytes)
    return out


class _Slabs:
    """Huge pages shared by layouts under 2 MB: each is cut from the open `BLOCK` (16 MB, starting on a huge page)
    with the least room that holds it (64-byte aligned), a new block opened when none does. A layout may straddle two
    huge pages (one TLB entry each either way), and a huge page becomes resident only once a layout in it is written,
    so a block costs what its layouts hold plus the room its last touched page has left. Blocks larger than one huge
    page let layouts of a few hundred KB to 2 MB share pages instead of taking a block each. At most `OPEN` blocks
    are held here (the fullest let go first); a block lives on as long as a layout cut from it does."""

    OPEN = 8
    BLOCK = 8 * HUGE_PAGE

    def __init__(self) -> None:
        self.blocks: list[tuple[torch.Tensor, int]] = []  # (block, bytes used)
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            starts = [-(-used // 64) * 64 for _, used in self.blocks]
            fits = [i for i, start in enumerate(starts) if start + nbytes <= self.BLOCK]
            if fits:
                i = max(fits, key=lambda i: starts[i])
                start = starts[i]
            else:
                if len(self.blocks) == self.OPEN:
                    del self.blocks[max(range(self.OPEN), key=lambda i: self.blocks[i][1])]
                self.blocks.append((_huge_block(self.BLOCK), 0))
                i, start = len(self.blocks) - 1, 0
            block = self.blocks[i][0]
            self.blocks[i] = (block, start + nbytes)
            return block[start:start + nbytes]


_slabs = _Slabs()


def layout_empty(numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised 1-D tensor for a kernel layout of `numel` elements on transparent huge pages (while
    `huge_pages()`): from 2 MB on a block of its own starting on a huge-page boundary (`_huge_block`), smaller ones
    cut from 16 MB blocks shared with other layouts (`_Slabs`). A batch-1 kernel reads its whole layout at every
    call, and on 4 KB pages that read pays a TLB miss every 4 KB (docs/memory.md has the measured cost). The price
    is paid once, as the layouts are built: each 2 MB page faulted in whole."""
    nbytes = numel * dtype.itemsize
    if not huge_pages() or nbytes == 0:
        return torch.empty(numel, dtype=dtype)
    if nbytes >= HUGE_PAGE:
        return _huge_block(nbytes).view(dtype)
    return _slabs.take(nbytes).view(dtype)
