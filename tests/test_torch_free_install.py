"""A deployment install: the checkout's sources (no built products) pip-installed, not editable, with the base
dependencies only into a fresh venv. The install builds the standalone runtime's C++ once and pulls no torch; there
bitquilt-run and bitquilt-native, with no compiler on PATH, give the text the torch runtime gives for the saved model
the export was made from, and `bitquilt` answers in one line which extra it needs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bitquilt import native_build
from bitquilt.cli import main

CHECKOUT = native_build.CSRC.parent
PROMPT = ["--prompt", "The capital of France is", "--max-new-tokens", "8", "--threads", "1", "--json"]


def _sources(dest: Path) -> Path:
    """What `pip install .` reads from a fresh clone: the project files, the package without products, csrc/."""
    dest.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(CHECKOUT / name, dest / name)
    shutil.copytree(native_build.PACKAGE, dest / "bitquilt", ignore=shutil.ignore_patterns("__pycache__", "_native"))
    shutil.copytree(native_build.CSRC, dest / "csrc")
    return dest


def test_a_venv_without_torch_runs_a_standalone_export(exported_smollm, tmp_path, capsys):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CXX")}  # the venv's own bitquilt
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    _sources(tmp_path / "src")], env=env, check=True, timeout=600)
    run = {**env, "PATH": str(venv / "bin")}  # no compiler: nothing may compile from here on

    def venv_run(*command: str) -> subprocess.CompletedProcess:
        return subprocess.run([venv / "bin" / command[0], *command[1:]], env=run, cwd=tmp_path, capture_output=True,
                              text=True)

    no_torch = venv_run("python", "-c", "import torch")
    assert no_torch.returncode == 1 and "No module named 'torch'" in no_torch.stderr
    package = Path(venv_run("python", "-c", "import bitquilt; print(bitquilt.__file__)").stdout.strip()).parent
    assert package.is_relative_to(venv) and not (package / "csrc").exists() and not (package.parent / "csrc").exists()
    assert sorted(p.name for p in (package / "_native").iterdir()) == [
        "bitquilt-native", "bitquilt-native.hash", "libbitquilt_standalone.so", "libbitquilt_standalone.so.hash"]

    assert main(["generate", str(exported_smollm / "saved"), "--int8-activations", *PROMPT]) == 0  # the torch side
    expected = json.loads(capsys.readouterr().out)["completion"]
    for command in ("bitquilt-run", "bitquilt-native"):
        done = venv_run(command, str(exported_smollm / "out"), *PROMPT)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["completion"] == expected, command
    done = venv_run("bitquilt", "quantize", "smollm2-135m")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "pip install 'bitquilt[full]'" in done.stderr
