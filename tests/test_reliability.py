"""Bad input and faults: each is refused up front with one line, or handled without leaving a mess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from bitquilt import cache
from bitquilt.api import quantize, save
from bitquilt.cli import main
from bitquilt.commands import EXIT_NON_FINITE
from bitquilt.errors import UserError
from bitquilt.eval.ppl import default_seqlen, perplexity
from bitquilt.io import CONFIG_NAME, load_quantized
from bitquilt.nn.act_quant import ActQuantConfig, fake_quantize
from bitquilt.recipes import Recipe
from tests.conftest import make_tiny

LAYER = "model.layers.0.self_attn.q_proj"  # 128×128 in the tiny models
TEXT = " ".join(f"Sentence {i} says that the river flows past the old mill towards the sea." for i in range(60))


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if a command loads a model: the checks must come first."""
    import bitquilt.api

    monkeypatch.setattr(bitquilt.api, "load", lambda spec: pytest.fail("model loaded before the input was checked"))


def _one_line_error(code: int, err: str, message: str) -> None:
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


# ---------------------------------------------------------------- 1-3: numeric options, checked before loading
@pytest.mark.parametrize("args, message", [
    (["quantize", "--method", "gptq", "--damp", "-1"], "damp must be ≥ 0 (a fraction of the Hessian's mean diagonal; "
                                                      "typical 0.01-0.1"),
    (["quantize", "--method", "awq", "--damp", "0.1"], "--damp set an option that solver 'rtn' (the end of method "
                                                         "'awq') does not take"),
    (["quantize", "--method", "gptq", "--opt", "damp=-0.5"], "solver 'gptq': damp must be ≥ 0"),
    (["quantize", "--method", "bpdq", "--damp", "-1"], "solver 'bpdq': damp must be ≥ 0"),
    (["quantize", "--method", "mxsens", "--damp", "-1"], "solver 'mxint': damp must be ≥ 0"),
    (["quantize", "--method", "gptq", "--block-size", "0"], "solver 'gptq': block_size must be ≥ 1 (columns per lazy "
                                                            "update of the sweep; typical 128), got 0"),
    (["quantize", "--method", "bpdq", "--block-size", "-128"], "solver 'bpdq': block_size must be ≥ 1"),
    (["quantize", "--kv-bits", "1"], "supported: 2, 3, 4, 5, 6, 7, 8 or 16 (off)"),
    (["quantize", "--a-bits", "12"], "unsupported activation bits 12 (--a-bits"),
    (["quantize", "--method", "mxint", "--kv-bits", "3"], "MXINT activation bits 3 (--a-bits, or --kv-bits for the "
                                                          "KV cache); supported: 4, 6, 8 or 16 (off)"),
    (["quantize", "--calib-seqlen", "8"], "--calib-seqlen must be ≥ 16, got 8"),
    (["eval", "--seqlen", "1"], "--seqlen must be ≥ 2, got 1"),  # a window predicts from its second token
    (["eval", "--seqlen", "-5"], "--seqlen must be ≥ 2, got -5"),
    (["eval", "--ppl-windows", "0"], "--ppl-windows must be ≥ 1"),
    (["eval", "--tasks", "piqa", "--limit", "0"], "--limit must be ≥ 1"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature must be ≥ 0"),
    (["eval", "--tasks", ""], "--tasks is empty; give zero-shot tasks"),
    (["eval", "--tasks", ","], "--tasks is empty"),
    (["eval", "--ppl-data", ""], "--ppl-data is empty; give wiki, lambada or a .txt/.jsonl path"),
    (["eval", "--limit", "5"], "--limit samples zero-shot items; it needs --tasks"),
    (["compare", "--methods", ""], "--methods is empty; give one or more comma-separated methods"),
    (["compare", "--methods", "fp,rtn", "--target-bits", "4.5"], "--target-bits applies to methods with a bit budget"),
    (["quantize", "--method", "rtn", "--a-sym"], "--a-sym shapes a grid that is off; add --a-bits below 16"),
    (["quantize", "--method", "rtn", "--kv-group-size", "32"], "--kv-group-size shapes a grid that is off"),
    (["quantize", "--method", "awq+bogus"], "unknown method 'awq+bogus': a method is [stage+...+]solver"),
    (["quantize", "--method", "rtn", "--calib-data", "nosuch.txt"], "text file nosuch.txt does not exist"),
    (["eval", "--ppl-data", "wiki,nosuch.jsonl"], "text file nosuch.jsonl does not exist"),
    (["eval", "--ppl-data", "c4"], "unknown text source 'c4'; use one of"),
])
def test_bad_numbers_are_refused_before_loading(tmp_path, capsys, no_load, args, message):
    command, *rest = args
    output = ["-o", tmp_path / "q"] if command == "quantize" else []
    code, _, err = run(capsys, command, "smollm2-135m", *output, *rest)
    _one_line_error(code, err, message)
    assert list(tmp_path.iterdir()) == []


def test_damp_is_validated_in_the_api_too():
    with pytest.raises(ValueError, match="damp must be ≥ 0"):
        Recipe("gptq", options={"damp": -0.01})
    assert Recipe("gptq", options={"damp": 0.0}).options == {"damp": 0.0}  # 0 = no dampening (H = I in tests)


def test_kv_and_activation_bits_accepted_are_those_the_quantizer_supports(capsys):
    """The int grid quantizes at any of 2..8 bits (error shrinking with each bit), so all are accepted, and the help
    says so; MXINT has 4, 6 and 8 only."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    errors = [(fake_quantize(x, ActQuantConfig(b).validate()) - x).pow(2).mean().item() for b in range(2, 9)]
    assert all(e > 3 * e_next for e, e_next in zip(errors, errors[1:]))  # ~4× less error per bit
    assert Recipe("rtn", kv_bits=3, a_bits=5).kv_config().bits == 3
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "cache bits: 2 to 8, or 4, 6, 8 with --a-format mxint" in help_text
    with pytest.raises(ValueError, match="supported: 4, 6, 8 or 16"):
        Recipe("mxint", kv_bits=2)


def test_seqlen_above_the_model_maximum_is_cut_with_one_warning(caplog):
    model = make_tiny("llama")  # max_position_embeddings 512
    with caplog.at_level("WARNING"):
        assert default_seqlen(model, 100_003) == 512 and default_seqlen(model, 100_003) == 512
        assert default_seqlen(model, 512) == 512 and default_seqlen(model, None) == 512
    assert [r.getMessage() for r in caplog.records] == [
        "seqlen 100003 exceeds the model's 512 positions (max_position_embeddings); windows of 512 tokens are used "
        "instead"]
    assert default_seqlen(model, 0) == 0  # no longer turned into 2048: eval_windows refuses it


# ---------------------------------------------------------------- 4: a tampered saved model
@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """A tiny model saved with uniform (RTN W4 g64) and with MXINT4 weights."""
    root = tmp_path_factory.mktemp("saved")
    for method, group in (("rtn", 64), ("mxint", None)):
        model = make_tiny("llama")
        quantize(model, Recipe(method, w_bits=4, group_size=group), None, progress=False)
        save(model, root / method)
    return root


@pytest.mark.parametrize("method, field, value, found", [
    ("rtn", "bits", 3, "qweight has shape (128, 16), expected (128, 12) for 3 bits"),
    ("rtn", "group_size", 32, "scales has shape (128, 2), expected (128, 4)"),
    ("rtn", "group_size", 128, "scales has shape (128, 2), expected (128, 1)"),  # loaded, cutting scales, before
    ("rtn", "in_features", 96, "qweight has shape (128, 16), expected (128, 12) for 4 bits, group size 64, "
                               "in_features 96"),
    ("mxint", "widths", [8], "q0 has shape (128, 16), expected (128, 128) for MXINT classes [(8, 128)]"),
])
def test_tampered_layer_is_refused_on_load(saved_models, tmp_path, capsys, method, field, value, found):
    path = shutil.copytree(saved_models / method, tmp_path / "q")
    qconfig = json.loads((path / CONFIG_NAME).read_text())
    qconfig["layers"][LAYER]["meta"][field] = value
    (path / CONFIG_NAME).write_text(json.dumps(qconfig))
    with pytest.raises(UserError) as e:
        load_quantized(path)
    message = str(e.value)
    assert f"{path} is corrupt or was edited: layer {LAYER} should be a 128×128 weight, but " in message
    assert found in message and f'"{field}": {json.dumps(value)}'.replace('"', "'") in message
    code, _, err = run(capsys, "eval", path, "--seqlen", "64")
    _one_line_error(code, err, "is corrupt or was edited")


def test_untampered_models_load(saved_models):
    for method in ("rtn", "mxint"):
        load_quantized(saved_models / method)


def test_plain_transformers_refuses_a_saved_model_that_bitquilt_loads(saved_models, tmp_path):
    """config.json's model_type "bitquilt" makes transformers fail loudly instead of filling the packed linears with
    random weights; bitquilt restores the base config (saved before this, unchanged, still loads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = saved_models / "rtn"
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "bitquilt" and config["bitquilt"]["model_type"] == "llama"
    with pytest.raises(ValueError, match="has model type `bitquilt` but Transformers does not recognize"):
        AutoModelForCausalLM.from_pretrained(path)
    model, _ = load_quantized(path)
    assert model.config.to_dict() == make_tiny("llama").config.to_dict()
    old = shutil.copytree(path, tmp_path / "old")  # as saved before the guard: the base config.json unchanged
    (old / "config.json").write_text(json.dumps({**config.pop("bitquilt"), **config, "model_type": "llama"}))
    assert AutoConfig.from_pretrained(old).model_type == "llama"
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_quantized(old)[0](ids).logits, model(ids).logits)
    (old / "config.json").write_text(json.dumps({**config, "model_type": "bitquilt", "bitquilt": {"model_type": "x"}}))
    with pytest.raises(UserError, match="corrupt or was edited: its base model type 'x' is not one transformers knows"):
        load_quantized(old)


# ---------------------------------------------------------------- 5: unwritable outputs, checked before loading
@pytest.mark.parametrize("args, message", [
    (["quantize", "smollm2-135m", "-o", "{file}/out"], "{file} is a file, not a directory"),
    (["quantize", "smollm2-135m", "-o", "/sys/bitquilt-out"], "/sys is not writable"),
    (["quantize", "smollm2-135m", "-o", "{file}", "--overwrite"], "output {file} is a file, not a directory"),
    (["compare", "smollm2-135m", "--report", "{file}/report"], "{file} is a file, not a directory"),
    (["compare", "smollm2-135m", "--report", "{file}"], "output {file} is a file, not a directory"),
    (["analyze", "smollm2-135m", "--residual-stream", "--plot", "{file}/p.png"], "{file} is a file, not a directory"),
])
def test_unwritable_output_is_refused_before_loading(tmp_path, capsys, no_load, args, message):
    file = tmp_path / "somefile"
    file.write_text("not a directory")
    code, _, err = run(capsys, *(a.format(file=file) for a in args))
    _one_line_error(code, err, message.format(file=file))
    assert sorted(tmp_path.iterdir()) == [file] and file.read_text() == "not a directory"


# ---------------------------------------------------------------- 6: temporaries of a save killed with SIGKILL
KILLED_SAVE = """
import os, signal, sys
from pathlib import Path
from bitquilt.cache import atomic_dir
with atomic_dir(Path(sys.argv[1])) as tmp:
    (tmp / "model.safetensors").write_bytes(bytes(1 << 20))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_save_removes_what_a_killed_save_left(tmp_path):
    out = tmp_path / "q"
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(out)], cwd=Path(__file__).parents[1])
    assert proc.returncode == -9
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".q.tmp-")  # what `kill -9` mid-save leaves
    live = tmp_path / f".q.tmp-{os.getpid()}-0123abcd"  # a save in progress in a live process stays
    live.mkdir()
    model = make_tiny("llama")
    save(model, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "q"]


# ---------------------------------------------------------------- 7: NaN perplexity
def tiny_model_dir(path: Path, nan: bool = False):
    """A 1-layer llama (128 positions) with the default model's tokenizer saved at `path`, its logits all NaN if
    `nan`, and a small text file beside it: (path, tokenizer, text file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from bitquilt.models.registry import DEFAULT_MODEL, fetched_dir

    tokenizer = AutoTokenizer.from_pretrained(fetched_dir(DEFAULT_MODEL))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                         max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(config)
    if nan:
        with torch.no_grad():
            model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path.parent / "text.txt").write_text(TEXT)
    return path, tokenizer, path.parent / "text.txt"


@pytest.fixture
def nan_model(tmp_path):
    return tiny_model_dir(tmp_path / "nan_model", nan=True)


def _strict_json(text: str):
    def refuse(constant):
        raise AssertionError(f"invalid JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_nan_perplexity_gives_null_in_valid_json_and_a_nonzero_exit(nan_model, capsys):
    path, _, text = nan_model
    code, stdout, err = run(capsys, "eval", path, "--ppl-data", text, "--seqlen", "64", "--json")
    row = _strict_json(stdout)
    assert code == EXIT_NON_FINITE and row["ppl_text"] is None and row["non_finite"] == {"ppl_text": "nan"}
    errors = [line for line in err.splitlines() if "error" in line]  # (transformers' loading bar aside)
    assert len(errors) == 1 and "bitquilt eval: error: non-finite result(s) nan_model: ppl_text=nan" in errors[0]
    code, stdout, _ = run(capsys, "eval", path, "--ppl-data", text, "--seqlen", "64")
    assert code == EXIT_NON_FINITE and "nan" in stdout  # the table shows it as it is


def test_perplexity_overflow_and_bad_seqlen(nan_model):
    from bitquilt.eval.ppl import _exp

    assert _exp(1e4) == float("inf")
    _, tokenizer, text = nan_model
    with pytest.raises(UserError, match="seqlen must be a positive integer, got 0"):
        perplexity(make_tiny("llama"), tokenizer, str(text), seqlen=0)


# ---------------------------------------------------------------- 8: limits only the loaded model knows
def test_settings_beyond_the_model_are_refused_before_quantizing(tmp_path, capsys):
    path, _, text = tiny_model_dir(tmp_path / "tiny")
    out, calib = tmp_path / "q", ["--calib-data", text, "--calib-samples", "2", "--calib-seqlen", "32"]
    for args, message in [
        (["--method", "gptq", *calib, "--calib-seqlen", "256"],
         "--calib-seqlen 256 exceeds the model's 128 positions (max_position_embeddings); use at most 128"),
        (["--method", "rtn", "--a-bits", "4", "--a8-layers", "2", *calib],
         "a8_layers (--a8-layers) is 2, more than the model's 1 decoder layers; use at most 1"),
    ]:
        code, stdout, err = run(capsys, "quantize", path, "-o", out, *args)
        errors = [line for line in err.splitlines() if "error" in line]  # (transformers' loading bar aside)
        assert code == 2 and errors == [f"bitquilt quantize: error: {message}"] and "Traceback" not in err, err
        assert stdout == "" and not out.exists()


def test_a_kv_group_that_does_not_divide_head_dim_is_refused_before_calibration(tmp_path, capsys, monkeypatch):
    import bitquilt.api

    path, _, text = tiny_model_dir(tmp_path / "tiny")  # head_dim 16
    monkeypatch.setattr(bitquilt.api, "calibration_ids",
                        lambda *a: pytest.fail("calibration windows built before the KV groups were checked"))
    out = tmp_path / "q"
    code, stdout, err = run(capsys, "quantize", path, "-o", out, "--method", "rtn", "--kv-bits", "4",
                            "--kv-group-size", "6", "--calib-data", text, "--calib-seqlen", "32")
    errors = [line for line in err.splitlines() if "error" in line]  # (transformers' loading bar aside)
    assert code == 2 and stdout == "" and not out.exists() and errors == [
        "bitquilt quantize: error: --kv-group-size 6 (kv_group_size) does not divide the model's head_dim 16; use a "
        "divisor of it (1, 2, 4, 8, 16), or -1 or any size ≥ 16 for one group per head"]
    model = make_tiny("llama")  # the API checks too (head_dim 32), before any stage runs
    with pytest.raises(ValueError, match="--kv-group-size 12 .* head_dim 32"):
        quantize(model, Recipe("rtn", kv_bits=4, kv_group_size=12), torch.zeros(1, 16, dtype=torch.long),
                 progress=False)


def test_a_kv_group_as_wide_as_the_head_or_wider_is_one_group_per_head(capsys):
    from bitquilt.nn.kv_quant import KVQuantizer

    q, k, v = torch.randn(3, 1, 2, 8, 32, generator=torch.Generator().manual_seed(0))  # head_dim 32
    per_head = KVQuantizer(ActQuantConfig(4))(q, k, v)
    for size in (32, 128):
        assert all(torch.equal(a, b) for a, b in zip(KVQuantizer(ActQuantConfig(4, group_size=size))(q, k, v),
                                                     per_head))
    assert not torch.equal(KVQuantizer(ActQuantConfig(4, group_size=16))(q, k, v)[1], per_head[1])
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    assert "(default -1: the whole head; a size ≥ head_dim also means the whole head)" in " ".join(
        capsys.readouterr().out.split())


# ---------------------------------------------------------------- 9: concurrent fetches, download progress
def test_concurrent_fetches_of_one_model_run_once(tmp_path, monkeypatch, capsys, caplog):
    """The lock is in `bitquilt.api.fetch`: a CLI fetch and an API fetch of one model, at once, download it once."""
    import bitquilt.api
    from bitquilt.models import registry

    monkeypatch.setenv("BITQUILT_CACHE", str(tmp_path / "cache"))
    done, runs, paths = tmp_path / "fetched", [], []

    def fetch_model(name: str, force: bool = False) -> Path:  # like the real one: returns at once when cached
        if not done.exists():
            runs.append(name)
            time.sleep(0.5)
            done.write_text(name)
        return done

    monkeypatch.setattr(registry, "fetch_model", fetch_model)
    threads = [threading.Thread(target=lambda: paths.append(main(["fetch", "smollm2-135m"]))),
               threading.Thread(target=lambda: paths.append(bitquilt.api.fetch("smollm2-135m")))]
    with caplog.at_level("WARNING"):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(map(str, paths)) == sorted(["0", str(done)]) and runs == ["smollm2-135m"]
    assert capsys.readouterr().out.count(f"smollm2-135m: {done}") == 1
    assert any("another bitquilt process holds" in r.getMessage() for r in caplog.records)


def test_pip_download_shows_pips_progress_on_stderr(tmp_path, monkeypatch):
    seen = {}

    def pip(cmd, **kw):
        seen.update(cmd=cmd, **kw)
        (tmp_path / "x-1-py3-none-any.whl").write_bytes(b"wheel")
        return subprocess.CompletedProcess(cmd, 0, None, "")

    monkeypatch.setattr(subprocess, "run", pip)
    assert cache.pip_download("x==1", tmp_path).name == "x-1-py3-none-any.whl"
    assert seen["stdout"] == 2 and seen["stderr"] == subprocess.PIPE  # "Downloading … (size)" + bar; errors kept
    assert seen["cmd"][seen["cmd"].index("--progress-bar") + 1] == "on"


def test_a_saved_directory_without_its_quantization_config_is_refused_by_name(tmp_path):
    from bitquilt.api import load, quantize, save

    model = make_tiny("llama")
    quantize(model, "rtn", None, progress=False, w_bits=4, group_size=32)
    save(model, tmp_path / "q")
    (tmp_path / "q" / "quantization_config.json").unlink()
    with pytest.raises(UserError, match="saved by bitquilt but its quantization_config.json is missing"):
        load(tmp_path / "q")


def test_outputs_and_paths_are_checked_before_any_work(tmp_path, capsys, no_load, monkeypatch):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    code, _, err = run(capsys, "compare", "smollm2-135m", "--methods", "fp", "--report", notes)
    _one_line_error(code, err, "holds files but no report.json, so it is not a previous report")
    assert (notes / "todo.txt").read_text() == "keep me"
    code, _, err = run(capsys, "analyze", "smollm2-135m", "--residual-stream", "--plot", notes)
    _one_line_error(code, err, "is a directory; give a file path")
    code, _, err = run(capsys, "inspect", tmp_path / "nosuch")
    _one_line_error(code, err, "does not exist")
    monkeypatch.setenv("BITQUILT_CACHE", str(notes / "todo.txt"))
    code, _, err = run(capsys, "fetch", "smollm2-135m")
    _one_line_error(code, err, "cannot be created (File exists); set BITQUILT_CACHE to a writable directory")


def test_an_architecture_without_adapter_is_refused_before_its_weights_load(tmp_path, capsys, no_load):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    for command in (["quantize", tmp_path / "gpt2", "--method", "rtn", "-o", tmp_path / "q"],
                    ["quantize", tmp_path / "gpt2", "--method", "rtn", "--stream", "-o", tmp_path / "q"],
                    ["compare", tmp_path / "gpt2", "--methods", "fp,rtn"]):
        code, _, err = run(capsys, *command)
        _one_line_error(code, err, "unsupported architecture 'gpt2' in ")
        assert "supported model types: " in err and "llama" in err


def test_a_saved_model_is_not_quantized_again_and_its_files_are_checked(tmp_path, capsys):
    model = make_tiny("llama")
    quantize(model, Recipe("rtn", w_bits=4, group_size=64), None, progress=False)
    save(model, tmp_path / "q")
    code, _, err = run(capsys, "quantize", tmp_path / "q", "--method", "rtn", "-o", tmp_path / "again")
    _one_line_error(code, err, "is already quantized (a directory saved by `bitquilt quantize`)")
    code, _, err = run(capsys, "compare", tmp_path / "q", "--methods", "fp,rtn")
    _one_line_error(code, err, "is already quantized")
    (tmp_path / "q" / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}")  # a damaged weights file
    code, _, err = run(capsys, "inspect", tmp_path / "q")
    _one_line_error(code, err, "is missing or unreadable")


def test_a_damaged_resume_state_is_one_error_naming_the_file(tmp_path):
    from bitquilt.pipeline.resume import STATE, load_progress

    (tmp_path / STATE).write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match=f"resume file .*{STATE} cannot be read back .*delete .* to start again"):
        load_progress(tmp_path, "run")


def test_skip_globs_that_keep_everything_or_nothing_out(caplog):
    model = make_tiny("llama")
    with pytest.raises(ValueError, match="keeps every one of the .* linears in full precision: nothing to quantize"):
        quantize(model, Recipe("rtn", w_bits=4, group_size=64, skip=["*"]), None, progress=False)
    with caplog.at_level("WARNING"):
        quantize(model, Recipe("rtn", w_bits=4, group_size=64, skip=["layers.*.q_proj"]), None, progress=False)
    assert "--skip 'layers.*.q_proj' matches no linear (linears are named like model.layers.0." in caplog.text


def test_an_export_refuses_non_finite_weights(tmp_path):
    from bitquilt.api import export
    from bitquilt.nn.quant_linear import QuantLinear

    model = make_tiny("llama")
    quantize(model, Recipe("rtn", w_bits=4, group_size=64), None, progress=False)
    linear = next(m for m in model.modules() if isinstance(m, QuantLinear))
    linear.fmt.scales.view(-1)[0] = float("nan")
    save(model, tmp_path / "q")
    for to, out in (("gguf", tmp_path / "m.gguf"), ("compressed-tensors", tmp_path / "ct")):
        with pytest.raises(UserError, match="scales hold NaN or Inf .the checkpoint is damaged or was edited"):
            export(tmp_path / "q", out, to=to)
        assert not out.exists()
    with pytest.raises(UserError, match="is a file of the input .*which writing it would replace"):
        export(tmp_path / "q", tmp_path / "q" / "model.safetensors", to="gguf", overwrite=True)
    assert (tmp_path / "q" / "model.safetensors").stat().st_size > 1000


def test_evaluation_windows_need_two_tokens_and_overlapping_calibration_warns(tmp_path, caplog):
    from transformers import AutoTokenizer

    from bitquilt.data.windows import calibration_windows, eval_windows
    from bitquilt.models.registry import DEFAULT_MODEL, fetched_dir

    tokenizer = AutoTokenizer.from_pretrained(fetched_dir(DEFAULT_MODEL))
    text = tmp_path / "short.txt"
    text.write_text(TEXT)
    with pytest.raises(UserError, match="evaluation windows need at least 2 tokens"):
        eval_windows(tokenizer, text, 1)
    with caplog.at_level("WARNING"):
        windows = calibration_windows(tokenizer, text, 64, 64)
    assert windows.shape == (64, 64) and "the windows overlap" in caplog.text


def test_the_python_api_refuses_what_it_cannot_quantize_in_one_line(tmp_path):
    model = make_tiny("llama")  # vocabulary 320
    ids = torch.randint(0, 320, (4, 64))
    recipe = Recipe("gptq", group_size=32)
    for calib, message in [(ids.float(), "calibration ids must be integer token ids .n_samples, seqlen."),
                           (ids[0], "calibration ids must be integer token ids"),
                           (torch.empty(0, 64, dtype=torch.long), "both ≥ 1; got torch.int64 .0, 64."),
                           (ids + 1000, "outside the model's vocabulary of 320; build them with the model's own")]:
        with pytest.raises(UserError, match=message):
            quantize(model, recipe, calib, progress=False)
    with pytest.raises(UserError, match="quantize takes a loaded model .`bitquilt.load`., got str"):
        quantize("smollm2-135m", "rtn")
    with pytest.raises(UserError, match="recipe must be a Recipe or a method name, got int"):
        quantize(model, 5)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="resume_dir .* is a file"):
        quantize(model, recipe, ids, progress=False, resume_dir=tmp_path / "afile")
    quantize(model, Recipe("rtn", group_size=32), None, progress=False)
    with pytest.raises(UserError, match="the model is quantized already .model.layers.0.self_attn.q_proj"):
        quantize(model, Recipe("rtn", w_bits=2, group_size=32), None, progress=False)


