"""Function preservation: every transform checks itself on the model at hand (`bitquilt.calib.preserve`)."""

from __future__ import annotations

import re

import pytest
import torch

from bitquilt.api import quantize
from bitquilt.calib.preserve import TOLERANCE, NotPreserved
from bitquilt.calib.stages import STAGES, register_stage
from bitquilt.cli import main
from bitquilt.errors import UserError
from bitquilt.pipeline.engine import quantize_model
from bitquilt.recipes import Recipe
from bitquilt.transforms import awq, rotation
from tests.conftest import make_tiny, save_tiny_with_tokenizer

RECIPES = {  # every transform stage: QuaRot (model scope), AWQ and SmoothQuant (block), fold_perm (post_block)
    "quarot+rtn": dict(method="quarot+rtn", w_bits=8),
    "quarot+gptq-w4a4kv4": dict(method="quarot+gptq", w_bits=4, a_bits=4, kv_bits=4),
    "awq": dict(method="awq", w_bits=4),
    "smoothquant+rtn-a8": dict(method="smoothquant+rtn", w_bits=8, a_bits=8),
    "mxsens": dict(method="mxsens", stage_options={"mx_sens": {"target_bits": 5.2}}),
}
CHECKED = {"quarot+rtn": "quarot", "quarot+gptq-w4a4kv4": "quarot", "awq": "awq", "smoothquant+rtn-a8": "smoothquant",
           "mxsens": "fold_perm"}


def _ids(n=4, seqlen=64):
    return torch.randint(0, 320, (n, seqlen), generator=torch.Generator().manual_seed(0))


def _errors(report, stage: str) -> list[float]:
    """The preservation errors a stage recorded: one for a model stage, one per block for a block stage."""
    record = report.stages[stage]
    if "preservation_error" in record:
        return [record["preservation_error"]]
    return [r["preservation_error"] for r in record.values()]


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_existing_recipes_pass_the_check_on_tiny_models(model_type, name, monkeypatch, tmp_path):
    from bitquilt.policies import mx_sens

    monkeypatch.setattr(mx_sens, "memo_file", lambda key: tmp_path / f"{key}.json")
    model = make_tiny(model_type)
    report = quantize_model(model, Recipe(group_size=32, **RECIPES[name]), _ids(), progress=False)
    errors = _errors(report, CHECKED[name])
    assert len(errors) == (1 if "quarot" in name else 2)  # a model stage records its worst part, a block one each
    assert all(0 <= e < TOLERANCE / 100 for e in errors), errors


def _broken_fold(fold):
    """`fold` (scaling.fold_scales) followed by a 10% change of the first consumer: no longer the same function."""

    def broken(block, arch, shared, s):
        fold(block, arch, shared, s)
        block.get_submodule(shared.linears[0]).weight.mul_(1.1)

    return broken


def test_a_broken_block_transform_is_caught_at_its_block(monkeypatch):
    monkeypatch.setattr(awq, "fold_scales", _broken_fold(awq.fold_scales))
    with pytest.raises(NotPreserved, match=r"^awq does not preserve the function of this llama model: block 0's "
                                           r"update changed by 0\.1\d* \(relative error"):
        quantize_model(make_tiny("llama"), Recipe("awq", w_bits=4, group_size=32), _ids(), progress=False)


def test_a_rotation_that_drops_its_online_hadamard_is_caught(monkeypatch):
    """The writers' weights absorb the Hadamard but their inputs are no longer rotated online."""

    def absorbed_only(block, arch):
        for name in arch.writers:
            linear = block.get_submodule(name)
            rotation._set(linear.weight, rotation._times(linear.weight))

    monkeypatch.setattr(rotation, "online_hadamard", absorbed_only)
    with pytest.raises(NotPreserved, match=r"^quarot does not preserve the function of this qwen2 model: block 0's"):
        quantize_model(make_tiny("qwen2"), Recipe("quarot+rtn", w_bits=8), None, progress=False)


