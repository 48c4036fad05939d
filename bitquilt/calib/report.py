"""What a quantization run did and what it cost, as saved with the model."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class LinearReport:
    name: str
    format: str
    bits_per_weight: float
    nbytes: int
    seconds: float
    rel_error: float | None  # tr(D H Dᵀ) / tr(W H Wᵀ), D = W − Ŵ: relative output error on calibration data
    base_rel_error: float | None = None  # the same for the solver's dense base alone, when a residual was added


@dataclass
class QuantReport:
    recipe: dict[str, Any]
    calibration: dict[str, Any] | None
    linears: list[LinearReport] = field(default_factory=list)
    block_seconds: list[float] = field(default_factory=list)
    block_cpu_seconds: list[float] = field(default_factory=list)  # process CPU time of each block (all threads)
    stages: dict[str, Any] = field(default_factory=dict)  # what each stage reported, by stage name
    plan: dict[str, Any] = field(default_factory=dict)  # the final plan (`bitquilt.calib.plan.Plan.to_dict`)
    total_seconds: float = 0.0  # of this call: a resumed run's earlier blocks are only in the per-block lists
    peak_rss_mb: float = 0.0
    resumed_at: int = 0  # the first block this call quantized (> 0: the blocks before came from a resume directory)
    compute: dict[str, str] = field(default_factory=dict)  # calibration precision, device and why that precision

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
