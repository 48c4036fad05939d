"""Continuous batching (bitquilt.runtime.batch): each sequence of a batch gets the tokens it gets alone, whatever joins
or leaves beside it, while a long prompt is read a chunk per step."""

import pytest
import torch
from conftest import make_tiny

from bitquilt.api import quantize
from bitquilt.recipes import Recipe
from bitquilt.runtime.batch import Batch
from bitquilt.runtime.engines import decode, sampler

CHUNK = 16
NEW = 12


def _tiny_w4(model_type: str):
    model = make_tiny(model_type)
    calib = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(2))
    quantize(model, Recipe("rtn", w_bits=4, group_size=64, head_bits=8), calib)
    return model


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 320, (n,), generator=generator).tolist() for n in (5, 40, 70, 1, 33)]


def _alone(model, engine: str, prompt: list[int], pick) -> list[int]:
    batch = Batch(model, 256, engine, chunk=CHUNK)
    seq = batch.add(prompt, len(prompt) + NEW, pick)
    while len(seq.new_ids) < NEW:
        batch.step()
    return seq.new_ids


def _staggered(model, engine: str, prompts: list[list[int]], picks: list, leave: int | None = None) -> dict:
    """New ids of each prompt, a prompt joining every third step; `leave` (an index) leaves after 3 tokens."""
    batch = Batch(model, 256, engine, chunk=CHUNK)
    seqs: dict = {}
    step = 0
    while len(seqs) < len(prompts) or batch.sequences:
        if step % 3 == 0 and len(seqs) < len(prompts):
            i = len(seqs)
            seqs[i] = batch.add(prompts[i], len(prompts[i]) + NEW, picks[i])
        for seq, _ in batch.step():
            if len(seq.new_ids) == NEW or (seq is seqs.get(leave) and len(seq.new_ids) == 3):
                batch.remove(seq)
        step += 1
    return {i: s.new_ids for i, s in seqs.items()}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("engine", ["lean", "auto"])
def test_greedy_sequences_get_the_same_tokens_batched_as_alone(model_type, engine):
    model = _tiny_w4(model_type)
    prompts = _prompts()
    alone = [_alone(model, engine, p, sampler(0.0)) for p in prompts]
    assert alone == [decode(model, torch.tensor([p]), NEW, engine=engine).new_ids for p in prompts]
    assert _staggered(model, engine, prompts, [sampler(0.0) for _ in prompts]) == dict(enumerate(alone))


def test_a_sequence_that_leaves_changes_nothing_for_the_others():
    model = _tiny_w4("llama")
    prompts = _prompts()
    alone = [_alone(model, "lean", p, sampler(0.0)) for p in prompts]
    got = _staggered(model, "lean", prompts, [sampler(0.0) for _ in prompts], leave=1)
    assert got[1] == alone[1][:3]
    assert [got[i] for i in (0, 2, 3, 4)] == [alone[i] for i in (0, 2, 3, 4)]


def test_seeded_samples_are_the_same_batched_as_alone():
    model = _tiny_w4("llama")
    prompts = _prompts()
    alone = [_alone(model, "lean", p, sampler(1.0, 0.9, seed=i)) for i, p in enumerate(prompts)]
    batched = _staggered(model, "lean", prompts, [sampler(1.0, 0.9, seed=i) for i in range(len(prompts))])
    assert batched == dict(enumerate(alone))
    assert alone[0] != _alone(model, "lean", prompts[0], sampler(1.0, 0.9, seed=99))  # the seed matters


def test_a_long_prompt_is_read_a_chunk_per_step_while_the_others_decode():
    model = _tiny_w4("llama")
    batch = Batch(model, 256, "lean", chunk=CHUNK)
    running = batch.add([1, 2, 3], 100, sampler(0.0))
    batch.step()
    long = batch.add(list(range(5, 5 + 3 * CHUNK + 4)), 100, sampler(0.0))
    for step in range(4):  # three whole chunks, then the last four tokens and the first new one
        picked = batch.step()
        assert [s for s, _ in picked] == ([running] if step < 3 else [running, long])
        assert long.cache.pos == min(CHUNK * (step + 1), 3 * CHUNK + 4)


@pytest.mark.parametrize("engine", ["lean", "auto"])
def test_a_prompt_is_read_in_idle_chunks_while_no_sequence_decodes(engine):
    model = _tiny_w4("llama")
    batch = Batch(model, 256, engine, chunk=CHUNK, idle_chunk=4 * CHUNK)
    long = batch.add(list(range(5, 5 + 5 * CHUNK)), 200, sampler(0.0))
    assert batch.step() == [] and long.cache.pos == 4 * CHUNK  # alone: a larger chunk
    waiting = batch.add([1, 2, 3], 100, sampler(0.0))
    assert [s for s, _ in batch.step()] == [long] and long.cache.pos == 5 * CHUNK
    batch.step()  # `waiting` reads its prompt beside the decoding `long`
    assert waiting.cache.pos == 3 and len(long.new_ids) == 2


def test_models_the_lean_layers_do_not_run_step_one_sequence_at_a_time():
    model = make_tiny("gemma3_text")
    prompts = _prompts()[:3]
    expected = {i: decode(model, torch.tensor([p]), NEW).new_ids for i, p in enumerate(prompts)}
    assert _staggered(model, "auto", prompts, [sampler(0.0) for _ in prompts]) == expected


def test_a_batch_refuses_what_it_cannot_place():
    batch = Batch(make_tiny("llama"), 64, "lean")
    with pytest.raises(ValueError, match="a prompt of 1 to 9 tokens"):
        batch.add(list(range(10)), 10, sampler(0.0))
    with pytest.raises(ValueError, match="unknown decode engine"):
        Batch(make_tiny("llama"), 64, "fast")
