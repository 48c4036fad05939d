"""Generation with the KV cache, and the end-to-end speed measurement."""

import pytest
import torch

from bitquilt.api import quantize
from bitquilt.eval.speed import measure_speed
from bitquilt.recipes import Recipe
from bitquilt.runtime.engines import decode


def greedy_without_cache(model, ids: torch.Tensor, n: int) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(ids, use_cache=False).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


@pytest.mark.parametrize("quantized", [False, True])
def test_cached_decode_equals_recomputing_the_whole_sequence(tiny_llama, quantized):
    if quantized:
        quantize(tiny_llama, Recipe("rtn", w_bits=4, group_size=64), None)
    prompt = torch.randint(0, 320, (1, 7), generator=torch.Generator().manual_seed(0))
    run = decode(tiny_llama, prompt, 12)
    assert run.new_ids == greedy_without_cache(tiny_llama, prompt, 12)
    assert run.prefill_seconds > 0 and run.decode_seconds > 0


def test_sampling_is_seeded_and_decoding_stops_at_a_stop_token(tiny_llama):
    prompt = torch.tensor([[1, 2, 3]])
    sampled = decode(tiny_llama, prompt, 10, temperature=1.0, seed=3).new_ids
    assert sampled == decode(tiny_llama, prompt, 10, temperature=1.0, seed=3).new_ids
    greedy = decode(tiny_llama, prompt, 10).new_ids
    stop = greedy[3]
    assert decode(tiny_llama, prompt, 10, stop_ids={stop}).new_ids == greedy[: greedy.index(stop) + 1]


def test_measure_speed_reports_the_kernel_layout(tiny_llama):
    quantize(tiny_llama, Recipe("rtn", w_bits=2, group_size=64), None)
    result = measure_speed(tiny_llama, 320, prompt_tokens=16, new_tokens=4, repeats=1)
    assert result.prefill_tokens_per_s > 0 and result.decode_tokens_per_s > 0
    assert result.weights_mb > 0 and result.kernel_layout_mb > 0 and result.peak_rss_mb > 0


@pytest.mark.parametrize("kwargs", [dict(prompt_tokens=0), dict(new_tokens=1), dict(repeats=0)])
def test_measure_speed_rejects_degenerate_settings(tiny_llama, kwargs):
    with pytest.raises(ValueError, match="need prompt_tokens"):
        measure_speed(tiny_llama, 320, **kwargs)


@pytest.mark.parametrize("args, match", [((0,), "vocab_size must be at least 2"), ((320.0,), "vocab_size=320.0"),
                                         ((320, "16"), "prompt_tokens='16'"), ((320, 8, 4, True), "repeats=True")])
def test_measure_speed_names_settings_of_the_wrong_kind(tiny_llama, args, match):
    with pytest.raises(ValueError, match=match):
        measure_speed(tiny_llama, *args)
    with pytest.raises(ValueError, match="seed must be an integer"):
        measure_speed(tiny_llama, 320, seed=-1)


def test_decode_rejects_bad_prompts(tiny_llama):
    with pytest.raises(ValueError, match="one non-empty prompt"):
        decode(tiny_llama, torch.zeros(2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode(tiny_llama, torch.tensor([[1]]), 0)
