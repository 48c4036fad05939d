"""Every supported family × every method bitquilt offers, end to end on tiny random models (docs/families.md).

A cell either runs — quantize through the Python API, save → load bit-identical, a finite loss on random windows
(the same from bitquilt's runtime), the transformers forward's greedy tokens from the auto engine, and each export
target written or refused in one line with nothing left behind — or is refused in one line before any work. The
function-preservation check (`bitquilt.calib.preserve`) is on by default and has no switch: every transform checks
itself where it is applied, and each cell asserts that each of its transforms recorded an error within TOLERANCE. A
family added to `supported_model_types` joins the matrix and fails here until `make_tiny` builds it.
"""

from __future__ import annotations

import math

import pytest
import torch

from bitquilt import api
from bitquilt.calib.preserve import TOLERANCE
from bitquilt.calib.stages import STAGES
from bitquilt.errors import UserError
from bitquilt.eval.ppl import window_losses
from bitquilt.export import FORMATS
from bitquilt.io import load_quantized
from bitquilt.models.adapters import supported_model_types
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import Recipe
from bitquilt.runtime.engines import decode
from bitquilt.solvers import SOLVERS
from tests.conftest import ROUTED_RECIPE, WINDOWED, make_tiny

FAMILIES = supported_model_types()
MOE = ("mixtral", "olmoe", "qwen3_moe")

# One tiny recipe per method (docs/methods/), a few calibration steps each; together they run every solver and stage.
METHODS = {
    "rtn": dict(method="rtn", w_bits=4, group_size=64),
    "gptq": dict(method="gptq", w_bits=4, group_size=64, sym=True),
    "awq+gptq": dict(method="awq+gptq", w_bits=4, group_size=64, sym=True),
    "bpdq": dict(method="bpdq", w_bits=2, group_size=64),
    "recon": dict(method="rtn", w_bits=4, group_size=64, sym=True, recon_steps=2,
                  stage_options={"recon": {"batch": 2}}),
    "smoothquant-w8a8": dict(method="smoothquant+rtn", w_bits=8, group_size=32, a_bits=8, a_clip=None),
    "quarot-w4a4kv4": dict(method="quarot+rtn", w_bits=4, group_size=32, a_bits=4, kv_bits=4),
    "mxint": dict(method="mxint", w_bits=4),
    "mxsens": dict(method="mxsens", stage_options={"mx_sens": {"target_bits": 5.2}}),
    "mobiquant": ROUTED_RECIPE,
    "mosaic": dict(method="rtn", w_bits=4, group_size=32, residual="mosaic"),
    "dynamic-a8": dict(method="rtn", w_bits=4, group_size=32, a_bits=4, a8_layers=1),
    "gguf-Q4_K_M": dict(method="gptq", gguf_type="Q4_K_M"),  # ggml blocks (tiny rows fall back to Q5_0, Q8_0, …)
    "gguf-Q6_K": dict(method="rtn", gguf_type="Q6_K"),
}

# (family, method) -> "runs", or what its one-line refusal says
QUAROT_REFUSED = "quarot cannot run on gemma[23] models: the family normalises each branch's output with a weighted"
EXPECTED = {(family, method): "runs" for family in FAMILIES for method in METHODS} | {
    ("gemma2", "quarot-w4a4kv4"): QUAROT_REFUSED,
    ("gemma3_text", "quarot-w4a4kv4"): QUAROT_REFUSED,
}

# Where a cell runs, why an export target refuses it (substrings of the one-line refusal); a target no reason applies
# to writes its file. By method: what the target cannot hold or run.
ONLINE = "it runs the online module(s)"
METHOD_EXPORTS = {
    "bpdq": {"gguf": "GGUF has no bitplane format", "compressed-tensors": "compressed-tensors has no bitplane format",
             "standalone": "runs uniform grids, not BitplaneFormat"},
    "smoothquant-w8a8": dict.fromkeys(FORMATS, ONLINE),
    "quarot-w4a4kv4": dict.fromkeys(FORMATS, ONLINE),
    "mxint": {"gguf": "GGUF has no mxint format", "compressed-tensors": "compressed-tensors has no mxint format",
              "standalone": "runs uniform grids, not MXIntFormat"},
    "mobiquant": {"gguf": ONLINE, "compressed-tensors": ONLINE},  # the standalone runtime routes slices
    "mosaic": {"gguf": "GGUF has no composite format", "compressed-tensors": "compressed-tensors has no composite",
               "standalone": "slices other than 2 to 8 bit-plane or uniform parts"},
    "dynamic-a8": dict.fromkeys(FORMATS, ONLINE),
    "gguf-Q4_K_M": {"compressed-tensors": "quantized input embeddings (--head-bits, or a --gguf-type mix)",
                    "standalone": "runs uniform grids, not GGMLFormat"},
}
METHOD_EXPORTS["mxsens"] = METHOD_EXPORTS["mxint"]
METHOD_EXPORTS["gguf-Q6_K"] = METHOD_EXPORTS["gguf-Q4_K_M"]
# By family: what the target's runtime does not compute (docs/families.md), whatever the method.
FAMILY_EXPORTS = {
    "mistral": {"gguf": "supported families"},
    "qwen3": {"gguf": "supported families"},
    "gemma2": {"gguf": "queries scaled by 1/√256"},  # the tiny head_dim of 32 (and WINDOWED's layer pattern)
    "gemma3_text": {"gguf": "queries scaled by 1/√256"},
    "phi3": {"standalone": "a partial rotary factor of 0.75"},
    "olmoe": {"gguf": "grouped-query attention"},  # llama.cpp's olmoe graph has no GQA
}
# On MoE families: compressed-tensors refuses asymmetric experts (transformers decompresses them without zero points).
MOE_EXPORTS = {"rtn": {"compressed-tensors": "decompresses expert weights without zero points"}}

