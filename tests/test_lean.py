"""Lean batch-1 decoding (static KV cache, the model's own modules) against the transformers forward."""

import pytest
import torch
from conftest import WINDOWED, make_tiny

from bitquilt import kernels
from bitquilt.api import quantize
from bitquilt.eval.speed import measure_speed
from bitquilt.nn.quant_linear import set_slices
from bitquilt.recipes import Recipe
from bitquilt.runtime.engines import decode, stepper
from bitquilt.runtime.lean import LeanDecoder, unsupported_reason


def transformers_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits[0]


def lean_logits(model, ids: torch.Tensor, prompt: int, fuse: bool = False) -> torch.Tensor:
    """Logits at positions prompt − 1 … T − 1: the prompt in one call, then one token per step."""
    decoder = LeanDecoder(model, ids.shape[1], fuse=fuse)
    assert (decoder.fused is not None) == fuse, decoder.fused_reason
    rows = [decoder.forward(ids[:, :prompt])]
    rows += [decoder.forward(ids[:, t:t + 1]) for t in range(prompt, ids.shape[1])]
    return torch.stack(rows)


def _ids(n: int = 14, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 320, (1, n), generator=torch.Generator().manual_seed(seed))


# phi3: split, partial rotary
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"])
def test_lean_steps_give_the_transformers_logits(model_type):
    model = make_tiny(model_type, **WINDOWED.get(model_type, {}))
    ids = _ids()
    ref = transformers_logits(model, ids)[8:]
    assert torch.allclose(lean_logits(model, ids, 9), ref, atol=1e-5)


@pytest.mark.parametrize("recipe", [Recipe("rtn", w_bits=4, group_size=64),
                                    Recipe("rtn", w_bits=4, group_size=64, head_bits=8),
                                    Recipe("quarot+rtn", w_bits=4, group_size=32, a_bits=4, kv_bits=4, a_clip=None)],
                         ids=["w4", "w4-head8", "quarot-w4a4kv4"])
def test_lean_steps_run_quantized_linears_and_online_modules_as_transformers_does(recipe):
    model = make_tiny("llama")
    quantize(model, recipe, _ids(64, seed=2).view(2, 32))
    assert any(LeanDecoder(model, 4).has_site) == (recipe.kv_bits < 16)  # KV quantizers at the attention site
    ids = _ids()
    ref = transformers_logits(model, ids)[8:]
    assert torch.allclose(lean_logits(model, ids, 9), ref, atol=1e-4)


@pytest.mark.parametrize("recipe", [None, Recipe("rtn", w_bits=4, group_size=64)], ids=["fp32", "w4"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "olmoe"])
def test_lean_steps_route_moe_rows_to_their_experts_as_transformers_does(model_type, recipe):
    """MoE blocks run as modules (router, then each expert's linears, quantized or not, on its rows); olmoe's
    whole-projection q/k norms and q/k/v clipping as in transformers (clipping keeps the steps out of the fused
    layers)."""
    model = make_tiny(model_type, **{"clip_qkv": 0.5} if model_type == "olmoe" else {})
    if recipe is not None:
        quantize(model, recipe, _ids(64, seed=2).view(2, 32), progress=False)
    assert (LeanDecoder(model, 4).fused_reason == "q/k/v clipping (clip_qkv)") == (model_type == "olmoe")
    ids = _ids()
    ref = transformers_logits(model, ids)[8:]
    assert torch.allclose(lean_logits(model, ids, 9), ref, atol=1e-4)
    prompt = _ids(7)
    assert decode(model, prompt, 8, engine="lean").new_ids == decode(model, prompt, 8, engine="transformers").new_ids


def test_decode_engines_agree_and_auto_takes_the_lean_path():
    model = make_tiny("qwen2")
    prompt = _ids(7)
    lean = decode(model, prompt, 10, engine="lean").new_ids
    assert lean == decode(model, prompt, 10, engine="transformers").new_ids
    assert decode(model, prompt, 10).new_ids == lean
    assert isinstance(stepper(model, 20).__self__, LeanDecoder)
    assert measure_speed(model, 320, prompt_tokens=8, new_tokens=3, repeats=1, engine="lean").decode_tokens_per_s > 0


