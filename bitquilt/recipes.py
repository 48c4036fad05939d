"""Recipes: a method name + weight grid + per-module overrides, as one serialisable object.

A method is written `transform+...+solver`, e.g. `gptq`, `awq+rtn`, `awq+gptq`; transforms
(registered in `bitquilt.transforms`) rewrite the model or a block before its linears are
solved. Short aliases name the usual combinations (`awq` = `awq+rtn`).

Activations and the KV cache are quantized when `a_bits` / `kv_bits` are below 16 (W4A4KV4:
`Recipe("quarot+gptq", w_bits=4, a_bits=4, kv_bits=4)`); overrides may set `a_bits`, `a_sym`
and `a_clip` per linear as well as the weight grid.
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field
from typing import Any

from bitquilt.nn.act_quant import ActQuantConfig
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec

METHOD_ALIASES = {"awq": "awq+rtn"}

WEIGHT_FIELDS = {"bits", "group_size", "sym"}
ACT_FIELDS = {"a_bits": "bits", "a_sym": "sym", "a_clip": "clip_ratio"}  # override field -> ActQuantConfig field


def solver_name(method: str) -> str:
    """The solver a method ends in, e.g. "awq+gptq" -> "gptq", "awq" (= "awq+rtn") -> "rtn"."""
    return METHOD_ALIASES.get(method, method).split("+")[-1]


@dataclass(frozen=True)
class CalibConfig:
    """What the statistics were collected on (recorded in saved models)."""

    source: str = "sciq"
    n_samples: int = 64
    seqlen: int = 512
    seed: int = 0


@dataclass
class Recipe:
    # the best uniform grid measured at 3-4 bits (bench/results/accuracy.md); 2 bits wants "bpdq"
    method: str = "awq+gptq"
    w_bits: int = 4
    group_size: int = 128
    sym: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # solver options, e.g. {"act_order": True}
    transform_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per transform name
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # glob on linear name -> spec fields
    skip: tuple[str, ...] = ()  # globs of linears kept in full precision
    a_bits: int = 16  # per-token dynamic activation quantization of every linear's input (16: off)
    a_sym: bool = False
    a_clip: float | None = 1.0  # clipping ratio of the activation range; None: searched per linear
    kv_bits: int = 16  # keys (after RoPE) and values, per head (16: off)
    kv_group_size: int = -1  # values per KV group along head_dim (-1: the whole head)
    kv_center: bool = True  # quantize keys around their calibrated mean (see bitquilt.nn.kv_quant)

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
        self.default_act.validate()
        self.kv_config().validate()
        for pattern, fields in self.overrides.items():
            bad = set(fields) - WEIGHT_FIELDS - set(ACT_FIELDS)
            if bad:
                raise ValueError(f"override {pattern!r}: unknown field(s) {sorted(bad)}; "
                                 f"use {', '.join(sorted(WEIGHT_FIELDS | set(ACT_FIELDS)))}")
        if "quarot" in self.transforms and "awq" in self.transforms:
            raise ValueError("awq cannot follow quarot: its scales would cross the online Hadamard transforms")

    @property
    def solver(self) -> str:
        return solver_name(self.method)

    @property
    def transforms(self) -> list[str]:
        return self.method.split("+")[:-1]

    @property
    def needs_calibration(self) -> bool:
        from bitquilt.transforms import get_transform

        searched_clip = self.a_clip is None or any(f.get("a_clip", 0) is None for f in self.overrides.values())
        return (get_solver(self.solver).needs_stats or any(get_transform(t).scope == "block" for t in self.transforms)
                or (searched_clip and self.a_bits < 16) or (self.kv_center and self.kv_bits < 16))

    @property
    def default_spec(self) -> LayerSpec:
        return LayerSpec(self.w_bits, self.group_size, self.sym)

    @property
    def default_act(self) -> ActQuantConfig:
        return ActQuantConfig(self.a_bits, self.a_sym, -1, self.a_clip)

    def _fields_for(self, name: str, default: dict[str, Any], keys: dict[str, str]) -> dict[str, Any] | None:
        """`default` updated by the overrides matching `name` (override key -> field), None if skipped."""
        if any(fnmatch.fnmatchcase(name, p) for p in self.skip):
            return None
        for pattern, fields in self.overrides.items():
            if fnmatch.fnmatchcase(name, pattern):
                default.update({keys[k]: v for k, v in fields.items() if k in keys})
        return default

    def spec_for(self, name: str) -> LayerSpec | None:
        """The grid for linear `name`, or None if it stays in full precision."""
        spec = self._fields_for(name, asdict(self.default_spec), {k: k for k in WEIGHT_FIELDS})
        return None if spec is None else LayerSpec(**spec).validate()

    def act_config_for(self, name: str) -> ActQuantConfig | None:
        """The input quantizer of linear `name`, or None if its input stays in full precision."""
        config = self._fields_for(name, asdict(self.default_act), ACT_FIELDS)
        config = None if config is None else ActQuantConfig(**config).validate()
        return config if config is not None and config.enabled else None

    def kv_config(self) -> ActQuantConfig:
        return ActQuantConfig(self.kv_bits, False, self.kv_group_size)

    def transform_options_for(self, name: str) -> dict[str, Any]:
        """The options of transform `name`: the recipe attributes it reads, then the user's."""
        from bitquilt.transforms import get_transform

        fields = {f: getattr(self, f) for f in get_transform(name).recipe_fields}
        return {**fields, **self.transform_options.get(name, {})}

    def label(self) -> str:
        g = "pc" if self.group_size == -1 else f"g{self.group_size}"
        act = f" a{self.a_bits}" if self.a_bits < 16 else ""
        kv = f" kv{self.kv_bits}" if self.kv_bits < 16 else ""
        return f"{self.method} w{self.w_bits}{g}{'s' if self.sym else ''}{act}{kv}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["skip"] = list(self.skip)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        return cls(**d)
