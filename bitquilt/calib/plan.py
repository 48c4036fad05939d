"""The quantization plan: what every linear and attention module of a model will become.

A plan starts from the recipe's static rules (default grid, globs in `skip` and `overrides`)
and is then refined by policies (`bitquilt.policies`) from calibration measurements: per block
(activation clipping, key centres) or in a whole-model pre-pass (bit budgets across layers).
The engine asks the plan, not the recipe, what to build; the plan's final state and each
policy's decisions are recorded in the saved model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bitquilt.nn.act_quant import ActQuantConfig
from bitquilt.solvers.base import LayerSpec


@dataclass
class LinearPlan:
    """One linear: its weight grid (None: stays full precision), its input quantizer (None: the
    input stays full precision) and `params`, solver options policies chose for this linear alone
    (e.g. MXINT column classes); they update the recipe's solver options when it is solved."""

    weight: LayerSpec | None
    act: ActQuantConfig | None
    params: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"weight": None if self.weight is None else dataclasses.asdict(self.weight),
                "act": None if self.act is None else dataclasses.asdict(self.act),
                "params": {k: v for k, v in self.params.items() if _is_plain(v)}}


def _is_plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, list, tuple, dict))


@dataclass
class Plan:
    """Per-linear plans by full module name, KV-cache quantizers by attention module name, and the
    decisions each policy took (by policy name, JSON-serialisable)."""

    linears: dict[str, LinearPlan]
    kv: dict[str, ActQuantConfig]
    decisions: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def static(cls, linear_names: list[str], attention_names: list[str],
               weight_for: Callable[[str], LayerSpec | None], act_for: Callable[[str], ActQuantConfig | None],
               kv: ActQuantConfig) -> Plan:
        """The static policy: the recipe's globs and overrides, applied name by name."""
        linears = {}
        for n in linear_names:
            weight = weight_for(n)
            linears[n] = LinearPlan(weight, None if weight is None else act_for(n))
        return cls(linears, {n: kv for n in attention_names} if kv.enabled else {})

    def __getitem__(self, name: str) -> LinearPlan:
        return self.linears[name]

    def weight(self, name: str) -> LayerSpec | None:
        plan = self.linears.get(name)
        return None if plan is None else plan.weight

    def act(self, name: str) -> ActQuantConfig | None:
        plan = self.linears.get(name)
        return None if plan is None or plan.act is None or not plan.act.enabled else plan.act

    def quantized(self) -> list[str]:
        return [n for n, p in self.linears.items() if p.weight is not None]

    def to_dict(self) -> dict[str, Any]:
        return {"linears": {n: p.to_dict() for n, p in self.linears.items()},
                "kv": {n: dataclasses.asdict(c) for n, c in self.kv.items()},
                "decisions": self.decisions}