def test_a_perturbed_lm_head_is_caught(monkeypatch):
    rotate_head = rotation.rotate_head

    def off_head(model, arch, scale, signs):
        rotate_head(model, arch, scale, signs)
        model.get_submodule(arch.lm_head).weight.mul_(1.01)

    monkeypatch.setattr(rotation, "rotate_head", off_head)
    with pytest.raises(NotPreserved, match="quarot does not preserve the function of this llama model: the LM head's"):
        quantize_model(make_tiny("llama"), Recipe("quarot+rtn", w_bits=8), None, progress=False)


@pytest.fixture
def perturbing_stage():
    """A post_block transform that is not one: it scales a norm of the quantized block by 1.05."""

    def perturb(ctx, _options):
        ctx.block.post_attention_layernorm.weight.mul_(1.05)

    register_stage("toy_perturb", scope="post_block", kind="transform", needs_calibration=False)(perturb)
    yield
    STAGES.unregister("toy_perturb")


def test_a_broken_post_block_transform_is_caught_without_calibration_data(perturbing_stage):
    """A method reading no calibration data: the block transform is checked on a probe window of random token ids,
    carried through the (quantized) blocks."""
    with pytest.raises(NotPreserved, match="toy_perturb does not preserve the function of this llama model: block 0"):
        quantize_model(make_tiny("llama"), Recipe("toy_perturb+rtn", w_bits=8, group_size=32), None, progress=False)


def test_cli_stops_with_one_line_exit_2_and_writes_nothing(tmp_path, capsys, monkeypatch):
    save_tiny_with_tokenizer(tmp_path / "fp", "llama")
    monkeypatch.setattr(awq, "fold_scales", _broken_fold(awq.fold_scales))
    out = tmp_path / "q"
    code = main(["quantize", str(tmp_path / "fp"), "--method", "awq", "--group-size", "32", "--calib-samples", "2",
                 "--calib-seqlen", "32", "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("bitquilt quantize: error: awq does not preserve the function of this llama model: "
                              "block 0's update changed by ")
    assert "Traceback" not in "\n".join(err) and not out.exists()


# ---------------------------------------------------------------- refused up front
def _tiny_gemma(tmp_path):
    """A tiny Gemma 3 saved with a tokenizer, its post-branch norms given random weights (not the trivial init)."""
    path = tmp_path / "gemma"
    save_tiny_with_tokenizer(path, "gemma3_text")  # make_tiny randomises every norm, the post-norms among them
    return path


QUAROT_REFUSED = (r"quarot cannot run on gemma3 models: the family normalises each branch's output with a weighted "
                  r"norm before the residual add, .*; quantize without quarot$")


def test_quarot_is_refused_on_a_family_with_post_branch_norms_before_any_work(monkeypatch):
    model = make_tiny("gemma3_text")
    post = model.model.layers[0].post_feedforward_layernorm.weight
    assert post.std() > 0.1  # non-trivial post-norm weights
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(rotation, "rotate_block", lambda *a, **k: pytest.fail("QuaRot ran"))
    with pytest.raises(UserError, match=QUAROT_REFUSED):
        quantize(model, Recipe("quarot+gptq", w_bits=4, group_size=32, a_bits=4, kv_bits=4), _ids(), progress=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing changed


def test_cli_refuses_quarot_on_gemma_before_loading(tmp_path, capsys, monkeypatch):
    import bitquilt.api

    path = _tiny_gemma(tmp_path)
    monkeypatch.setattr(bitquilt.api, "load", lambda *_a, **_k: pytest.fail("the model was loaded"))
    capsys.readouterr()
    for stream in ([], ["--stream"]):
        out = tmp_path / "q"
        code = main(["quantize", str(path), "--method", "quarot+rtn", "--w-bits", "8", *stream, "-o", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and not out.exists()
        assert re.match(r"bitquilt quantize: error: " + QUAROT_REFUSED, err[0]), err


def test_methods_without_a_residual_rotation_run_on_gemma(tmp_path):
    """AWQ and SmoothQuant fold into the norm that feeds their linears (Gemma's pre-norms), which holds: checked."""
    model = make_tiny("gemma3_text")
    report = quantize_model(model, Recipe("awq", w_bits=4, group_size=32), _ids(), progress=False)
    assert max(_errors(report, "awq")) < TOLERANCE / 100
