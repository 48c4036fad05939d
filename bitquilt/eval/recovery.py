"""MosaicQuant's residual-recovery analysis of a saved model: how much of each linear's output distortion
its sparse residual removed.

For a linear with dense base B and residual R_S (weight W after the backbone's transform), with the
calibration inputs X the run quantized it on (H = XᵀX/n):

    recovered = 1 − tr((W − B − R_S) H (W − B − R_S)ᵀ) / tr((W − B) H (W − B)ᵀ)

Both traces are measured when the model is quantized (`LinearReport.base_rel_error` and `rel_error`,
each divided by tr(W H Wᵀ)) and saved in its quantization record, so the analysis needs only the
saved directory. Linears are grouped by kind (the last part of their name: q_proj, down_proj, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from bitquilt.cache import write_figure

NO_RESIDUAL = ("quantize it with a residual (bitquilt quantize MODEL --method quarot+gptq --residual mosaic "
               "--residual-budget 0.1 ...) and a calibrated recipe")


@dataclass(frozen=True)
class LinearRecovery:
    name: str
    layer: int | None
    kind: str
    format: str
    bits_per_weight: float
    base_error: float  # tr(E H Eᵀ) / tr(W H Wᵀ), E = W − B
    error: float  # the same after the residual

    @property
    def recovered(self) -> float:
        return 1.0 - self.error / self.base_error if self.base_error > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"linear": self.name, "layer": self.layer, "kind": self.kind, "format": self.format,
                "bits_per_weight": self.bits_per_weight, "base_rel_error": self.base_error,
                "rel_error": self.error, "recovered": self.recovered}


def recoveries(record: dict[str, Any] | None) -> list[LinearRecovery]:
    """Every linear of a quantization record that got a residual; ValueError if there is none."""
    linears = (record or {}).get("report", {}).get("linears", [])
    out = []
    for r in linears:
        if r.get("base_rel_error") is None or r.get("rel_error") is None:
            continue
        layer = re.search(r"\.(\d+)\.", r["name"])
        out.append(LinearRecovery(r["name"], int(layer.group(1)) if layer else None, r["name"].rsplit(".", 1)[-1],
                                  r["format"], r["bits_per_weight"], r["base_rel_error"], r["rel_error"]))
    if not out:
        raise ValueError(f"the model's quantization record holds no residual measurements; {NO_RESIDUAL}")
    return out


def summary(rows: list[LinearRecovery]) -> list[dict[str, Any]]:
    """Per kind and overall: mean recovered fraction, the fraction of summed relative distortion recovered,
    and the mean bits/weight."""
    kinds = sorted({r.kind for r in rows}) + ["all"]
    out = []
    for kind in kinds:
        chosen = [r for r in rows if kind in ("all", r.kind)]
        base = sum(r.base_error for r in chosen)
        out.append({"kind": kind, "linears": len(chosen),
                    "mean_recovered": sum(r.recovered for r in chosen) / len(chosen),
                    "pooled_recovered": 1.0 - sum(r.error for r in chosen) / base if base > 0 else 0.0,
                    "bits_per_weight": sum(r.bits_per_weight for r in chosen) / len(chosen)})
    return out


def plot_recovery(rows: list[LinearRecovery], path: str | Path, title: str) -> Path:
    """Recovered fraction per decoder layer, one line per linear kind. Written atomically."""
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.subplots()
    for kind in sorted({r.kind for r in rows}):
        points = sorted((r.layer, r.recovered) for r in rows if r.kind == kind and r.layer is not None)
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", ms=3, label=kind)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("recovered fraction of ‖(W − B)X‖²")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(title)
    fig.tight_layout()
    return write_figure(fig, path)
