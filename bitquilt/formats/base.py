"""The contract every low-bit weight representation fulfils.

A format owns its packed tensors and nothing else in bitquilt knows their bit layout:
solvers build formats, `QuantLinear` asks them to dequantize (or hands them to a kernel,
which reads them through the format's accessors), and `bitquilt.io` serialises them through
`tensors()` / `meta()` / `from_tensors()`, stored under the names `buffer_name` gives them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

import torch

FORMATS: dict[str, type[WeightFormat]] = {}

BUFFER_PREFIX = "packed_"
PART_SEP = "."  # joins a part's name to its tensor names in a multi-part format's `tensors()`
_BUFFER_PART_SEP = "__"  # PART_SEP as spelled in buffer names, which cannot contain "."


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


def buffer_name(tensor_name: str) -> str:
    """The module buffer (and state-dict key suffix) holding a format's tensor `tensor_name`.

    `packed_<tensor>`, with each "." of a multi-part name (`base.qweight`) spelled "__".
    """
    if _BUFFER_PART_SEP in tensor_name:
        raise ValueError(f"format tensor names cannot contain {_BUFFER_PART_SEP!r}: {tensor_name!r}")
    return BUFFER_PREFIX + tensor_name.replace(PART_SEP, _BUFFER_PART_SEP)


def tensor_name(buffer: str) -> str | None:
    """Inverse of `buffer_name`; None for a buffer that holds no format tensor."""
    if not buffer.startswith(BUFFER_PREFIX):
        return None
    return buffer[len(BUFFER_PREFIX):].replace(_BUFFER_PART_SEP, PART_SEP)


def split_buffers(state: dict[str, torch.Tensor], linear_name: str = "") -> dict[str, torch.Tensor]:
    """Take the format tensors of the linear `linear_name` out of the flat `state` (which loses them).

    Keys `<linear_name>.packed_<tensor>` (`packed_<tensor>` for linear_name "", a module's own
    buffers) become {tensor: value}, what `WeightFormat.from_tensors` takes; submodules' keys stay.
    """
    prefix = f"{linear_name}." if linear_name else ""
    out = {}
    for key in [k for k in state if k.startswith(prefix) and "." not in k[len(prefix):]]:
        name = tensor_name(key[len(prefix):])
        if name is not None:
            out[name] = state.pop(key)
    return out


@dataclass(frozen=True, eq=False)  # compared by identity: fields are tensors
class MatmulContext:
    """Run-time information for one `x @ Ŵᵀ` beyond x itself, each field per token (None: not given).

    A per-token field has one entry per row of the 2-D x the matmul gets (`flat()` reshapes one
    given per position of a [..., in] input).

    slices  int [tokens]: how many leading parts of a multi-part format each token uses, i.e. the
            token is multiplied by `fmt.dequantize(selector=slices[t])`
    """

    slices: torch.Tensor | None = None

    def per_token(self) -> bool:
        """Whether any per-token field is set: a kernel that reads none of them must decline."""
        return any(getattr(self, f.name) is not None for f in fields(self))

    def flat(self) -> MatmulContext:
        """This context with every per-token field flattened to one entry per row of x.reshape(-1, in)."""
        if self.slices is None or self.slices.dim() == 1:  # already flat (the only field): no copy
            return self
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{name: v.reshape(-1) for name, v in given.items() if v is not None})


class WeightFormat(ABC):
    """A packed [out_features, in_features] weight matrix.

    Classes declare what they can hold (`supported_bits`, `supported_group_sizes`, -1 = one group
    per row), so a recipe naming a solver that produces them is checked when it is built.
    """

    name: ClassVar[str]
    supported_bits: ClassVar[tuple[int, ...]]
    supported_group_sizes: ClassVar[tuple[int, ...]]
    default_group_size: ClassVar[int] = 128  # what a recipe that names no group size gets
    out_features: int
    in_features: int

    @abstractmethod
    def dequantize(self, selector: Any = None) -> torch.Tensor:
        """The fp32 weight matrix this format represents, shape [out_features, in_features].

        `selector` picks a reduced weight of a multi-part format (for `CompositeFormat`, the number
        of leading parts summed); None is the full weight, and single-part formats ignore it.
        """

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

    def reference_matmul(self, x: torch.Tensor, ctx: MatmulContext | None = None,
                         weight: torch.Tensor | None = None) -> torch.Tensor:
        """x [tokens, in] @ Ŵᵀ in torch, in x's dtype: the oracle every kernel is tested against.

        `weight` is the full dequantized matrix if the caller holds one (reused, not recomputed).
        With per-token slice counts in `ctx`, token t is multiplied by `dequantize(slices[t])`,
        tokens grouped by count (so a single-part format gives every token the full weight).
        """
        slices = None if ctx is None else ctx.slices
        if slices is None:
            w = self.dequantize() if weight is None else weight
            return x @ w.to(x.dtype).T
        if slices.shape != x.shape[:1]:
            raise ValueError(f"per-token slices of shape {tuple(slices.shape)} for {x.shape[0]} tokens")
        y = x.new_empty(x.shape[0], self.out_features)
        for k in torch.unique(slices).tolist():
            rows = slices == k
            y[rows] = x[rows] @ self.dequantize(k).to(x.dtype).T
        return y

    def permute_rows(self, order: torch.Tensor) -> WeightFormat | None:
        """The same weight with output rows in `order` (row i of the result is row order[i]); None if
        this format cannot (rows packed together)."""
        return None

    @property
    def rows_apart(self) -> bool:
        """Whether every stored tensor holds one entry per output row and nothing else ([out, ...]), so that the
        weights of two such formats with the same meta stack by concatenating their tensors (`concat_rows`)."""
        return False

    def nbytes(self) -> int:
        """Bytes of stored tensors: what the weight costs in memory and on disk."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def bits_per_weight(self) -> float:
        """Stored bits per weight, scales, zeros and coefficients included."""
        return 8.0 * self.nbytes() / (self.out_features * self.in_features)

    def describe(self) -> str:
        """Short human label, e.g. 'uniform w4 g128 asym'."""
        return self.name


def concat_rows(fmts: list[WeightFormat]) -> WeightFormat:
    """One weight whose rows are those of `fmts` in order (the parts of a fused projection), their tensors
    concatenated: exact, nothing is re-quantized. ValueError saying why not unless they are of one class and meta
    and store their rows apart (`WeightFormat.rows_apart`)."""
    first = fmts[0]
    for fmt in fmts:
        if not fmt.rows_apart:
            raise ValueError(f"a {fmt.describe()} weight does not store its rows apart")
        if type(fmt) is not type(first) or fmt.meta() != first.meta() or fmt.tensors().keys() != first.tensors().keys():
            raise ValueError(f"its parts differ ({first.describe()} and {fmt.describe()})")
    stacked = {k: torch.cat([f.tensors()[k] for f in fmts]) for k in first.tensors()}
    return type(first).from_tensors(stacked, first.meta())
