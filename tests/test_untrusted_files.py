"""Crafted and damaged files: every reader of a safetensors header (the loaders, streaming, bitquilt-run and
bitquilt-native) refuses what does not hold together with one line and exit code 2, never a crash, a traceback or a
silently wrong result; a model whose weights hold NaN generates no text but says why (issue 65)."""

from __future__ import annotations

import json
import random
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny, save_tiny_with_tokenizer

from bitquilt.cli import main
from bitquilt.errors import UserError
from bitquilt.io import load
from bitquilt.runtime.standalone.library import runner_path
from bitquilt.runtime.standalone.model import FILE, METADATA_KEY
from bitquilt.tensor_header import read_header

BIG = 2**62


def _header(path: Path) -> tuple[dict, int]:
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]), length


def _write_header(path: Path, text: bytes) -> None:
    """Replace the JSON header of the safetensors file at `path` by `text`, padded with spaces to the old length or,
    if longer, to a multiple of 8 (the tensors' bytes follow unchanged)."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    size = length if len(text) <= length else len(text) + (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", size) + text.ljust(size) + data[8 + length:])


def _edit(path: Path, edit) -> None:
    header, _ = _header(path)
    edit(header)
    _write_header(path, json.dumps(header, separators=(",", ":")).encode())


def _metadata(header: dict) -> dict:
    return json.loads(header["__metadata__"][METADATA_KEY])


def _set_metadata(header: dict, **changes) -> None:
    meta = {**_metadata(header), **changes}
    header["__metadata__"][METADATA_KEY] = json.dumps(meta, separators=(",", ":"))


def _set_linear(header: dict, name: str, **changes) -> None:
    meta = _metadata(header)
    meta["linears"][name].update(changes)
    header["__metadata__"][METADATA_KEY] = json.dumps(meta, separators=(",", ":"))


def _run(command: str, export: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`command` (bitquilt-native, bitquilt-run, or the path of a runner built otherwise) on `export`."""
    argv = {"bitquilt-native": [str(runner_path())],
            "bitquilt-run": [sys.executable, "-m", "bitquilt.runtime.standalone.cli"]}.get(command, [command])
    return subprocess.run([*argv, str(export), "--prompt", "Hello 42 world", "--max-new-tokens", "2", "--threads",
                           "1", *args], capture_output=True, text=True, errors="replace", timeout=300, env=env)


def _one_line(done: subprocess.CompletedProcess, message: str = "") -> None:
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert re.search(message, done.stderr), done.stderr


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> Path:
    """A tiny llama with the default model's tokenizer, RTN W4 with an 8-bit head, exported to the standalone runtime
    with tokenizer tables (both runners read it)."""
    root = tmp_path_factory.mktemp("untrusted")
    save_tiny_with_tokenizer(root / "fp")
    assert main(["quantize", str(root / "fp"), "--method", "rtn", "--group-size", "64", "--head-bits", "8",
                 "-o", str(root / "saved"), "--json"]) == 0
    assert main(["export", str(root / "saved"), "-o", str(root / "out"), "--to", "standalone", "--json"]) == 0
    return root


@pytest.fixture
def export_copy(tiny_export, tmp_path) -> Path:
    shutil.copytree(tiny_export / "out", tmp_path / "out")
    return tmp_path / "out"


def _share_bytes(header: dict) -> None:
    """Give the second of two tensors of one dtype and shape the first one's bytes."""
    first, second = _same_shape_tensors(header)
    header[second]["data_offsets"] = header[first]["data_offsets"]


def _same_shape_tensors(header: dict) -> tuple[str, str]:
    """Two tensors of the header with the same dtype and shape."""
    seen: dict[tuple, str] = {}
    for name, info in header.items():
        if name != "__metadata__":
            key = (info["dtype"], tuple(info["shape"]))
            if key in seen and info["data_offsets"][0] != info["data_offsets"][1]:
                return seen[key], name
            seen[key] = name
    raise AssertionError("no two tensors of one shape")


