"""Kernel layouts: a kernel that re-lays a format out for itself keeps the result in a `LayoutCache` (keyed by the
format object, dropped with it), never on the format; `kernel_layout_bytes` reports their size. Once a layout is
built, the format's pages that are views of a loaded model's file are given back (`bitquilt.mapped.release`), so the
layout is the only resident copy, and so are the build's temporaries."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar
from weakref import WeakKeyDictionary

import torch

from bitquilt.formats.base import WeightFormat
from bitquilt.heap import return_free_memory
from bitquilt.mapped import release

if TYPE_CHECKING:
    from bitquilt.formats.uniform import UniformFormat

PACK_ROWS = 1024  # rows of a weight re-laid out at a time: each chunk's file pages are given back once copied
# (`bitquilt.mapped.release_chunk`) and its temporaries stay small (larger chunks raise the transient peak of packing
# an LM head)


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
