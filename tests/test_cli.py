"""The command line end to end on the default model, and every kind of bad input."""

import json
import subprocess
import sys

import pytest
import torch

from bitquilt.cli import build_parser, main
from bitquilt.io import CONFIG_NAME
from bitquilt.recipes import Recipe
from bitquilt.solvers import get_solver


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_quantize_eval_inspect_end_to_end(tmp_path, capsys):
    out = tmp_path / "q4"
    code, stdout, _ = run(capsys, "quantize", "smollm2-135m", "--method", "gptq", "--w-bits", "4",
                          "--group-size", "128", "--calib-samples", "4", "--calib-seqlen", "128",
                          "--skip", "model.layers.[1-9].*", "--skip", "model.layers.[12]?.*", "--no-act-order",
                          "--no-mse", "-o", out, "--json")
    assert code == 0, stdout
    summary = json.loads(stdout)
    assert summary["method"] == "gptq" and summary["size_mb"] > 0
    options = json.loads((out / CONFIG_NAME).read_text())["recipe"]["options"]
    assert options["act_order"] is False and options["mse"] is False  # the flags reach the saved recipe
    assert options["static_groups"] is True  # and every other option is spelled out
    code, stdout, _ = run(capsys, "eval", out, "--ppl", "--seqlen", "128", "--ppl-windows", "2", "--json")
    assert code == 0
    result = json.loads(stdout)
    assert 5 < result["ppl_wiki"] < 100 and result["ppl_settings"]["wiki"]["n_windows"] == 2
    assert result["eval_precision"] == "fp32"
    code, stdout, _ = run(capsys, "eval", out, "--ppl", "--seqlen", "128", "--ppl-windows", "2", "--json",
                          "--eval-dtype", "bf16")
    bf16 = json.loads(stdout)
    assert code == 0 and bf16["eval_precision"] == "bf16" and bf16["ppl_settings"]["wiki"]["precision"] == "bf16"
    assert bf16["ppl_wiki"] != result["ppl_wiki"] and abs(bf16["ppl_wiki"] / result["ppl_wiki"] - 1) < 0.01
    code, _, err = run(capsys, "eval", out, "--ppl", "--ppl-data", "coqa", "--seqlen", "128", "--ppl-windows", "2")
    assert code == 2 and "calibration text 'coqa'" in err  # its own (default) calibration text: refused
    code, stdout, _ = run(capsys, "inspect", out, "--json")
    info = json.loads(stdout)
    assert info["summary"]["layers"] == 7 and info["summary"]["calibration"]["n_samples"] == 4
    # 4 bits + fp16 scale and uint8 zero per group; width 576 has 5 groups (the last one ragged)
    expected = {4 + 24 * 5 / 576, 4 + 24 * 12 / 1536}
    assert {round(r["bits_per_weight"], 6) for r in info["layers"]} == {round(b, 6) for b in expected}


def test_compare_prints_a_table(capsys):
    code, stdout, _ = run(capsys, "compare", "smollm2-135m", "--methods", "fp,rtn", "--w-bits", "4,2",
                          "--group-size", "64", "--seqlen", "128", "--ppl-windows", "2")
    assert code == 0
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + 3 and "ppl_wiki" in lines[0]


def test_compare_refuses_to_evaluate_on_the_calibration_text(capsys):
    code, stdout, err = run(capsys, "compare", "smollm2-135m", "--methods", "fp,gptq", "--w-bits", "4",
                            "--calib-data", "wiki", "--ppl-data", "lambada,wiki")
    assert code == 2 and "'wiki' shares" in err and stdout == ""


def test_compare_takes_recipes_and_validates_them_first(capsys):
    code, stdout, err = run(capsys, "compare", "smollm2-135m", "--recipes", "rtn,quarot+gptx", "--w-bits", "4",
                            "--a-bits", "4", "--kv-bits", "4")
    assert code == 2 and "unknown method 'quarot+gptx': a method is [stage+...+]solver" in err and stdout == ""


def test_models_lists_the_default(capsys):
    code, stdout, _ = run(capsys, "models", "--json")
    rows = json.loads(stdout)
    assert code == 0 and any(r["name"] == "smollm2-135m" and r["fetched"] for r in rows)


