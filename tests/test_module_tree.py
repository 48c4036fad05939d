"""The bitquilt runtime (bitquilt.runtime.module_tree, runtime.tokenizer): a saved model run without transformers,
against the transformers model and tokenizer it replaces."""

import argparse
import json
import subprocess
import sys

import pytest
import torch
from conftest import WINDOWED, make_tiny

from bitquilt.api import load, quantize, save
from bitquilt.errors import UserError
from bitquilt.io import load_quantized
from bitquilt.models import registry
from bitquilt.recipes import Recipe
from bitquilt.runtime.engines import decode
from bitquilt.runtime.module_tree import ModuleTreeConfig, ModuleTreeLM, inverse_frequencies
from bitquilt.runtime.tokenizer import FastTokenizer


def _ids(n: int, seed: int = 0, vocab: int = 320) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _saved(tmp_path, model_type: str, recipe: Recipe, **overrides):
    model = make_tiny(model_type, **overrides)
    quantize(model, recipe, _ids(64, seed=2).view(2, 32))
    save(model, tmp_path / model_type)
    return tmp_path / model_type


@pytest.mark.parametrize("model_type, recipe, overrides", [
    ("llama", Recipe("rtn", w_bits=4, group_size=64, head_bits=8), {}),
    ("qwen2", Recipe("rtn", w_bits=4, group_size=64), {}),
    ("qwen3", Recipe("rtn", w_bits=2, group_size=32, head_bits=4), {}),
    ("llama", Recipe("quarot+rtn", w_bits=4, group_size=32, a_bits=4, kv_bits=4, a_clip=None), {}),
    ("phi3", Recipe("rtn", w_bits=4, group_size=64, head_bits=8), {}),
    ("gemma3_text", Recipe("rtn", w_bits=4, group_size=32, head_bits=8), WINDOWED["gemma3_text"]),
    ("gemma2", Recipe("rtn", w_bits=4, group_size=32), WINDOWED["gemma2"]),
], ids=["llama-w4-head8", "qwen2-w4", "qwen3-w2-head4", "llama-quarot-w4a4kv4", "phi3-w4-head8", "gemma3-w4-head8",
        "gemma2-w4"])
def test_native_model_gives_the_transformers_logits_and_tokens(tmp_path, model_type, recipe, overrides):
    path = _saved(tmp_path, model_type, recipe, **overrides)
    reference, _ = load_quantized(path)
    native, _ = load_quantized(path, runtime="bitquilt")
    assert isinstance(native, ModuleTreeLM) and not isinstance(reference, ModuleTreeLM)
    assert native.state_dict().keys() == reference.state_dict().keys()
    ids = _ids(2 * 12, seed=1).view(2, 12)
    with torch.no_grad():
        want = reference(ids, use_cache=False).logits
    assert torch.allclose(native(ids), want, atol=1e-4)
    prompt = _ids(6, seed=3)
    assert decode(native, prompt, 8).new_ids == decode(reference, prompt, 8, engine="lean").new_ids


def test_native_window_loss_scores_slices_of_positions_as_the_whole_logits(tmp_path, monkeypatch):
    from bitquilt.eval import ppl

    path = _saved(tmp_path, "qwen2", Recipe("rtn", w_bits=4, group_size=64, head_bits=4))
    reference, native = load_quantized(path)[0], load_quantized(path, runtime="bitquilt")[0]
    ids = _ids(50, seed=4)
    monkeypatch.setattr(ppl, "HEAD_POSITIONS", 16)  # 49 targets: three whole slices and one of 1
    assert ppl.window_loss(native, ids) == pytest.approx(ppl.window_loss(reference, ids), rel=1e-5)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
], ids=["linear", "llama3"])
def test_rope_scaling_matches_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_theta": 50000.0, **rope})
    want, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    got = inverse_frequencies(ModuleTreeConfig.from_dict(config.to_dict()))
    assert torch.allclose(got, want, rtol=1e-6)
    assert not torch.allclose(got, inverse_frequencies(ModuleTreeConfig.from_dict(
        {**config.to_dict(), "rope_parameters": {"rope_theta": 50000.0}})))  # the scaling did something


def test_runtime_choice_and_bad_input(tmp_path):
    gemma = _saved(tmp_path, "gemma3_text", Recipe("rtn", w_bits=4, group_size=32), attn_logit_softcapping=50.0)
    with pytest.raises(UserError, match="bitquilt runtime cannot run .*attention logit soft-capping"):
        load(gemma, runtime="bitquilt")
    assert not isinstance(load(gemma, runtime="auto")[0], ModuleTreeLM)  # auto falls back to transformers
    llama = _saved(tmp_path, "llama", Recipe("rtn", w_bits=4, group_size=64))
    assert isinstance(load(llama, runtime="auto")[0], ModuleTreeLM)
    with pytest.raises(UserError, match="unknown runtime 'fast'; accepted: transformers, bitquilt, auto"):
        load(llama, runtime="fast")
    with pytest.raises(UserError, match="runs directories saved by bitquilt"):
        load("smollm2-135m", runtime="bitquilt")
    with pytest.raises(ValueError, match="loaded in the bitquilt runtime"):
        decode(load(llama, runtime="bitquilt")[0], _ids(4), 2, engine="transformers")
    config = json.loads((llama / "config.json").read_text())
    del config["bitquilt"]["model_type"]  # the guard's record of the base type, gone
    (llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="corrupt or was edited: config.json has no valid 'model_type'"):
        load(llama, runtime="bitquilt")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot load the tokenizer"):
        FastTokenizer(tmp_path / "bad")


