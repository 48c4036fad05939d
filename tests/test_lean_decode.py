"""Lean batch-1 decoding (static KV cache, the model's own modules) against the transformers forward."""

import pytest
import torch
from conftest import make_tiny

from bitquilt.api import quantize
from bitquilt.eval.speed import decode, measure_speed, stepper
from bitquilt.models.lean_decode import LeanDecoder, unsupported_reason
from bitquilt.recipes import Recipe


def transformers_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits[0]


def lean_logits(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits at positions prompt − 1 … T − 1: the prompt in one call, then one token per step."""
    decoder = LeanDecoder(model, ids.shape[1])
    rows = [decoder.forward(ids[:, :prompt])]
    rows += [decoder.forward(ids[:, t:t + 1]) for t in range(prompt, ids.shape[1])]
    return torch.stack(rows)


def _ids(n: int = 14, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 320, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_lean_steps_give_the_transformers_logits(model_type):
    model = make_tiny(model_type)
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


def test_decode_engines_agree_and_auto_takes_the_lean_path():
    model = make_tiny("qwen2")
    prompt = _ids(7)
    lean = decode(model, prompt, 10, engine="lean").new_ids
    assert lean == decode(model, prompt, 10, engine="transformers").new_ids
    assert decode(model, prompt, 10).new_ids == lean
    assert isinstance(stepper(model, 20).__self__, LeanDecoder)
    assert measure_speed(model, 320, prompt_tokens=8, new_tokens=3, repeats=1, engine="lean").decode_tokens_per_s > 0


def test_unsupported_models_stay_on_transformers_or_are_refused():
    gemma = make_tiny("gemma3_text")
    assert "gemma3_text" in unsupported_reason(gemma, 16)
    prompt = _ids(5)
    assert decode(gemma, prompt, 4).new_ids == decode(gemma, prompt, 4, engine="transformers").new_ids
    with pytest.raises(ValueError, match="does not support this model.*gemma3_text"):
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