def test_default_recipe_is_damped_gptq_at_every_measured_width():
    """Without --method, `quantize` runs GPTQ with 10x the usual dampening (docs/accuracy.md: it beat RTN and AWQ at
    W4g128, W3g128 and W2g64 on qwen2.5-1.5b); flags override it; the Recipe class default stays awq+gptq."""
    from bitquilt.commands import _recipe_from_args

    for bits, group in ((4, 128), (3, 128), (2, 64)):
        args = build_parser().parse_args(["quantize", "smollm2-135m", "-o", "out/q", "--w-bits", str(bits)])
        best = _recipe_from_args(args, args.method, args.w_bits, args.group_size, args.target_bits)
        assert args.method is None and best == Recipe.best(bits) and best.group_size == group
        assert (best.method, best.options, best.recon_steps, best.stage_options) == ("gptq", {"damp": 0.1}, 0, {})
    args = build_parser().parse_args(["quantize", "m", "-o", "q", "--w-bits", "3", "--recon-steps", "20",
                                      "--group-size", "64"])
    tuned = _recipe_from_args(args, args.method, args.w_bits, args.group_size, args.target_bits)
    assert (tuned.method, tuned.options, tuned.recon_steps, tuned.group_size) == ("gptq", {"damp": 0.1}, 20, 64)
    args = build_parser().parse_args(["quantize", "m", "-o", "q", "--w-bits", "8"])
    assert _recipe_from_args(args, args.method, 8, None).method == Recipe().method  # no measurement at 8 bits
    for extra, damp in (([], 0.1), (["--damp", "0.02"], 0.02)):  # a GGUF mix: damped GPTQ onto llama.cpp's blocks
        args = build_parser().parse_args(["quantize", "m", "-o", "q", "--gguf-type", "Q3_K_M", *extra])
        gguf = _recipe_from_args(args, args.method, args.w_bits, args.group_size)
        assert (gguf.method, gguf.options, gguf.w_bits, gguf.gguf_type) == ("gguf_gptq", {"damp": damp}, 3, "Q3_K_M")
        assert gguf == Recipe.best(3, gguf_type="Q3_K_M", options={"damp": damp})  # the same default in Python
    recipe = Recipe()
    assert recipe.method == "awq+gptq" and recipe.transforms == ["awq"] and recipe.solver == "gptq"
    options = get_solver(recipe.solver).make_options(recipe.options)
    assert options.act_order and options.static_groups and options.mse


def test_default_recipe_solver_options_merge_with_the_flags(monkeypatch):
    """A default recipe's solver options stay unless a flag sets the same option (as its stage options do)."""
    from bitquilt import recipes
    from bitquilt.commands import _recipe_from_args

    monkeypatch.setitem(recipes.BEST_RECIPES, 4, {"method": "gptq", "group_size": 128, "options": {"damp": 0.1}})
    args = build_parser().parse_args(["quantize", "m", "-o", "q", "--no-act-order"])
    recipe = _recipe_from_args(args, args.method, 4, None)
    assert recipe.method == "gptq" and recipe.options == {"damp": 0.1, "act_order": False}
    args = build_parser().parse_args(["quantize", "m", "-o", "q", "--damp", "0.02"])
    assert _recipe_from_args(args, args.method, 4, None).options == {"damp": 0.02}


def test_help_names_the_default_recipe_as_flags_that_reproduce_it(capsys):
    """`quantize --help` spells each width's default as flags (recipes.as_flags); given explicitly, those flags build
    the same recipe as the default."""
    from bitquilt.commands import _recipe_from_args
    from bitquilt.recipes import BEST_RECIPES, RECON_RECIPE, as_flags

    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    help_text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, inside flags too
    parser = build_parser()

    def from_flags(bits: int, flags: str) -> Recipe:
        method, *rest = flags.split()
        args = parser.parse_args(["quantize", "m", "-o", "q", "--w-bits", str(bits), "--method", method, *rest])
        return _recipe_from_args(args, args.method, args.w_bits, args.group_size)

    for bits, entry in BEST_RECIPES.items():
        assert "".join(f"{bits} bits: {as_flags(entry)}".split()) in help_text
        assert from_flags(bits, as_flags(entry)) == Recipe.best(bits)
    # stage options and steps spelled out too: the reconstruction recipe
    assert from_flags(3, as_flags({**RECON_RECIPE, "group_size": 64})) == Recipe.reconstruction(3, 64)


