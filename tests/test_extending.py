"""A new method added from outside the package: a format, a solver and a policy registered here run end
to end (API, CLI, save, load) without any edit to the engine, recipes or CLI."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

import bitquilt
from bitquilt.calib.stages import STAGES, ModelContext, register_stage
from bitquilt.cli import main
from bitquilt.formats.base import FORMATS, WeightFormat, register_format
from bitquilt.io import CONFIG_NAME
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import Recipe
from bitquilt.registry import option
from bitquilt.solvers.base import SOLVERS, LayerSpec, register_solver
from tests.conftest import make_tiny


class SignFormat(WeightFormat):
    """w ≈ s_r·sign(w): one bit per weight and an fp16 scale per row (the toy's packed format)."""

    name = "toy_sign"
    supported_bits: ClassVar[tuple[int, ...]] = (1,)
    supported_group_sizes: ClassVar[tuple[int, ...]] = (-1,)

    def __init__(self, negative: torch.Tensor, scales: torch.Tensor):
        self.negative, self.scales = negative, scales
        self.out_features, self.in_features = negative.shape

    def dequantize(self, selector: Any = None) -> torch.Tensor:
        return self.scales.float().unsqueeze(1) * (1 - 2 * self.negative.float())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"negative": self.negative, "scales": self.scales}

    def meta(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> SignFormat:
        return cls(tensors["negative"], tensors["scales"])


@dataclass(frozen=True)
class SignOptions:
    shrink: float = option(1.0, "scale multiplier")


def sign_solver(weight: torch.Tensor, stats, spec: LayerSpec, opts: SignOptions) -> SignFormat:
    return SignFormat((weight < 0).to(torch.uint8), (weight.abs().mean(dim=1) * opts.shrink).half())


@dataclass(frozen=True)
class KeepFirstOptions:
    blocks: int = option(1, "leading blocks kept in full precision")


def keep_first(ctx: ModelContext, opts: KeepFirstOptions) -> dict[str, Any]:
    """A whole-model pre-pass policy: the first `blocks` blocks stay in full precision."""
    kept = [n for n in ctx.plan.quantized() if int(n.split(".")[2]) < opts.blocks]
    for n in kept:
        ctx.plan[n].weight = None
    ctx.plan.decisions["toy_keep_first"] = kept
    return {"kept": len(kept)}


@pytest.fixture(scope="module", autouse=True)
def toy_method():
    register_format(SignFormat)
    register_solver("toy_sign", SignOptions, needs_stats=False, produces=SignFormat)(sign_solver)
    register_stage("toy_keep_first", scope="prepass", kind="policy", options=KeepFirstOptions,
                   needs_calibration=False)(keep_first)
    yield
    FORMATS.pop("toy_sign")
    SOLVERS.unregister("toy_sign")
    STAGES.unregister("toy_keep_first")


def test_toy_method_runs_through_the_api_and_round_trips(tmp_path):
    model = make_tiny("llama")
    recipe = Recipe("toy_keep_first+toy_sign", w_bits=1, group_size=-1, stage_options={"toy_keep_first": {"blocks": 1}})
    report = bitquilt.quantize(model, recipe, calib=torch.zeros(1, 8, dtype=torch.long))
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert quantized and all(not n.startswith("model.layers.0.") for n in quantized)
    assert all(isinstance(m.fmt, SignFormat) for m in model.modules() if isinstance(m, QuantLinear))
    assert report.stages["toy_keep_first"] == {"kept": 7} and report.plan["decisions"]["toy_keep_first"]
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        before = model(ids).logits
    bitquilt.save(model, tmp_path / "toy")
    loaded, _ = bitquilt.load(tmp_path / "toy")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)


def test_toy_method_options_are_validated_when_the_recipe_is_built():
    with pytest.raises(ValueError, match="no option"):
        Recipe("toy_keep_first+toy_sign", w_bits=1, group_size=-1, stage_options={"toy_keep_first": {"blockz": 1}})
    with pytest.raises(ValueError, match="toy_keep_first.*blocks=.*expected"):
        Recipe("toy_keep_first+toy_sign", w_bits=1, group_size=-1, stage_options={"toy_keep_first": {"blocks": "x"}})
    with pytest.raises(ValueError, match="unsupported weight bits 4 by solver 'toy_sign'; supported: 1"):
        Recipe("toy_sign")


def test_toy_method_runs_from_the_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(["quantize", "smollm2-135m", "--method", "toy_keep_first+toy_sign", "--w-bits", "1",
                 "--group-size", "-1", "--opt", "toy_keep_first.blocks=29", "--opt", "shrink=0.5",
                 "-o", str(out), "--json"])
    assert code == 0, capsys.readouterr().err
    saved = json.loads((out / CONFIG_NAME).read_text())
    assert list(saved["layers"]) == [f"model.layers.29.{n}" for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")]
    assert saved["recipe"]["options"] == {"shrink": 0.5}
    assert saved["recipe"]["stage_options"]["toy_keep_first"] == {"blocks": 29}