def test_unsupported_models_stay_on_transformers_or_are_refused():
    gemma = make_tiny("gemma3_text", attn_logit_softcapping=50.0)  # Gemma 2's, not Gemma 3's
    assert "soft-capping" in unsupported_reason(gemma, 16)
    prompt = _ids(5)
    assert decode(gemma, prompt, 4).new_ids == decode(gemma, prompt, 4, engine="transformers").new_ids
    with pytest.raises(ValueError, match="does not support this model.*attention logit soft-capping"):
        decode(gemma, prompt, 4, engine="lean")
    with pytest.raises(ValueError, match="unknown decode engine"):
        decode(gemma, prompt, 4, engine="fast")
    assert "exceed" in unsupported_reason(make_tiny("llama"), 10_000)


def test_lean_decoder_refuses_inputs_it_cannot_place():
    decoder = LeanDecoder(make_tiny("llama"), 8)
    decoder.forward(_ids(6))
    with pytest.raises(ValueError, match="empty cache"):
        decoder.forward(_ids(2))
    decoder.forward(_ids(2)[:, :1])
    decoder.forward(_ids(2)[:, :1])
    with pytest.raises(ValueError, match="past the cache's 8 positions"):
        decoder.forward(_ids(2)[:, :1])
    decoder.reset()
    assert decoder.forward(_ids(8)).shape == (320,)


FUSED_RECIPES = [None, Recipe("rtn", w_bits=4, group_size=64), Recipe("rtn", w_bits=4, group_size=64, head_bits=8),
                 Recipe("rtn", w_bits=8, group_size=64),
                 Recipe("bpdq", w_bits=2, group_size=64),
                 Recipe("mobislice", w_bits=4, group_size=32, options={"slices": (2, 1, 1)}),
                 Recipe("rtn", w_bits=4, group_size=64, residual="mosaic",
                        residual_options={"budget": 0.2, "score": "magnitude"})]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe",
                                        "olmoe"])
@pytest.mark.parametrize("recipe", FUSED_RECIPES, ids=["fp32", "w4", "w4-head8", "w8", "bpdq-w2", "slices", "mosaic"])
def test_fused_layers_give_the_module_by_module_logits(model_type, recipe):
    """One compiled call per step (norms, biases, q/k norms, RoPE, GQA attention over the cache, MLP) equals the
    eager modules: dense fp32, uniform and bit-plane packed weights, a sliced weight's static prefix, and a
    MosaicQuant base with its sparse residual; Gemma's post-norms, GELU, windows, caps and per-layer RoPE; MoE
    routing (softmax top-k, each expert once for its rows) and OLMoE's whole-projection q/k norms."""
    model = make_tiny(model_type, **WINDOWED.get(model_type, {}))
    if recipe is not None:
        quantize(model, recipe, _ids(64, seed=2).view(2, 32), progress=False)
    if recipe is not None and recipe.method == "mobislice":
        set_slices(model, 2)
    ids = _ids()
    ref = transformers_logits(model, ids)[8:]
    fused = lean_logits(model, ids, 9, fuse=True)
    assert torch.allclose(fused, lean_logits(model, ids, 9), atol=3e-5)  # fp32 order: the head sees ulps
    assert torch.allclose(fused, ref, atol=1e-4)


def test_fused_layers_step_aside_for_what_they_do_not_run():
    model = make_tiny("llama")
    quantize(model, Recipe("quarot+rtn", w_bits=4, group_size=32, a_bits=4, kv_bits=4, a_clip=None),
             _ids(64, seed=2).view(2, 32), progress=False)
    decoder = LeanDecoder(model, 16)
    assert decoder.fused is None and "attention site" in decoder.fused_reason
    with pytest.raises(ValueError, match="fused decoding does not support this model: modules at the attention"):
        stepper(model, 16, "fused")
    assert isinstance(stepper(model, 16).__self__, LeanDecoder)  # auto: module by module
    plain = make_tiny("llama")
    handle = plain.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: None)
    assert LeanDecoder(plain, 16).fused_reason == "layer 1 down_proj has hooks"
    handle.remove()
    prompt = _ids(6)
    fused = decode(plain, prompt, 6, engine="fused").new_ids
    assert fused == decode(plain, prompt, 6, engine="lean").new_ids == decode(plain, prompt, 6).new_ids
    with kernels.using(enabled=False):  # the oracle switch turns the compiled step off too
        decoder = LeanDecoder(plain, 8)
        decoder.forward(prompt)
        eager = lean_logits(plain, torch.cat([prompt, prompt[:, :1]], 1), 6)[-1]
        assert torch.allclose(decoder.forward(prompt[:, :1]), eager, atol=1e-5)
