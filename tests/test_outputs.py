"""What bitquilt writes and says, and what it must not touch: --overwrite replaces only its own outputs, an export
carries only the saved model's own files, an output is claimed before the work, temporaries of dead processes are
swept at the next start, the cache is owner-only and nothing in it is run, generate names what ran (issue 65)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from conftest import make_tiny

from bitquilt import cache, native_build
from bitquilt.cli import main


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "fp"
    make_tiny("llama").save_pretrained(path)
    return path


def _quantize(capsys, hf, out, *extra) -> tuple[int, str]:
    code = main(["quantize", str(hf), "--method", "rtn", "--group-size", "32", "-o", str(out), "--json", *extra])
    return code, capsys.readouterr().err


def test_overwrite_replaces_only_what_bitquilt_wrote(hf_tiny, tmp_path, capsys):
    foreign = tmp_path / "u"
    foreign.mkdir()
    (foreign / "important.txt").write_text("keep me")
    code, err = _quantize(capsys, hf_tiny, foreign, "--overwrite")
    assert code == 2 and err.count("\n") == 1 and "important.txt, which it did not write" in err, err
    assert "(overwrite=True)" not in err and (foreign / "important.txt").read_text() == "keep me"

    out = tmp_path / "q"
    assert _quantize(capsys, hf_tiny, out)[0] == 0
    assert (out / cache.MANIFEST).is_file() and cache.foreign_entries(out) == []
    code, err = _quantize(capsys, hf_tiny, out)
    assert code == 2 and "already exists" in err and "--overwrite" in err and "overwrite=True" not in err
    assert _quantize(capsys, hf_tiny, out, "--overwrite")[0] == 0  # its own output: replaced
    (out / "notes.txt").write_text("mine")
    code, err = _quantize(capsys, hf_tiny, out, "--overwrite")
    assert code == 2 and "notes.txt" in err and (out / "notes.txt").exists()


def test_export_carries_the_saved_models_own_files_only(hf_tiny, tmp_path, capsys):
    assert _quantize(capsys, hf_tiny, tmp_path / "q", "--group-size", "64")[0] == 0
    (tmp_path / "q" / "notes.txt").write_text("a stray file")
    (tmp_path / "q" / "model.gguf").write_bytes(b"GGUF" + bytes(64))
    assert main(["export", str(tmp_path / "q"), "-o", str(tmp_path / "run"), "--to", "standalone", "--json"]) == 0
    exported = {p.name for p in (tmp_path / "run").iterdir()}
    assert "notes.txt" not in exported and "model.gguf" not in exported and "generation_config.json" in exported
    (tmp_path / "not.gguf").write_text("a text file")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "q"), "-o", str(tmp_path / "not.gguf"), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "replaces only a GGUF file" in err and (tmp_path / "not.gguf").read_text() == "a text file"


def test_an_output_another_live_process_is_writing_is_refused_at_the_start(hf_tiny, tmp_path, capsys):
    """The second of two quantize runs to one -o learns it at its start, not after its whole run."""
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as other:
        try:
            (tmp_path / f".q.tmp-{other.pid}-0123abcd").mkdir()  # what that process's claim of q looks like
            code, err = _quantize(capsys, hf_tiny, tmp_path / "q")
        finally:
            other.kill()
    assert code == 2 and f"another bitquilt process (PID {other.pid}) is writing" in err, err
    assert not (tmp_path / "q").exists()


def test_temporaries_of_dead_processes_are_removed_at_the_next_start(hf_tiny, tmp_path, capsys):
    done = subprocess.run([sys.executable, "-c", "pass"])
    assert done.returncode == 0
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".other.tmp-{dead.pid}-0123abcd"  # a killed save of another name
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(bytes(1024))
    assert _quantize(capsys, hf_tiny, tmp_path / "q")[0] == 0
    assert not stale.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # the claim went into q


def test_the_cache_is_owner_only_and_nothing_in_it_is_run(tmp_path, monkeypatch):
    monkeypatch.setenv("BITQUILT_CACHE", str(tmp_path / "cache"))
    path = cache.cache_dir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    # the compiled products are the package's own (built at install time), never looked up in the cache
    from bitquilt.runtime.standalone.library import library_path, runner_path

    for product in (library_path(), runner_path()):
        assert product.parent == native_build.OUT and path not in product.parents
    sources = [p.read_text() for p in native_build.PACKAGE.rglob("*.py")]
    assert not any("cpp_extension.load(" in s or "load_inline(" in s for s in sources)  # no run-time build


def test_a_failed_output_claim_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    """A command refused after it claimed its output drops the claim (nothing half-written)."""
    code = main(["quantize", "smollm2-135m", "--method", "rtn", "-o", str(tmp_path / "q"), "--calib-data",
                 "nosuch.txt"])
    assert code == 2 and os.listdir(tmp_path) == []


def test_generate_says_which_runtime_and_engine_ran(tmp_path, capsys):
    import json

    from conftest import save_tiny_with_tokenizer

    save_tiny_with_tokenizer(tmp_path / "fp")
    assert main(["quantize", str(tmp_path / "fp"), "--method", "rtn", "--group-size", "32", "-o", str(tmp_path / "q"),
                 "--json"]) == 0
    capsys.readouterr()
    for engine, runtime, ran in (("auto", "bitquilt", {"fused", "lean"}), ("lean", "bitquilt", {"lean"}),
                                 ("transformers", "transformers", {"transformers"})):
        assert main(["generate", str(tmp_path / "q"), "--prompt", "Hi", "--max-new-tokens", "2", "--engine", engine,
                     "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["runtime"] == runtime and result["engine"] in ran, (engine, result)
    assert main(["generate", str(tmp_path / "q"), "--prompt", "Hi", "--max-new-tokens", "2"]) == 0
    assert "runtime=bitquilt, engine=" in capsys.readouterr().err


def test_progress_bars_in_a_log_print_a_few_lines(monkeypatch, capsys):
    """Not a terminal: the first and last lines of a bar, not one per redraw."""
    import time

    from bitquilt.progress import progress_bar

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    for _ in progress_bar(range(200), desc="work"):
        time.sleep(0.001)
    lines = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.strip()]
    assert 1 <= len(lines) <= 3 and "200/200" in lines[-1], lines


def test_compare_in_a_log_draws_each_bar_once_at_the_start_and_once_at_the_end(tmp_path, monkeypatch, capsys):
    """compare's bars (transformers' weight loading, quantize with its per-block postfix, perplexity) in a log: no
    redraw lines between a bar's first and last."""
    from conftest import save_tiny_with_tokenizer
    from transformers.utils import logging as hf_logging

    from bitquilt.progress import _LogBar

    save_tiny_with_tokenizer(tmp_path / "fp")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "fp"), "--methods", "fp,rtn", "--w-bits", "4", "--ppl-windows", "2",
                 "--seqlen", "64"]) == 0
    bars = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "%|" in line]
    assert {line.split(":")[0] for line in bars} == {"Loading weights", "quantize rtn w4g128", "perplexity"}
    assert all(" 0%|" in line or "100%|" in line for line in bars), bars
    assert len(bars) == 2 * (2 + 1 + 2)  # two loads, one quantize, two perplexities: first and last line each
    assert isinstance(hf_logging.tqdm(range(2)), _LogBar)  # transformers' bars are drawn by progress_bar