CRAFTED = {
    "a [2^62, 2] letters table with its old offsets": (
        lambda h: h["tokenizer.letters"].update(shape=[BIG, 2]), "does not fit its offsets|dimension"),
    "a [2^62, 2] numbers table with its old offsets": (
        lambda h: h["tokenizer.numbers"].update(shape=[BIG, 2]), "does not fit its offsets|dimension"),
    "a negative dimension": (lambda h: h["model.norm.weight"].update(shape=[-4]), "dimension|shape"),
    "a fractional dimension": (lambda h: h["model.norm.weight"].update(shape=[2.5]), "dimension|shape"),
    "offsets past the end": (lambda h: h["model.norm.weight"].update(data_offsets=[2**40, 2**40 + 512]),
                             "past the end"),
    "two tensors on the same bytes": (_share_bytes, "overlaps|gap"),
    "a vocabulary of 2^62": (lambda h: _set_metadata(h, vocab_size=BIG), "vocab_size|not its embedding"),
    "an LM head of 2^62 rows": (lambda h: _set_linear(h, "lm_head", out=BIG), "lm_head.out"),
    "a metadata value that is not a string": (
        lambda h: h["__metadata__"].update({METADATA_KEY: _metadata(h)}), "not an object of strings|metadata"),
}


@pytest.mark.parametrize("command", ["bitquilt-native", "bitquilt-run"])
@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_standalone_header_is_one_line_for_both_runners(export_copy, command, case):
    edit, message = CRAFTED[case]
    _edit(export_copy / FILE, edit)
    if command == "bitquilt-native" and case == "a vocabulary of 2^62":
        message = ""  # the native runner sizes its logits by the embedding's rows, not by this field: it may run
        done = _run(command, export_copy)
        assert done.returncode in (0, 2) and "Traceback" not in done.stderr, done.stderr
        return
    _one_line(_run(command, export_copy), message)


@pytest.mark.parametrize("command", ["bitquilt-native", "bitquilt-run"])
@pytest.mark.parametrize("text, message", [
    (b"[" * 100_000 + b"]" * 100_000, "nest|deeper"),
    (b'{"a": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}}', "dimension|shape"),
    (b'{"a": {"dtype": "I64", "shape": [1], "data_offsets": [4, 12]}}', "aligned|gap|multiple"),
])
def test_deep_headers_huge_numbers_and_misaligned_tensors_are_one_line(export_copy, command, text, message):
    path = export_copy / FILE
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(16))
    _one_line(_run(command, export_copy), message)