def test_console_script_help():
    result = subprocess.run([sys.executable, "-m", "bitquilt.cli", "quantize", "--help"],
                            capture_output=True, text=True, check=True)
    assert "--group-size" in result.stdout and "per-channel" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--w-bits", "5"], "unsupported weight bits 5 by solver 'rtn'; supported: 2, 3, 4, 8"),
    (["--group-size", "100"], "unsupported group size 100"),
    (["--calib-samples", "0"], "--calib-samples must be"),
    (["--method", "gptx"], "unknown method 'gptx': a method is [stage+...+]solver, solvers bpdq, gguf_gptq, "
                           "gguf_rtn, gptq"),
])
def test_bad_quantize_options(tmp_path, capsys, args, message):
    out = tmp_path / "q"
    code, _, err = run(capsys, "quantize", "smollm2-135m", "-o", out, "--method", "rtn", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_unknown_task_fails_before_loading(capsys, monkeypatch):
    import bitquilt.api

    monkeypatch.setattr(bitquilt.api, "load", lambda spec: pytest.fail("model loaded before the task check"))
    code, _, err = run(capsys, "eval", "smollm2-135m", "--tasks", "piqa,arc_eazy")
    assert code == 2 and "unknown task 'arc_eazy'" in err and "arc_easy" in err


def test_bad_model_paths(tmp_path, capsys):
    code, _, err = run(capsys, "eval", tmp_path / "nope")
    assert code == 2 and "neither a packaged model nor an existing path" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "eval", tmp_path / "empty")
    assert code == 2 and "not a model" in err
    code, _, err = run(capsys, "eval", "no-such-model")
    assert code == 2 and "smollm2-135m" in err


def test_nan_weights_and_tiny_calibration_file(tmp_path, capsys, smollm):
    from tests.conftest import make_tiny

    model = make_tiny("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "nan_model")
    smollm[1].save_pretrained(tmp_path / "nan_model")
    out = tmp_path / "q"
    code, _, err = run(capsys, "quantize", tmp_path / "nan_model", "--method", "rtn", "-o", out)
    assert code == 2 and "NaN/Inf" in err and not out.exists()

    (tmp_path / "calib.txt").write_text("too short")
    code, _, err = run(capsys, "quantize", "smollm2-135m", "--calib-data", tmp_path / "calib.txt", "-o", out)
    assert code == 2 and "calib.txt" in err and not out.exists()
    (tmp_path / "empty.txt").write_text("")
    code, _, err = run(capsys, "quantize", "smollm2-135m", "--calib-data", tmp_path / "empty.txt", "-o", out)
    assert code == 2 and "empty.txt" in err and not out.exists()


def test_generate_and_bench(tmp_path, capsys):
    code, stdout, _ = run(capsys, "generate", "smollm2-135m", "--prompt", "The capital of France is",
                          "--max-new-tokens", "3", "--json")
    assert code == 0
    result = json.loads(stdout)
    assert result["new_tokens"] <= 3 and "Paris" in result["completion"]
    q = tmp_path / "q2"
    assert run(capsys, "quantize", "smollm2-135m", "--method", "rtn", "--w-bits", "2", "--group-size", "64",
               "-o", q)[0] == 0
    code, stdout, _ = run(capsys, "bench", "smollm2-135m", q, "--prompt-tokens", "8", "--new-tokens", "3",
                          "--repeats", "1", "--threads", "1", "--json")
    assert code == 0
    fp, quant = json.loads(stdout)
    assert quant["weights_mb"] < fp["weights_mb"] / 3 and quant["kernel_layout_mb"] > 0
    assert quant["decode_speedup"] > 0 and fp["decode_tokens_per_s"] > 0


@pytest.mark.parametrize("args, message", [
    (["generate", "smollm2-135m", "--prompt", ""], "--prompt is empty"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "0"],
     "--max-new-tokens must be ≥ 1, got 0"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "100000"],
     "a sequence of 100001 positions (prompt + new tokens) does not fit the model's 8192"),
    (["generate", "smollm2-135m", "--prompt", "ab\udcffcd"], "--prompt is not UTF-8 text"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--temperature", "nan"], "--temperature must be a finite number"),
    (["generate", "smollm2-135m", "--prompt", "hi", "--seed", "-1"], "--seed must be ≥ 0, got -1"),
    (["bench", "smollm2-135m", "--new-tokens", "1"], "--new-tokens must be ≥ 2, got 1"),
    (["bench", "smollm2-135m", "--threads", "0"], "--threads must be ≥ 1, got 0"),
    (["bench", "smollm2-135m", "--threads", "2147483648"], "--threads must be ≤ 1024, got 2147483648"),
])
def test_generate_and_bench_bad_input(capsys, args, message):
    code, _, err = run(capsys, *args)
    assert code == 2 and message in err.splitlines()[-1] and "Traceback" not in err  # (above it: load progress)
