"""Continuous batching in the standalone runtime (bitquilt.runtime.standalone.batch over the library's `bq_step`):
each sequence gets the greedy tokens it gets alone, routed at its own precision on a MoBiQuant export."""

from __future__ import annotations

import ctypes
import math
from array import array

import pytest

from bitquilt.errors import UserError
from bitquilt.runtime.standalone.batch import StandaloneBatch
from bitquilt.runtime.standalone.generate import generate_ids, picker
from bitquilt.runtime.standalone.library import library
from bitquilt.runtime.standalone.model import StandaloneModel

# (prompt ids, new tokens): a prompt longer than a prefill chunk (read over two steps while the others decode)
PROMPTS = [([1, 2, 3], 12), ([7] * 40 + [9, 11], 9), ([300, 5], 14), ([42], 6)]


def _batched(model: StandaloneModel, avg_bits: list[float | None], stagger: int = 2) -> list[list[int]]:
    """The greedy tokens of PROMPTS in one batch, a sequence joining every `stagger` steps (at `avg_bits[i]`)."""
    batch = StandaloneBatch(model)
    waiting = list(zip(PROMPTS, avg_bits))
    seqs, wanted, done = [], {}, {}
    step = 0
    while waiting or batch.sequences:
        if waiting and step % stagger == 0:
            (prompt, n), bits = waiting.pop(0)
            seq = batch.add(prompt, len(prompt) + n, picker(), bits)
            seqs.append(seq)
            wanted[id(seq)] = n
        for seq, token in batch.step():
            assert token >= 0
            if len(seq.new_ids) == wanted[id(seq)]:
                done[id(seq)] = seq.avg_bits
                batch.remove(seq)
        step += 1
    assert all(seq.avg_bits == done[id(seq)] for seq in seqs)  # kept when it left
    return [seq.new_ids for seq in seqs]


def _alone(model: StandaloneModel, avg_bits: list[float | None]) -> list[list[int]]:
    runs = []
    for (prompt, n), bits in zip(PROMPTS, avg_bits):
        model.set_avg_bits(bits)
        runs.append(generate_ids(model, prompt, n).new_ids)
    model.set_avg_bits(None)
    return runs


def test_each_sequence_of_a_batch_gets_the_tokens_it_gets_alone(exported_smollm):
    model = StandaloneModel(exported_smollm / "out")
    alone = _alone(model, [None] * len(PROMPTS))
    assert _batched(model, [None] * len(PROMPTS)) == alone
    assert _batched(model, [None] * len(PROMPTS), stagger=1) == alone
    assert model.routed_range() is None and StandaloneBatch(model).routed_range is None


def test_each_sequence_of_a_routed_batch_is_routed_at_its_own_bits(routed_tiny):
    model = StandaloneModel(routed_tiny / "out")
    low, high = model.routed_range()
    bits = [low + 0.2 * (high - low), None, high, low + 0.6 * (high - low)]
    assert _batched(model, bits) == _alone(model, bits)
    batch = StandaloneBatch(model)
    lower, higher = (batch.add([1, 2, 3], 12, picker(), b) for b in (low, high))
    for _ in range(5):
        batch.step()
    assert lower.avg_bits < higher.avg_bits
    assert math.isclose(lower.avg_bits, low, abs_tol=0.35) and math.isclose(higher.avg_bits, high, abs_tol=0.35)
    batch.route([lower], high)  # from the next step on: its average rises
    before = lower.avg_bits
    batch.step()
    assert lower.avg_bits > before
    with pytest.raises(UserError, match="routed range"):
        batch.add([1], 4, picker(), high + 1)


def test_a_step_of_sequences_that_cannot_run_together_is_refused(exported_smollm):
    lib = library()
    model = StandaloneModel(exported_smollm / "out")
    one, other = model.open_sequence(8), model.open_sequence(4)
    ids, counts, pos = array("q", [1, 2]), array("q", [1, 1]), array("q", [0, 0])
    logits = array("f", bytes(8 * model.vocab_size))

    def step(*handles: int) -> int:
        return lib.bq_step((ctypes.c_void_p * len(handles))(*handles), len(handles), ids.buffer_info()[0],
                           counts.buffer_info()[0], pos.buffer_info()[0], logits.buffer_info()[0])

    assert step(one, one) < 0 and "twice" in lib.bq_error().decode()
    pos[1] = 4
    assert step(one, other) < 0 and "outside the cache" in lib.bq_error().decode()
    pos[1] = 0
    assert step(one, other) == 0 and all(math.isfinite(v) for v in logits)
    lib.bq_free(one)
    lib.bq_free(other)