def test_the_python_readers_refuse_what_safetensors_refuses(tmp_path):
    """`read_header` (every Python reader) on hand-made files: overlap, gap, trailing bytes, bool and float dims."""
    def file(header: dict, data: bytes) -> Path:
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.safetensors"
        path.write_bytes(struct.pack("<Q", len(text)) + text + data)
        return path

    good = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}
    assert read_header(file(good, bytes(16))).entries["b"].nbytes == 8
    cases = [({**good, "b": {**good["b"], "data_offsets": [4, 12]}}, bytes(16), "overlaps"),
             ({**good, "b": {**good["b"], "data_offsets": [12, 20]}}, bytes(20), "gap"),
             (good, bytes(17), "truncated or corrupted"),
             (good, bytes(12), "past the end of the file"),
             ({**good, "a": {**good["a"], "shape": [True, 2]}}, bytes(16), "non-negative integers"),
             ({**good, "a": {**good["a"], "shape": [2.0]}}, bytes(16), "non-negative integers"),
             ({**good, "a": {**good["a"], "shape": [BIG, 4]}}, bytes(16), "does not fit its offsets"),
             ({**good, "__metadata__": {"k": 1}}, bytes(16), "not an object of strings")]
    for header, data, message in cases:
        with pytest.raises(UserError, match=message):
            read_header(file(header, data))
    deep = tmp_path / "deep.safetensors"
    deep.write_bytes(struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(UserError, match="nests too deeply"):
        read_header(deep)


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    model = make_tiny("llama")
    from bitquilt.api import quantize, save
    from bitquilt.recipes import Recipe

    quantize(model, Recipe("rtn", w_bits=4, group_size=32), progress=False)
    save(model, root / "q")
    return root / "q"


def test_a_saved_model_with_overlapping_tensors_is_refused_not_evaluated(saved_tiny, tmp_path):
    """Two tensors sharing bytes evaluated silently with a wrong perplexity before; safetensors refuses such a file."""
    shutil.copytree(saved_tiny, tmp_path / "q")
    path = tmp_path / "q" / "model.safetensors"
    _edit(path, _share_bytes)
    with pytest.raises(UserError, match="model.safetensors: tensor .* overlaps"):
        load(tmp_path / "q")


@pytest.mark.parametrize("edit, message", [
    (lambda h: h["model.norm.weight"].update(shape=[64]), "model.safetensors: tensor 'model.norm.weight' does not fit"),
    (lambda h: h["model.norm.weight"].update(data_offsets=[BIG, BIG + 512]),
     "model.safetensors is truncated or corrupt: tensor 'model.norm.weight' ends at byte"),
])
def test_generate_on_a_header_that_disagrees_with_itself_is_one_line(saved_tiny, tmp_path, capsys, edit, message):
    shutil.copytree(saved_tiny, tmp_path / "q")
    _edit(tmp_path / "q" / "model.safetensors", edit)
    assert main(["generate", str(tmp_path / "q"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def _poison(path: Path, name: str) -> None:
    """Write NaN over the first element of the fp32 or fp16 tensor `name` of the safetensors file at `path`."""
    header, length = _header(path)
    begin = 8 + length + header[name]["data_offsets"][0]
    data = bytearray(path.read_bytes())
    nan = struct.pack({"F32": "<f", "F16": "<e"}[header[name]["dtype"]], float("nan"))
    data[begin:begin + len(nan)] = nan
    path.write_bytes(bytes(data))


def test_generate_with_a_nan_weight_says_so_instead_of_printing_nothing(tmp_path, capsys):
    """An HF folder with a NaN weight, and a saved model with a NaN scale: exit 2, one line, no completion."""
    save_tiny_with_tokenizer(tmp_path / "fp")
    _poison(tmp_path / "fp" / "model.safetensors", "model.norm.weight")
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "fp"), "--prompt", "Hello", "--max-new-tokens", "4"]) == 2
    out, err = capsys.readouterr()  # transformers' own loading bar comes first
    assert out == "" and "Traceback" not in err and "NaN or infinite" in err.strip().splitlines()[-1], err
    save_tiny_with_tokenizer(tmp_path / "fp2")
    assert main(["quantize", str(tmp_path / "fp2"), "--method", "rtn", "--group-size", "32", "-o",
                 str(tmp_path / "q"), "--json"]) == 0
    capsys.readouterr()
    header, _ = _header(tmp_path / "q" / "model.safetensors")
    scales = next(n for n in header if n.endswith("q_proj.packed_scales"))
    _poison(tmp_path / "q" / "model.safetensors", scales)
    for engine in ("auto", "lean", "transformers"):
        assert main(["generate", str(tmp_path / "q"), "--prompt", "Hello", "--engine", engine]) == 2, engine
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "NaN or infinite" in err, (engine, err)


@pytest.mark.parametrize("command", ["bitquilt-native", "bitquilt-run"])
def test_the_runners_refuse_nan_logits_in_one_line(export_copy, command):
    _poison(export_copy / FILE, "model.norm.weight")
    done = _run(command, export_copy)
    _one_line(done, "NaN or infinite")
    assert done.stdout == ""


# ---------------------------------------------------------------- fuzzing
NUMBERS = [b"-1", b"0", b"1", b"2147483648", b"4611686018427387904", b"9223372036854775808", b"18446744073709551616",
           b"1e999", b"-1e999", b"0.5", b"true", b"null", b'"x"', b"[]", b"{}"]


def _mutations(header: bytes, seeds: range) -> list[bytes]:
    """Headers like `header`, each with a few bits flipped or one number replaced, no longer than it."""
    numbers = [m.span() for m in re.finditer(rb"-?\d+(\.\d+)?([eE][-+]?\d+)?", header)]
    out = []
    for seed in seeds:
        draw = random.Random(seed)
        text = bytearray(header)
        if seed % 2:
            for _ in range(draw.randint(1, 4)):
                i = draw.randrange(len(text))
                text[i] ^= 1 << draw.randrange(8)
        else:
            begin, end = draw.choice(numbers)
            text[begin:end] = draw.choice(NUMBERS)
        out.append(bytes(text[:len(header)]))
    return out


def _fuzz(path: Path, seeds: range, check) -> None:
    """`check(seed)` on `path` with each mutated header in place (the tensors' bytes unchanged), then the original."""
    original = path.read_bytes()
    length = int.from_bytes(original[:8], "little")
    try:
        for seed, text in zip(seeds, _mutations(original[8:8 + length], seeds)):
            _write_header(path, text)
            check(seed)
    finally:
        path.write_bytes(original)


def test_fuzzed_standalone_headers_never_crash_either_runner(export_copy):
    """A few hundred mutated headers through bitquilt-native (a process per case) and the C library behind
    bitquilt-run (in this process, as bitquilt-run uses it): each runs or is refused in one line."""
    from bitquilt.runtime.standalone.model import StandaloneModel

    def native(seed: int) -> None:
        done = _run("bitquilt-native", export_copy)
        assert done.returncode in (0, 2) and done.stderr.count("\n") <= 1, (seed, done.returncode, done.stderr[-500:])

    def library(seed: int) -> None:
        try:
            model = StandaloneModel(export_copy)
            model.begin(8)
            model.forward([1, 2, 3])
        except UserError as e:
            assert "\n" not in str(e), (seed, str(e))

    _fuzz(export_copy / FILE, range(120), native)
    _fuzz(export_copy / FILE, range(120, 420), library)


def test_fuzzed_saved_model_headers_load_or_are_refused_in_one_line(saved_tiny, tmp_path):
    shutil.copytree(saved_tiny, tmp_path / "q")
    ids = torch.tensor([[1, 2, 3]])

    def check(seed: int) -> None:
        try:
            model, _ = load(tmp_path / "q", runtime="bitquilt")
            with torch.no_grad():
                model(ids)
        except UserError as e:
            assert "\n" not in str(e), (seed, str(e))

    _fuzz(tmp_path / "q" / "model.safetensors", range(200), check)


SANITIZERS = "-fsanitize=address,undefined"


def _sanitizers_missing(work: Path) -> str | None:
    """Why this machine's compiler cannot build and run a sanitized program, or None."""
    import os

    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler})"
    (work / "probe.cpp").write_text("int main() { return 0; }\n")
    built = subprocess.run([compiler, SANITIZERS, str(work / "probe.cpp"), "-o", str(work / "probe")],
                           capture_output=True, text=True)
    if built.returncode or subprocess.run([str(work / "probe")], capture_output=True).returncode:
        return f"{compiler} cannot build or run a program with {SANITIZERS}: {built.stderr.strip()[-300:]}"
    return None


