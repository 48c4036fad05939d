"""Kernel registry: fast paths for `QuantLinear`, keyed by format name.

A kernel is `fn(fmt, x2d, ctx) -> y2d` computing x @ Ŵᵀ for x of shape [tokens, in_features]
(bias is added by the caller), ctx the call's `MatmulContext` or None. It may return None to
decline (shape, dtype or device it does not handle, or per-token context it does not read), in
which case the format's torch reference (`WeightFormat.reference_matmul`) runs; that reference
is the oracle the kernels are tested against.

A kernel that re-lays a format out for itself keeps the result in a `LayoutCache` (keyed by the
format object, dropped with it), never on the format; `kernel_layout_bytes` reports their size. Once a layout
is built, the format's pages that are views of a loaded model's file are given back (`bitquilt.mapped.release`),
so the layout is the only resident copy, and so are the build's temporaries.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar
from weakref import WeakKeyDictionary

import torch

from bitquilt.formats.base import MatmulContext, WeightFormat
from bitquilt.heap import HUGE_PAGE, advise_huge_pages, return_free_memory
from bitquilt.mapped import release

if TYPE_CHECKING:
    from bitquilt.formats.uniform import UniformFormat

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
    so a block costs what its layouts hold plus the room its last touched page has left. With 2 MB blocks, layouts
    over 512 KB had to stay on 4 KB pages (qwen2.5-1.5b's 1.2 MB q_proj / o_proj would each have taken a block of
    their own, +33 MB resident). At most `OPEN` blocks are held here (the fullest let go first); a block lives on as
    long as a layout cut from it does."""

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
    call: on 4 KB pages qwen2.5-1.5b's W4 int8 decode measured 1.1-1.2x slower, smollm2-135m's (every layout under
    512 KB) 1.11-1.24x slower (Zen 4), and a 1536 x 1536 4-bit layout (1.2 MB) read cold 1.6x slower. The price is
    paid once, as the layouts are built: each 2 MB page faulted in whole, compacting memory when free 2 MB blocks are
    scarce (ready to answer 1.4 -> 2.7 s on that model, 1 thread)."""
    nbytes = numel * dtype.itemsize
    if not huge_pages() or nbytes == 0:
        return torch.empty(numel, dtype=dtype)
    if nbytes >= HUGE_PAGE:
        return _huge_block(nbytes).view(dtype)
    return _slabs.take(nbytes).view(dtype)


PACK_ROWS = 1024  # rows of a weight re-laid out at a time: each chunk's file pages are given back once copied
# (`bitquilt.mapped.release_chunk`) and its temporaries stay small (4,096 doubled the transient peak of packing an LM
# head: smollm2-135m's 4-bit head peaked 84 MB above the process, 44 MB at 1,024)


def grid_chunks(fmt: UniformFormat, rows: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(first row, s, z) of each `rows` rows of a uniform grid (`UniformFormat.scale_zero` of those rows): layouts
    cut their per-group tensors a chunk at a time, so the whole matrix's fp32 temporaries never exist at once."""
    for r0 in range(0, fmt.scales.shape[0], rows):
        yield r0, *fmt.scale_zero(slice(r0, r0 + rows))