@pytest.mark.parametrize("fields, message", [
    ({"w_bits": 4.0}, "w_bits=4.0 .an integer."), ({"w_bits": "4"}, "w_bits='4' .an integer."),
    ({"sym": "no"}, "sym='no' .True or False."), ({"skip": "model.layers.0.*"}, "skip='model.layers.0.\\*' .a list"),
    ({"options": [1]}, "options=.1. .a dict."), ({"overrides": ["x"]}, "overrides=.'x'. .a dict."),
    ({"method": None}, "method=None .a name such as"), ({"group_size": 0.5}, "group_size=0.5 .an integer or None."),
])
def test_a_recipe_field_of_the_wrong_kind_is_named(fields, message):
    with pytest.raises(ValueError, match=f"^Recipe: {message}"):
        Recipe(**{"method": "rtn", **fields})


def test_the_python_api_names_a_missing_tokenizer_a_wrong_prompt_or_model_spec():
    from bitquilt.api import load
    from bitquilt.runtime.engines import decode

    model = make_tiny("llama")
    with pytest.raises(UserError, match="perplexity needs the model's tokenizer object"):
        perplexity(model, None, "wiki")
    with pytest.raises(ValueError, match="decode needs token ids as an integer tensor .1, T., got list"):
        decode(model, [1, 2, 3], 2)
    with pytest.raises(ValueError, match="got Tensor of torch.float32"):
        decode(model, torch.ones(1, 3), 2)
    with pytest.raises(UserError, match="a model is named by a string or a path, got NoneType"):
        load(None)


def test_wrong_kinds_of_calibration_and_evaluation_settings_are_named():
    from bitquilt.recipes import CalibConfig

    with pytest.raises(ValueError, match="^CalibConfig: seqlen='32' .an integer. expected"):
        CalibConfig(seqlen="32")
    with pytest.raises(ValueError, match="^CalibConfig: source=None .a text set name or a path. expected"):
        CalibConfig(source=None)
    with pytest.raises(ValueError, match="^Recipe: a_clip='x' .a number or None. expected"):
        Recipe("rtn", a_clip="x")
    with pytest.raises(UserError, match="seqlen must be an integer number of tokens, got '64'"):
        default_seqlen(make_tiny("llama"), "64")
