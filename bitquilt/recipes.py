"""Recipes: a method name + weight grid + per-module overrides, as one serialisable object.

A method is written `transform+...+solver`, e.g. `gptq`, `awq+rtn`, `awq+gptq`; transforms
(registered in `bitquilt.transforms`) rewrite the model or a block before its linears are
solved. Short aliases name the usual combinations (`awq` = `awq+rtn`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field
from typing import Any

from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec

METHOD_ALIASES = {"awq": "awq+rtn"}


@dataclass(frozen=True)
class CalibConfig:
    """What the statistics were collected on (recorded in saved models)."""

    source: str = "sciq"
    n_samples: int = 64
    seqlen: int = 512
    seed: int = 0


@dataclass
class Recipe:
    method: str = "gptq"
    w_bits: int = 4
    group_size: int = 128
    sym: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # solver options, e.g. {"act_order": True}
    transform_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per transform name
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # glob on linear name -> spec fields
    skip: tuple[str, ...] = ()  # globs of linears kept in full precision

    def __post_init__(self) -> None:
        self.method = METHOD_ALIASES.get(self.method, self.method)
        self.skip = tuple(self.skip)
        from bitquilt.transforms import get_transform

        for t in self.transforms:
            get_transform(t)
        solver = get_solver(self.solver)
        solver.make_options(self.options)
        supported = getattr(solver.options, "supported_bits", None)
        self.default_spec.validate(**({"supported_bits": supported} if supported else {}))
        for pattern, fields in self.overrides.items():
            bad = set(fields) - {"bits", "group_size", "sym"}
            if bad:
                raise ValueError(f"override {pattern!r}: unknown field(s) {sorted(bad)}; use bits, group_size, sym")

    @property
    def solver(self) -> str:
        return self.method.split("+")[-1]

    @property
    def transforms(self) -> list[str]:
        return self.method.split("+")[:-1]

    @property
    def needs_calibration(self) -> bool:
        from bitquilt.transforms import get_transform

        return get_solver(self.solver).needs_stats or any(get_transform(t).scope == "block" for t in self.transforms)

    @property
    def default_spec(self) -> LayerSpec:
        return LayerSpec(self.w_bits, self.group_size, self.sym)

    def spec_for(self, name: str) -> LayerSpec | None:
        """The grid for linear `name`, or None if it stays in full precision."""
        if any(fnmatch.fnmatchcase(name, p) for p in self.skip):
            return None
        spec = asdict(self.default_spec)
        for pattern, fields in self.overrides.items():
            if fnmatch.fnmatchcase(name, pattern):
                spec.update(fields)
        return LayerSpec(**spec).validate()

    def label(self) -> str:
        g = "pc" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.method} w{self.w_bits}{g}{'s' if self.sym else ''}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["skip"] = list(self.skip)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        return cls(**d)
