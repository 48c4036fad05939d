"""The contract every low-bit weight representation fulfils.

A format owns its packed tensors and nothing else in bitquilt knows their bit layout:
solvers build formats, `QuantLinear` asks them to dequantize (or hands them to a kernel),
and `bitquilt.io` serialises them through `tensors()` / `meta()` / `from_tensors()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

FORMATS: dict[str, type[WeightFormat]] = {}


def register_format(cls: type[WeightFormat]) -> type[WeightFormat]:
    """Class decorator: make a format loadable by its `name`."""
    if cls.name in FORMATS:
        raise ValueError(f"format {cls.name!r} registered twice")
    FORMATS[cls.name] = cls
    return cls


def format_class(name: str) -> type[WeightFormat]:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(sorted(FORMATS))}") from None


class WeightFormat(ABC):
    """A packed [out_features, in_features] weight matrix."""

    name: ClassVar[str]
    out_features: int
    in_features: int

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The fp32 weight matrix this format represents, shape [out_features, in_features]."""

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every stored tensor, by name (what goes into safetensors)."""

    @abstractmethod
    def meta(self) -> dict[str, Any]:
        """JSON-serialisable parameters needed to rebuild the format from `tensors()`."""

    @classmethod
    @abstractmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> WeightFormat:
        """Inverse of (`tensors()`, `meta()`)."""

    def nbytes(self) -> int:
        """Bytes of stored tensors: what the weight costs in memory and on disk."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def bits_per_weight(self) -> float:
        """Stored bits per weight, scales, zeros and coefficients included."""
        return 8.0 * self.nbytes() / (self.out_features * self.in_features)

    def describe(self) -> str:
        """Short human label, e.g. 'uniform w4 g128 asym'."""
        return self.name