TEXTS = ["The capital of France is", "  leading spaces,\ttabs\nand newlines", "émigré café naïve — 東京 🙂",
         "<|im_start|>user\nhi<|im_end|>", "x" * 300, ""]


def test_fast_tokenizer_gives_the_transformers_ids_and_text():
    from transformers import AutoTokenizer

    directory = registry.fetched_dir("smollm2-135m")
    fast, reference = FastTokenizer(directory), AutoTokenizer.from_pretrained(directory)
    for text in TEXTS:
        ids = fast(text)["input_ids"]
        assert ids == reference(text)["input_ids"], text
        assert fast(text, add_special_tokens=False) == {"input_ids": reference(text, add_special_tokens=False)[
            "input_ids"]}, text  # how perplexity windows are tokenized
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert fast.eos_token_id == reference.eos_token_id is not None
    assert len(fast) == len(reference)


HEAVY = ("transformers", "bitquilt.calib", "bitquilt.pipeline", "bitquilt.solvers", "bitquilt.transforms",
         "bitquilt.commands")
HEAVY_IMPORTED = f"HEAVY = {HEAVY!r}\n" + """
def heavy_imported():
    return sorted({m.split(".")[0] if m.startswith("transformers") else m for m in sys.modules if m.startswith(HEAVY)})
"""
GENERATE = "import json, sys\n" + HEAVY_IMPORTED + """
from bitquilt.cli import main
code = main(["generate", sys.argv[1], "--prompt", "The capital of France is", "--max-new-tokens", "6", "--json"])
print(json.dumps({"code": code, "heavy": heavy_imported()}))
"""
RUNTIME_ONLY = "import sys, torch\n" + HEAVY_IMPORTED + """
import bitquilt
from bitquilt.runtime.engines import decode
model, tok = bitquilt.load(sys.argv[1], runtime="bitquilt")
ids = decode(model, torch.tensor([tok("The capital of France is")["input_ids"]]), 4).new_ids
print(heavy_imported())
"""


@pytest.fixture(scope="module")
def saved_smollm(tmp_path_factory):
    """smollm2-135m, RTN W4 g128 with an 8-bit head, saved by the CLI."""
    from bitquilt.cli import main

    out = tmp_path_factory.mktemp("native") / "q4"
    assert main(["quantize", "smollm2-135m", "--method", "rtn", "--head-bits", "8", "--stream", "-o", str(out)]) == 0
    return out


def test_cli_generate_runs_a_saved_model_without_importing_transformers_or_calibration_code(saved_smollm, capsys):
    from bitquilt.cli import main

    out = saved_smollm
    done = subprocess.run([sys.executable, "-c", GENERATE, str(out)], capture_output=True, text=True, check=True)
    lines = done.stdout.strip().splitlines()
    native, imported = json.loads("\n".join(lines[:-1])), json.loads(lines[-1])
    assert imported == {"code": 0, "heavy": []}
    done = subprocess.run([sys.executable, "-c", RUNTIME_ONLY, str(out)], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"  # bitquilt.load + decode: neither transformers nor any calibration code
    assert main(["generate", str(out), "--prompt", "The capital of France is", "--max-new-tokens", "6", "--json",
                 "--engine", "transformers"]) == 0
    assert json.loads(capsys.readouterr().out)["completion"] == native["completion"]
    assert "Paris" in native["completion"]
    for runtime in ("bitquilt", "transformers"):  # forced either way: the same text
        assert main(["generate", str(out), "--prompt", "The capital of France is", "--max-new-tokens", "6", "--json",
                     "--runtime", runtime]) == 0
        assert json.loads(capsys.readouterr().out)["completion"] == native["completion"]
    code = main(["generate", str(out), "--prompt", "hi", "--engine", "transformers", "--runtime", "bitquilt"])
    assert code == 2 and "drop --runtime bitquilt" in capsys.readouterr().err
    code = main(["bench", str(out), "--runtime", "bitquilt", "--engine", "lean", "--prompt-tokens", "8", "--new-tokens",
                 "3", "--repeats", "1", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)[0]["decode_tokens_per_s"] > 0


def test_eval_perplexity_runs_in_the_native_runtime_with_the_transformers_numbers(saved_smollm, capsys):
    from bitquilt.cli import main
    from bitquilt.commands import _eval_runtime

    ppl = {}
    for runtime in ("bitquilt", "transformers"):
        assert main(["eval", str(saved_smollm), "--seqlen", "64", "--ppl-windows", "2", "--json", "--runtime",
                     runtime]) == 0
        ppl[runtime] = json.loads(capsys.readouterr().out)["ppl_wiki"]
    assert ppl["bitquilt"] == pytest.approx(ppl["transformers"], rel=1e-4)
    assert 10 < ppl["bitquilt"] < 100  # a working model, not a diverged one
    tasks = argparse.Namespace(tasks="piqa", runtime="auto")
    assert _eval_runtime(argparse.Namespace(tasks="", runtime="auto")) == "auto"  # perplexity alone: native
    assert _eval_runtime(tasks) == "transformers"  # padded zero-shot batches
    code = main(["eval", str(saved_smollm), "--tasks", "piqa", "--runtime", "bitquilt"])
    assert code == 2 and "drop --tasks or use --runtime transformers" in capsys.readouterr().err
