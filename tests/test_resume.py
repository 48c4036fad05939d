"""Resumable quantization: an interrupted run carried on from its directory equals an uninterrupted one."""

from __future__ import annotations

import pytest
import torch

import bitquilt.pipeline.engine as engine
from bitquilt.api import quantize
from bitquilt.cli import main
from bitquilt.recipes import Recipe
from tests.conftest import make_tiny

IDS = torch.randint(0, 320, (8, 32), generator=torch.Generator().manual_seed(0))
RECIPES = {
    "gptq": dict(method="gptq", w_bits=4, group_size=32),
    "quarot+gptq": dict(method="quarot+gptq", w_bits=4, group_size=32, a_bits=8),  # a model-scope stage
    "mobiquant": dict(method="mobiquant", w_bits=6, group_size=32,  # routers, per-prefix streams in the scratch
                      stage_options={"mobiroute": {"target_bits": 3.0, "steps": 4, "batch": 4}}),
}


class Interrupted(Exception):
    pass


def _interrupt_after_first_block(monkeypatch) -> list[int]:
    saved = []
    real = engine.save_progress

    def save_then_stop(directory, block, progress):
        real(directory, block, progress)
        saved.append(progress.index)
        raise Interrupted

    monkeypatch.setattr(engine, "save_progress", save_then_stop)
    return saved


@pytest.mark.parametrize("name", list(RECIPES))
def test_an_interrupted_run_resumes_to_the_uninterrupted_result(name, tmp_path, monkeypatch):
    whole = make_tiny("llama")
    report = quantize(whole, Recipe(**RECIPES[name]), IDS, progress=False)

    saved = _interrupt_after_first_block(monkeypatch)
    with pytest.raises(Interrupted):
        quantize(make_tiny("llama"), Recipe(**RECIPES[name]), IDS, progress=False, resume_dir=tmp_path)
    assert saved == [0] and (tmp_path / "block_0000.pt").exists() and not (tmp_path / "block_0001.pt").exists()
    block = torch.load(tmp_path / "block_0000.pt", weights_only=True)  # plain data: packed tensors only
    assert block["layers"] and not any("dequantized" in k for k in block["tensors"])
    monkeypatch.undo()
    first = torch.load(tmp_path / "state.pt", weights_only=True)["report"]

    resumed = make_tiny("llama")  # a fresh process would load the model again
    again = quantize(resumed, Recipe(**RECIPES[name]), IDS, progress=False, resume_dir=tmp_path)
    a, b = whole.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(whole(IDS).logits, resumed(IDS).logits)
    assert again.resumed_at == 1  # block 0 restored with its wall and CPU times, not redone
    assert again.block_seconds[:1] == first["block_seconds"]
    assert again.block_cpu_seconds[:1] == first["block_cpu_seconds"]
    assert len(again.block_seconds) == len(again.block_cpu_seconds) == 2 and again.stages.keys() == report.stages.keys()
    assert [r.name for r in again.linears] == [r.name for r in report.linears]


def test_a_directory_holding_another_run_is_refused(tmp_path):
    quantize(make_tiny("llama"), Recipe("gptq", w_bits=4, group_size=32), IDS, progress=False, resume_dir=tmp_path)
    for other in (Recipe("gptq", w_bits=3, group_size=32), Recipe("gptq", w_bits=4, group_size=32)):
        ids = IDS if other.w_bits == 3 else IDS.flip(0)  # another recipe, then other calibration data
        with pytest.raises(ValueError, match="progress of another run"):
            quantize(make_tiny("llama"), other, ids, progress=False, resume_dir=tmp_path)
    with pytest.raises(ValueError, match="progress of another run"):  # another model
        quantize(make_tiny("llama", seed=1), Recipe("gptq", w_bits=4, group_size=32), IDS, progress=False,
                 resume_dir=tmp_path)


def test_cli_resume_keeps_progress_beside_the_output_until_it_is_saved(tmp_path, capsys):
    path = tmp_path / "fp"
    make_tiny("qwen2").save_pretrained(path)
    args = ["quantize", str(path), "--method", "rtn", "--w-bits", "4", "--group-size", "32", "--json"]
    assert main(args + ["--resume", "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out").is_dir() and not (tmp_path / "out.partial").exists()
    capsys.readouterr()
    assert main(args + ["--resume", "--stream", "-o", str(tmp_path / "both")]) == 2
    assert "cannot be combined with --stream" in capsys.readouterr().err and not (tmp_path / "both").exists()


class _Payload:
    """Pickles as a call of os.system: what a planted resume file would run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("planted", ["state.pt", "block_0000.pt"])
def test_a_planted_pickle_payload_is_refused_not_run(planted, tmp_path):
    """Resume files are read as plain data (weights_only): a payload in the state or a block never runs."""
    resume = tmp_path / "resume"
    quantize(make_tiny("llama"), Recipe("rtn", w_bits=4, group_size=32), IDS, progress=False, resume_dir=resume)
    marker = tmp_path / "ran"
    torch.save({"version": 2, "payload": _Payload(marker)}, resume / planted)
    with pytest.raises(ValueError, match="cannot be read back as plain data"):
        quantize(make_tiny("llama"), Recipe("rtn", w_bits=4, group_size=32), IDS, progress=False, resume_dir=resume)
    assert not marker.exists()


def test_a_full_disk_while_saving_progress_says_what_is_kept(tmp_path, monkeypatch):
    import errno

    import bitquilt.pipeline.resume as resume

    def full(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(resume.torch, "save", full)
    with pytest.raises(OSError, match=r"saving the resume state of block 0 .*No space left.*--resume"):
        quantize(make_tiny("llama"), Recipe("rtn", w_bits=4, group_size=32), IDS, progress=False,
                 resume_dir=tmp_path / "r")