def fp16_grid(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(s as fp16, z as uint8) when those hold them exactly (a saved grid's always do: what `UniformFormat.from_codes`
    stores), for layouts that keep them so; None otherwise."""
    s16, z8 = scale.half(), zero.to(torch.uint8)
    return (s16, z8) if torch.equal(s16.float(), scale) and torch.equal(z8.float(), zero) else None


KernelFn = Callable[[WeightFormat, torch.Tensor, "MatmulContext | None"], "torch.Tensor | None"]
_KERNELS: dict[str, list[tuple[str, KernelFn]]] = {}
_enabled = True
_int8_activations = False
_builtin_loaded = False


class Layout(Protocol):
    def nbytes(self) -> int:
        """Bytes the layout holds."""


L = TypeVar("L", bound=Layout)


class LayoutCache(Generic[L]):
    """A kernel's layouts of formats: built on first use per format object, dropped with the format.

    `build(fmt)` may return None (format or shape unsupported); that answer is cached too.
    """

    def __init__(self, build: Callable[[WeightFormat], L | None]):
        self._build = build
        self._layouts: WeakKeyDictionary[WeightFormat, L | None] = WeakKeyDictionary()
        _CACHES.append(self)

    def get(self, fmt: WeightFormat) -> L | None:
        if fmt not in self._layouts:
            layout = self._layouts[fmt] = self._build(fmt)
            if layout is not None:  # the layout serves from now on: a loaded model's mapped pages can go, and the
                release(fmt.tensors().values())  # temporaries of the build
                return_free_memory()
        return self._layouts[fmt]

    def peek(self, fmt: WeightFormat) -> L | None:
        """The layout of `fmt` if one was built, without building it."""
        return self._layouts.get(fmt)


_CACHES: list[LayoutCache] = []


def kernel_layout_bytes(fmt: WeightFormat) -> int:
    """Bytes of the layouts kernels have built for `fmt` so far (0 if none), a composite's parts' included (the
    kernels of MosaicQuant and MoBiQuant weights keep their layouts per part)."""
    parts = getattr(fmt, "parts", {})
    return (sum(layout.nbytes() for cache in _CACHES if (layout := cache.peek(fmt)) is not None)
            + sum(kernel_layout_bytes(part) for part in parts.values()))


def _load_builtin() -> None:
    """Register the compiled CPU kernels on first use (builds them if `make kernels` did not)."""
    global _builtin_loaded
    if not _builtin_loaded:
        _builtin_loaded = True
        # a specialised kernel registers ahead of a generic one (`before=`), whatever the import order:
        # mosaic's "fused" goes before composite's "by_parts" (which bitquilt.calib may have imported already)
        import bitquilt.kernels.composite  # noqa: F401  (multi-part weights through their parts' kernels)
        import bitquilt.kernels.cpu  # noqa: F401  (registers on import; warns once if unavailable)
        import bitquilt.kernels.mosaic  # noqa: F401  (same extension; base + sparse residual in one kernel)
        import bitquilt.kernels.mxint  # noqa: F401  (same extension; registers on import)
        import bitquilt.kernels.q4_int8  # noqa: F401  (same extension; ahead of cpu_lut, with int8 activations)
        import bitquilt.kernels.uniform8  # noqa: F401  (same extension; ahead of cpu_lut for 8-bit decode)


def takes(x: torch.Tensor, ctx: MatmulContext | None = None) -> bool:
    """Whether a CPU kernel may take x: a 2-D CPU tensor, no gradient wanted, no per-token context (the
    checks every kernel makes first; cheap attribute reads, since they run on every call)."""
    return x.is_cpu and x.dim() == 2 and not (x.requires_grad and torch.is_grad_enabled()) \
        and (ctx is None or not ctx.per_token())


def fp32_rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous fp32 (x itself when it already is), the layout the compiled kernels read."""
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A kernel's fp32 result y in x's dtype (y itself when they match)."""
    return y if y.dtype == x.dtype else y.to(x.dtype)


def register_kernel(format_name: str, kernel_name: str, fn: KernelFn, before: str | None = None) -> None:
    """Add a kernel for `format_name`, tried after those already registered; or, with `before`, ahead of
    that kernel if it is registered (a specialised kernel ahead of a generic one whatever the import order)."""
    kernels = _KERNELS.setdefault(format_name, [])
    at = next((i for i, (name, _) in enumerate(kernels) if name == before), len(kernels))
    kernels.insert(at, (kernel_name, fn))


def set_kernels_enabled(enabled: bool) -> None:
    """Force the torch reference everywhere (for debugging and for the tests' oracle)."""
    global _enabled
    _enabled = enabled


def kernels_enabled() -> bool:
    """False while `set_kernels_enabled(False)` forces the torch reference."""
    return _enabled


def set_int8_activations(enabled: bool) -> None:
    """Let kernels that round activations to int8 (faster, not exact: `bitquilt.kernels.q4_int8`) take calls."""
    global _int8_activations
    _int8_activations = enabled


def int8_activations() -> bool:
    """Whether kernels may round activations to int8 (`set_int8_activations`); off by default."""
    return _int8_activations


def kernels_for(format_name: str) -> list[str]:
    return [name for name, _ in _KERNELS.get(format_name, [])]


def quant_matmul(fmt: WeightFormat, x: torch.Tensor, ctx: MatmulContext | None = None) -> torch.Tensor | None:
    """x [tokens, in] @ Ŵᵀ through the first registered kernel that accepts the call, else None."""
    if not _enabled:
        return None
    _load_builtin()
    for _, fn in _KERNELS.get(fmt.name, []):
        y = fn(fmt, x, ctx)
        if y is not None:
            return y
    return None