IDS = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(0))  # calibration
WINDOWS = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))  # evaluation
OUTPUTS = {"gguf": "m.gguf", "compressed-tensors": "ct", "standalone": "sa"}


def export_reasons(family: str, method: str, to: str) -> list[str]:
    """The refusals `to` may give a (family, method) cell that runs; [] where it writes the file."""
    tables = (FAMILY_EXPORTS.get(family, {}), METHOD_EXPORTS.get(method, {}),
              MOE_EXPORTS.get(method, {}) if family in MOE else {})
    return [table[to] for table in tables if to in table]


def test_the_matrix_runs_every_solver_and_stage():
    recipes = [Recipe(**fields) for fields in METHODS.values()]
    ran = {stage.name for recipe in recipes for stage, _ in recipe.stages()} | {r.solver for r in recipes}
    assert set(SOLVERS) | set(STAGES) <= ran, sorted(set(SOLVERS) | set(STAGES) - ran)


def _preservation_errors(report) -> dict[str, float]:
    """The worst relative error each checked transform recorded: one for a model stage, one per block otherwise."""
    worst = {}
    for name, record in report.stages.items():
        if "preservation_error" in record:
            worst[name] = record["preservation_error"]
        elif errors := [r["preservation_error"] for r in record.values()
                        if isinstance(r, dict) and "preservation_error" in r]:
            worst[name] = max(errors)
    return worst


def _export(saved, tmp_path, to) -> str:
    """"written", or the one-line reason the export was refused with, nothing left behind."""
    before = set(tmp_path.iterdir())
    output = tmp_path / OUTPUTS[to]
    try:
        api.export(saved, output, to=to)
    except UserError as e:
        assert "\n" not in str(e) and set(tmp_path.iterdir()) == before, (to, str(e))
        return str(e)
    assert output.exists()
    return "written"


@pytest.mark.parametrize("family, method", list(EXPECTED), ids=[f"{f}-{m}" for f, m in EXPECTED])
def test_family_runs_method_end_to_end_or_refuses_it_first(family, method, tmp_path, monkeypatch):
    from bitquilt.policies import mx_sens

    monkeypatch.setattr(mx_sens, "memo_file", lambda key: tmp_path / f"{key}.json")
    recipe = Recipe(**METHODS[method])
    model = make_tiny(family, **WINDOWED.get(family, {}))
    outcome = EXPECTED[family, method]
    if outcome != "runs":
        before = {k: v.clone() for k, v in model.state_dict().items()}
        monkeypatch.setattr(api, "quantize_model", lambda *a, **k: pytest.fail("calibration began before the refusal"))
        with pytest.raises(UserError, match=outcome) as refused:
            api.quantize(model, recipe, IDS, progress=False)
        assert "\n" not in str(refused.value)
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
        return

    report = api.quantize(model, recipe, IDS, progress=False)
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    checked = _preservation_errors(report)
    assert set(recipe.transforms) <= set(checked) and all(0 <= e <= TOLERANCE for e in checked.values()), checked

    api.save(model, tmp_path / "q")
    loaded, _ = load_quantized(tmp_path / "q")
    want, got = model.state_dict(), loaded.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    with torch.no_grad():
        assert torch.equal(loaded(WINDOWS).logits, model(WINDOWS).logits)  # online modules reload as they were
    losses = window_losses(loaded, WINDOWS)
    assert all(math.isfinite(loss) for loss in losses)
    want = decode(loaded, WINDOWS[:1, :8], 4, engine="transformers").new_ids
    assert len(want) == 4 and all(0 <= t < 320 for t in want)
    assert decode(loaded, WINDOWS[:1, :8], 4).new_ids == want  # the auto engine: fused or lean where they serve
    tree, _ = load_quantized(tmp_path / "q", runtime="auto")  # bitquilt's module tree where it covers the family
    assert window_losses(tree, WINDOWS) == pytest.approx(losses, rel=1e-5)
    assert decode(tree, WINDOWS[:1, :8], 4).new_ids == want

    for to in FORMATS:
        reasons = export_reasons(family, method, to)
        result = _export(tmp_path / "q", tmp_path, to)
        assert (result == "written") if not reasons else any(why in result for why in reasons), (to, result)