@pytest.mark.slow
def test_the_fuzz_corpus_under_address_and_undefined_behaviour_sanitizers(export_copy, tmp_path):
    """The native runner built with ASan and UBSan (every report fatal) over the crafted cases, the fuzz corpus and
    a prompt long enough to cross the prefill's blocks: no report, every case run or refused in one line, the long
    prompt's tokens those of the runner as built."""
    import dataclasses
    import os

    from bitquilt import native_build

    if (why := _sanitizers_missing(tmp_path)) is not None:
        pytest.skip(why)
    sanitized = dataclasses.replace(native_build.RUNNER, flags=(
        *native_build.RUNNER.flags, "-g", "-fno-omit-frame-pointer", SANITIZERS,
        "-fno-sanitize-recover=all"), links=((),))
    runner = str(native_build.build(sanitized, out=tmp_path / "asan"))
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}

    def check(case: int | str, *args: str) -> subprocess.CompletedProcess:
        done = _run(runner, export_copy, *args, env=env)
        assert done.returncode in (0, 2) and "runtime error" not in done.stderr \
            and "Sanitizer" not in done.stderr, (case, done.returncode, done.stderr[-3000:])
        return done

    long_prompt = ("--prompt", "Hello 42 world " * 80, "--json")  # ~400 tokens: prompt passes and attention blocks
    reference = json.loads(_run("bitquilt-native", export_copy, *long_prompt).stdout)
    assert reference["prompt_tokens"] > 300
    assert json.loads(check("a long prompt", *long_prompt).stdout)["completion"] == reference["completion"]
    original = (export_copy / FILE).read_bytes()
    for case, (edit, _) in CRAFTED.items():
        _edit(export_copy / FILE, edit)
        check(case)
        (export_copy / FILE).write_bytes(original)
    _fuzz(export_copy / FILE, range(300), check)