def test_a_gguf_export_that_does_not_fit_is_one_line_with_the_space_it_needs(hf_tiny, tmp_path, capsys,
                                                                            monkeypatch):
    """Too little space, found before the write or by it (numpy's "N requested and M written"): one line naming the
    file, the MB it needs and the MB free, exit 1, after the bar's own finished lines; nothing left behind."""
    import shutil

    import gguf

    assert _quantize(capsys, hf_tiny, tmp_path / "q", "--sym")[0] == 0
    out = tmp_path / "m.gguf"
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(path)._replace(free=4096))
    refused = main(["export", str(tmp_path / "q"), "--to", "gguf", "-o", str(out)]), capsys.readouterr().err
    monkeypatch.setattr(shutil, "disk_usage", usage)

    def full(*args, **kwargs):
        raise OSError("4096 requested and 0 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full)
    failed = main(["export", str(tmp_path / "q"), "--to", "gguf", "-o", str(out)]), capsys.readouterr().err
    for (code, err), said in ((refused, "had 0.0 MB free"), (failed, "(the write said: 4096 requested and 0 written)")):
        *bars, last = err.replace("\r", "\n").strip().splitlines()
        assert code == 1 and f"{out} needs " in last and said in last, err
        assert all(line.startswith("export gguf: ") and ("100%|" in line or " 0%|" in line) for line in bars), err
        assert not out.exists() and [p.name for p in tmp_path.iterdir() if "m.gguf" in p.name] == []


def test_the_summary_method_names_the_residual_and_the_a8_layers():
    from types import SimpleNamespace

    from bitquilt.commands import method_summary
    from bitquilt.recipes import Recipe

    recipe = Recipe("quarot+rtn", w_bits=4, a_bits=4, a8_layers=2, residual="mosaic")
    report = SimpleNamespace(stages={"dynamic_a8": {"layers": [0, 7], "linears": 14}})
    assert method_summary(recipe, report) == "quarot+rtn+mosaic (a8 layers 0,7)"
    assert method_summary(Recipe("rtn", w_bits=4), SimpleNamespace(stages={})) == "rtn"


def test_a_refused_api_export_drops_its_claim(tmp_path):
    """`bitquilt.export` refused after it claimed its output (a family GGUF has no graph for) leaves nothing there."""
    import torch

    from bitquilt.api import export, quantize, save
    from bitquilt.errors import UserError

    model = make_tiny("qwen3")
    quantize(model, "rtn", torch.randint(0, 320, (1, 8)), progress=False, w_bits=4, group_size=32)
    save(model, tmp_path / "q")
    with pytest.raises(UserError, match="cannot export a 'qwen3' model to GGUF"):
        export(tmp_path / "q", tmp_path / "m.gguf")
    assert os.listdir(tmp_path) == ["q"]
