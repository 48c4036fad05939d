"""The C++ build (bitquilt.native_build): one target list that covers csrc/, products refused in one line when they
are missing or older than their sources, and nothing compiled at run time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bitquilt import native_build
from bitquilt.native_build import CSRC, LIBRARY, TARGETS, TORCH_EXTENSION

RUNTIMES = ("bitquilt.runtime.standalone.program", "bitquilt.runtime.standalone.cli")  # bitquilt-native, bitquilt-run
PROMPT = ["--prompt", "The capital of France is", "--max-new-tokens", "4", "--threads", "1", "--json"]


def test_the_targets_cover_every_file_in_csrc():
    covered = set().union(*(native_build.files(t) for t in TARGETS))
    present = {p.relative_to(CSRC).as_posix() for p in CSRC.rglob("*") if p.is_file()}
    assert sorted(present - covered) == []  # no orphan: a file no target compiles or includes
    assert covered <= present


def test_the_hash_follows_the_included_headers_and_the_flags(tmp_path):
    root = shutil.copytree(CSRC, tmp_path / "csrc")
    header = root / "text" / "json_value.h"  # reached only through runtime/standalone_file.h
    header.write_text(header.read_text() + "\n")
    assert native_build.source_hash(LIBRARY, root) != native_build.source_hash(LIBRARY)
    assert native_build.source_hash(TORCH_EXTENSION, root) == native_build.source_hash(TORCH_EXTENSION)
    assert native_build.source_hash(replace(LIBRARY, flags=("-O2",))) != native_build.source_hash(LIBRARY)


def _package_copy(tmp_path: Path, products: bool = True) -> dict[str, str]:
    """The checkout's package and csrc/ copied under tmp_path (its built products too, if `products`); the
    environment of a Python that imports that copy (run in tmp_path: `python -m` puts the working directory first)."""
    skip = shutil.ignore_patterns("__pycache__", "_native")
    shutil.copytree(native_build.PACKAGE, tmp_path / "bitquilt", ignore=skip)
    shutil.copytree(CSRC, tmp_path / "csrc")
    if products:
        shutil.copytree(native_build.OUT, tmp_path / "bitquilt" / "_native")
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def _refusal(env: dict[str, str], module: str, export: Path) -> str:
    """stderr of a runtime that must refuse to run, checked to be one line and exit 2."""
    done = subprocess.run([sys.executable, "-m", module, str(export), *PROMPT], env=env, cwd=env["PYTHONPATH"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, (module, done.stderr)
    return done.stderr


def test_a_binary_older_than_its_sources_is_refused_in_one_line(exported_smollm, tmp_path):
    env = _package_copy(tmp_path)
    header = tmp_path / "csrc" / "kernels" / "q4_int8.h"  # in all three targets
    header.write_text(header.read_text() + "\n")
    for module in RUNTIMES:
        message = _refusal(env, module, exported_smollm / "out")
        assert "is older than its sources" in message and "`make kernels` rebuilds it" in message
    kernels = "from bitquilt.kernels import cpu; print(cpu.extension())"  # one warning, the torch reference path
    done = subprocess.run([sys.executable, "-c", kernels], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.stdout == "None\n" and done.stderr.count("\n") == 1, done.stderr
    assert "is older than its sources" in done.stderr and "torch reference path" in done.stderr


def test_a_binary_that_was_not_built_is_refused_in_one_line(exported_smollm, tmp_path):
    env = _package_copy(tmp_path, products=False)
    for module in RUNTIMES:
        assert "is not built" in _refusal(env, module, exported_smollm / "out")


def test_the_runtimes_compile_nothing_they_run_with_no_compiler_on_path(exported_smollm, tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no g++, no c++, no ld
    env.pop("CXX", None)
    assert shutil.which("g++", path=env["PATH"]) is None
    for module in RUNTIMES:
        done = subprocess.run([sys.executable, "-m", module, str(exported_smollm / "out"), *PROMPT], env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["new_tokens"] == 4


@pytest.mark.parametrize("argv", [["--bogus"], ["--help"]])
def test_the_builders_command_refuses_arguments_in_one_line(argv):
    done = subprocess.run([sys.executable, "-m", "bitquilt.native_build", *argv], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "takes no arguments" in done.stderr
