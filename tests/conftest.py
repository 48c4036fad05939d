"""Shared fixtures: the default packaged model, real layers with calibration statistics, tiny models."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bitquilt.calib.capture import capture_block_inputs, collect_stats, run_block
from bitquilt.models.adapters import architecture_of, decoder_layers
from bitquilt.models.fused import fuse_parts, split_fused
from bitquilt.models.registry import DEFAULT_MODEL  # noqa: E402

# The suite is dominated by small tensor ops, where OpenMP synchronisation costs more than a
# second thread gains (and collapses when the machine is loaded). Tests that measure threading set it.
torch.set_num_threads(1)


ROOT = Path(__file__).resolve().parents[1]
# llama.cpp's optional venv (bench/llamacpp.py): tests that run an exported GGUF in llama.cpp skip without it
LLAMACPP_PYTHON = Path(os.environ.get("BITQUILT_LLAMACPP_PYTHON", ROOT / ".venv-llamacpp" / "bin" / "python"))
needs_llamacpp = pytest.mark.skipif(not LLAMACPP_PYTHON.is_file(),
                                    reason="llama.cpp's optional venv (bench/llamacpp.py) not installed")


def llamacpp_hidden(gguf_file, ids: list[int]) -> torch.Tensor:
    """llama.cpp's final-norm hidden states [T, hidden] of `gguf_file` on `ids` (tests/llamacpp_hidden.py)."""
    run = subprocess.run([str(LLAMACPP_PYTHON), str(ROOT / "tests" / "llamacpp_hidden.py"), str(gguf_file),
                          json.dumps(ids)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return torch.tensor(json.loads(run.stdout.strip().splitlines()[-1]))


@pytest.fixture
def int8_on():
    """The test runs where kernels may round activations to int8 (what `--int8-activations` allows)."""
    from bitquilt import kernels

    with kernels.using(int8_activations=True):
        yield


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer) of the default packaged model (fetched by `make test`)."""
    from bitquilt.models.loading import load_model

    torch.manual_seed(0)
    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def saved_smollm(tmp_path_factory):
    """smollm2-135m, RTN W4 g128 with an 8-bit head (tied: the embedding reads the head's rows), saved by `bitquilt
    quantize` once for the session (`<root>/saved`)."""
    from bitquilt.cli import main

    saved = tmp_path_factory.mktemp("standalone") / "saved"
    assert main(["quantize", "smollm2-135m", "--method", "rtn", "--head-bits", "8", "--stream", "-o", str(saved)]) == 0
    return saved


@pytest.fixture(scope="session")
def exported_smollm(saved_smollm):
    """The root of `saved_smollm` (`saved/`), with it exported to the standalone runtime (`out/`) beside it, once for
    the tests of both runtimes and of a torch-free install."""
    from bitquilt.cli import main

    root = saved_smollm.parent
    assert main(["export", str(saved_smollm), "-o", str(root / "out"), "--to", "standalone", "--json"]) == 0
    return root


@pytest.fixture(scope="session")
def calib_ids(smollm):
    from bitquilt.data.windows import calibration_windows

    return calibration_windows(smollm[1], "sciq", n_samples=16, seqlen=256, seed=0)


@pytest.fixture(scope="session")
def real_linears(smollm, calib_ids):
    """[(name, weight, LinearStats)] for real linears of blocks 0 and 15 of smollm2-135m.

    Statistics come from the full-precision model on 16×256 SciQ tokens.
    """
    model = smollm[0]
    arch = architecture_of(model)
    layers = decoder_layers(model, arch)
    inputs, kwargs = capture_block_inputs(model, arch, calib_ids)
    names = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]
    out = []
    with torch.no_grad():
        for i, layer in enumerate(layers):
            if i in (0, 15):
                stats = collect_stats(layer, names, inputs, kwargs[i])
                out += [(f"layers.{i}.{n}", layer.get_submodule(n).weight.detach().float().clone(), stats[n])
                        for n in names]
            if i == 15:
                break
            inputs = run_block(layer, inputs, kwargs[i])
    return out


# Gemma with both layer types, a window shorter than the tests' sequences and soft-capped logits (and, Gemma 2,
# attention scores capped low enough to matter): `make_tiny(t, **WINDOWED.get(t, {}))`
_GEMMA = dict(layer_types=["full_attention", "sliding_attention", "sliding_attention"], num_hidden_layers=3,
              sliding_window=5, final_logit_softcapping=2.0)
WINDOWED = {"gemma3_text": _GEMMA, "gemma2": _GEMMA | {"attn_logit_softcapping": 1.0}}


def make_tiny(model_type: str = "llama", seed: int = 0, **overrides):
    """A random 2-layer model of the given family (fast engine/io tests for every adapter); `overrides`: config
    values that replace the tiny ones."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        MistralConfig,
        MixtralConfig,
        OlmoeConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config_class, own = {
        "llama": (LlamaConfig, {}),
        "mistral": (MistralConfig, {}),  # its 4,096-token window: longer than any test sequence
        "qwen2": (Qwen2Config, {}),
        "qwen3": (Qwen3Config, dict(head_dim=32)),
        "gemma2": (Gemma2Config, dict(head_dim=32, sliding_window=64)),
        "gemma3_text": (Gemma3TextConfig, dict(head_dim=32, sliding_window=64)),
        # Phi-4-mini's partial rotary factor; ids inside the tiny vocabulary
        "phi3": (Phi3Config, dict(partial_rotary_factor=0.75, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
        # MoE: 4 experts, 2 per token (each expert sees about half the tokens)
        "mixtral": (MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=128)),
        "qwen3_moe": (Qwen3MoeConfig, dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=128, norm_topk_prob=True)),
        "olmoe": (OlmoeConfig, dict(num_experts=4, num_experts_per_tok=2, intermediate_size=128, bos_token_id=1,
                                    eos_token_id=2, pad_token_id=0)),
    }[model_type]
    config = config_class(**common | own | overrides)
    torch.manual_seed(seed)
    model = split_fused(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())  # as `load` gives it
    with torch.no_grad():  # random norms so norm folding is actually exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def save_tiny_with_tokenizer(path, model_type: str = "llama"):
    """`make_tiny(model_type)` with the default model's tokenizer and vocabulary, saved at `path`; the tokenizer."""
    from transformers import AutoTokenizer

    from bitquilt.models.registry import fetched_dir

    tokenizer = AutoTokenizer.from_pretrained(fetched_dir(DEFAULT_MODEL))
    model = fuse_parts(make_tiny(model_type))  # the family's own checkpoint layout
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


ROUTED_RECIPE = dict(method="mobiquant", w_bits=6, group_size=32,
                     stage_options={"mobiroute": {"target_bits": 3.0, "steps": 2, "batch": 2}})


@pytest.fixture(scope="session")
def routed_tiny(tmp_path_factory):
    """The root of a tiny llama quantized with MoBiQuant (slices and per-token routers) with the default model's
    tokenizer: saved (`saved/`) and exported to the standalone runtime (`out/`)."""
    from bitquilt.api import export, quantize, save
    from bitquilt.models.loading import load_model
    from bitquilt.recipes import Recipe

    root = tmp_path_factory.mktemp("routed")
    tokenizer = save_tiny_with_tokenizer(root / "hf")
    model, _ = load_model(root / "hf")
    quantize(model, Recipe(**ROUTED_RECIPE), torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(2)),
             progress=False)
    save(model, root / "saved", tokenizer=tokenizer)
    export(root / "saved", root / "out", to="standalone")
    return root


@pytest.fixture
def tiny_llama():
    return make_tiny("llama")


def block_context(model, recipe, ids, index: int = 0):
    """The context a block stage of `recipe` sees on block `index` of `model` (inputs of the fp model)."""
    from bitquilt.calib.stages import BlockContext
    from bitquilt.pipeline.engine import initial_plan

    arch = architecture_of(model)
    inputs, kwargs = capture_block_inputs(model, arch, ids)
    for block in list(decoder_layers(model, arch))[:index]:
        inputs = run_block(block, inputs, kwargs[index])
    return BlockContext(model, arch, initial_plan(model, arch, recipe), ids, index=index,
                        block=decoder_layers(model, arch)[index], inputs=inputs, kwargs=kwargs[index])


def attach_kv_quantizers(model, config):
    """A KV quantizer with `config` on every attention module of `model`."""
    from bitquilt.nn.kv_quant import KVQuantizer
    from bitquilt.nn.online import attach, enable_attention_site

    arch = architecture_of(model)
    for block in decoder_layers(model, arch):
        attach(block.get_submodule(arch.attention), "kv_quant", KVQuantizer(config))
    enable_attention_site(model)


def reload_bit_exact(model, ids, path):
    """Save `model` to `path`, load it back, check the logits on `ids` are bit-identical; the loaded model."""
    from bitquilt.api import save
    from bitquilt.io import load_quantized

    with torch.no_grad():
        ref = model(ids).logits
    save(model, path)
    loaded, _ = load_quantized(path)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
    return loaded
