"""The fused decode step over several sequences at once (bitquilt.runtime.fused): each sequence's row comes out bit for
bit as its step alone gives it, for every kernel the fused layers run, and a batch steps its decoding sequences in one
fused call."""

import pytest
import torch
from conftest import WINDOWED, make_tiny

from bitquilt import kernels
from bitquilt.api import quantize
from bitquilt.io import load_quantized
from bitquilt.nn.quant_linear import set_slices
from bitquilt.nn.slice_router import has_routers, precision_range, set_precision
from bitquilt.recipes import Recipe
from bitquilt.runtime.batch import Batch
from bitquilt.runtime.engines import decode, sampler
from bitquilt.runtime.lean import KVCache, LeanLayers, fuse_layers, fused_cache

PROMPTS = (5, 17, 1, 30)  # prompt lengths of the sequences stepped together

RECIPES = {
    "fp32": None,
    "w4": Recipe("rtn", w_bits=4, group_size=64),
    "w8": Recipe("rtn", w_bits=8, group_size=64),
    "bpdq-w2": Recipe("bpdq", w_bits=2, group_size=64),
    "slices": Recipe("mobislice", w_bits=4, group_size=32, options={"slices": (2, 1, 1)}),
    "mosaic": Recipe("rtn", w_bits=4, group_size=64, residual="mosaic",
                     residual_options={"budget": 0.2, "score": "magnitude"}),
}


def _model(model_type: str, recipe: Recipe | None):
    model = make_tiny(model_type, **WINDOWED.get(model_type, {}))
    if recipe is not None:
        calib = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(2))
        quantize(model, recipe, calib, progress=False)
    if recipe is not None and recipe.method == "mobislice":
        set_slices(model, 2)
    return model


def _filled(stack: LeanLayers, seed: int) -> list[KVCache]:
    """A cache per prompt length, its prompt read module by module."""
    generator = torch.Generator().manual_seed(seed)
    caches = []
    for n in PROMPTS:
        cache = stack.new_cache(48)
        stack.run(torch.randint(0, 320, (1, n), generator=generator), [cache], [n])
        caches.append(cache)
    return caches


def _copy(cache: KVCache) -> KVCache:
    return KVCache([k.clone() for k in cache.keys], [v.clone() for v in cache.values], cache.pos)


@torch.no_grad()
def _assert_rows_alone(model) -> None:
    """Three steps of the sequences of `PROMPTS` together: every row and cache row equals the sequence's step alone."""
    stack = LeanLayers(model, 64)
    fused, why = fuse_layers(stack)
    assert fused is not None, why
    together = _filled(stack, seed=3)
    alone = [_copy(c) for c in together]
    x = torch.randn(len(PROMPTS), model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    for _ in range(3):  # positions move on; each step's rows as alone
        y = fused.step(x, [c.pos for c in together], [fused_cache(fused, c) for c in together])
        for b, c in enumerate(alone):
            assert torch.equal(y[b], fused.step(x[b:b + 1], [c.pos], [fused_cache(fused, c)])[0])
        for a, c in zip(alone, together):
            a.pos = c.pos = c.pos + 1
            assert all(torch.equal(p, q) for p, q in zip(a.keys + a.values, c.keys + c.values))
        x = y


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "mixtral", "olmoe"])
@pytest.mark.parametrize("int8", [False, True], ids=["fp32-act", "int8-act"])
@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_a_batched_step_gives_each_sequence_its_step_alone_bit_for_bit(model_type, int8, recipe):
    """Lookup-table, 4/2-bit × int8, 8-bit (fp32 and int8 activations), dense, sliced and MosaicQuant linears; biases
    and q/k norms: the B-row step's rows and cache rows equal B one-row steps exactly."""
    model = _model(model_type, recipe)
    with kernels.using(int8_activations=int8):
        _assert_rows_alone(model)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32-act", "int8-act"])
def test_each_row_of_a_routed_model_runs_its_own_prefix_of_the_slices(int8):
    """MoBiQuant routing per token: every row's slice count from its own router, its slices on fp32 or int8
    activations (the bit-plane x int8 kernel), as alone."""
    model = _model("llama", Recipe("mobiquant", w_bits=6, group_size=32,
                                   stage_options={"mobiroute": {"target_bits": 3.0, "steps": 2, "batch": 2}}))
    assert has_routers(model)
    set_precision(model, 3.0)
    with kernels.using(int8_activations=int8):
        _assert_rows_alone(model)


def test_a_batch_steps_its_sequences_and_a_prompt_chunk_in_one_fused_call():
    model = _model("llama", Recipe("rtn", w_bits=4, group_size=64, head_bits=8))
    batch = Batch(model, 64, "auto", chunk=8)
    assert batch.fused is not None
    calls = []
    step = batch.fused.step
    batch.fused.step = lambda x, positions, caches, thresholds, counts: \
        calls.append(counts) or step(x, positions, caches, thresholds, counts)
    batch.layers.run = None  # nothing goes module by module
    seqs = [batch.add(list(range(1, n + 1)), 40, sampler(0.0)) for n in (1, 2, 11)]
    while any(len(s.new_ids) < 4 for s in seqs):
        batch.step()
    # each step: the decoding sequences' tokens and the first reading sequence's next chunk (at most 8 ids)
    assert calls[:4] == [[1], [1, 2], [1, 1, 8], [1, 1, 3]]
    assert set(map(tuple, calls[4:])) == {(1, 1, 1)}


@pytest.mark.parametrize("model_type", ["gemma3_text", "mixtral"])
def test_fused_prompt_chunks_decode_as_module_by_module(model_type):
    """Gemma 3's sliding windows and Mixtral's routed experts over prompt chunks in the fused step (as `bitquilt
    serve` runs them): the tokens of module-by-module decoding."""
    model = _model(model_type, Recipe("rtn", w_bits=4, group_size=64, head_bits=8))
    prompts = [list(range(3, 14)), list(range(40, 60))]
    batch = Batch(model, 64, "auto", chunk=8)
    assert batch.fused is not None
    batch.layers.run = None  # prompts and steps all fused
    seqs = [batch.add(p, 40, sampler(0.0)) for p in prompts]
    while any(len(s.new_ids) < 6 for s in seqs):
        batch.step()
    for prompt, seq in zip(prompts, seqs):
        assert seq.new_ids[:6] == decode(model, torch.tensor([prompt]), 6, engine="lean").new_ids


@pytest.mark.parametrize("head_bits", [16, 8, 4], ids=["fp32-head", "head8", "head4"])
def test_batched_logits_are_the_logits_alone_bit_for_bit(head_bits):
    """The final norm and head run in the fused layers too, each row as alone: an fp32 head by a dot product per row
    and token (a BLAS GEMM's rows round otherwise for 2 or 3 rows than for 1), a packed one by its kernel."""
    model = _model("llama", Recipe("rtn", w_bits=4, group_size=64, head_bits=head_bits, head_group_size=64))
    prompts = [[7, 8, 9, 10], [11], [12, 13]]

    def run(which: list[int]) -> dict[int, list[torch.Tensor]]:
        batch, seen = Batch(model, 64, "auto"), {i: [] for i in which}
        assert batch.fused.head is not None

        def pick(i: int):
            return lambda z: seen[i].append(z) or int(z.argmax())

        seqs = {i: batch.add(prompts[i], 12, pick(i)) for i in which}
        while any(len(s.new_ids) < 6 for s in seqs.values()):
            batch.step()
        return seen

    together = run([0, 1, 2])
    for i in range(3):
        alone = run([i])[i]
        assert all(torch.equal(z, a) for z, a in zip(together[i][:6], alone[:6]))


def test_the_fused_step_refuses_what_it_cannot_place():
    model = make_tiny("llama")
    stack = LeanLayers(model, 16)
    fused, _ = fuse_layers(stack)
    cache = fused_cache(fused, stack.new_cache(8))
    x = torch.zeros(2, model.config.hidden_size)
    with pytest.raises(RuntimeError, match="a cache given twice"):
        fused.step(x, [0, 1], [cache, cache])
    with pytest.raises(RuntimeError, match="positions 8..9 outside the cache's 8"):
        fused.step(x[:1], [8], [cache])
    with pytest.raises(RuntimeError, match=r"x: fp32 \[1, 128\] for the sequences' rows"):
        fused.step(x, [0], [cache])
    with pytest.raises(RuntimeError, match="no counts or one per sequence"):
        fused.step(x, [0], [cache], counts=[1, 1])
    with pytest.raises(RuntimeError, match="positions 7..9 outside the cache's 8"):
        fused.step(x, [7], [cache], counts=[2])
    with pytest.raises(RuntimeError, match="each of the 2 layers"):
        fused.cache([k[0] for k in stack.new_cache(8).keys[:1]], [v[0] for v in stack.new_cache(8).values[:1]])
    with pytest.raises(RuntimeError, match="a cache of 32 positions; 1 to 16 fit"):
        fused.cache([torch.zeros(2, 32, 32)] * 2, [torch.zeros(2, 32, 32)] * 2)


def test_a_batch_mixing_precisions_gives_each_sequence_its_tokens_alone(routed_tiny):
    """Each sequence of a MoBiQuant model routed at its own avg_bits, row by row in the fused step: its tokens and bits
    used are those it gets alone, and alone with the routers set to its avg_bits (`set_precision`); fewer bits at the
    lower setting. A bad avg_bits is a ValueError."""
    model, _ = load_quantized(routed_tiny / "saved", runtime="bitquilt")
    low, high = precision_range(model)
    settings = (low + 0.2 * (high - low), high - 0.2 * (high - low))
    prompts = ([7, 8, 9, 10, 11], [12, 13])

    def run(which: list[int], own: bool = True) -> dict[int, tuple[list[int], float]]:
        batch = Batch(model, 64, "auto", chunk=4)
        assert batch.fused is not None
        seqs = {i: batch.add(prompts[i], 24, sampler(0.0), settings[i] if own else None) for i in which}
        while batch.sequences:
            batch.step()
            for s in [s for s in batch.sequences if len(s.new_ids) == 10]:  # each reads its prompt and 9 new tokens
                batch.remove(s)
        return {i: (s.new_ids, s.avg_bits) for i, s in seqs.items()}

    together = run([0, 1])
    for i in (0, 1):
        assert together[i] == run([i])[i]
        set_precision(model, settings[i])
        assert together[i][0] == run([i], own=False)[i][0]
        assert low - 1e-6 <= together[i][1] <= high + 1e-6
    assert together[0][1] < together[1][1]
    with pytest.raises(ValueError, match="out of this checkpoint's routed range"):
        Batch(model, 64).add([1, 2], 8, sampler(0.0), avg_bits=high + 1)
    with pytest.raises(ValueError, match="no slice routers"):
        Batch(make_tiny("llama"), 64).add([1, 2], 8, sampler(0.0), avg_bits=3.0)


def test_a_running_sequence_routed_anew_uses_the_new_bits_from_its_next_step(routed_tiny):
    """`Batch.route` mid-run (elastic mode): a sequence moved from the high setting to the low one after its prompt
    used fewer bits than at the high setting throughout and more than at the low one."""
    model, _ = load_quantized(routed_tiny / "saved", runtime="bitquilt")
    low, high = precision_range(model)
    settings = (low + 0.1 * (high - low), high - 0.1 * (high - low))

    def run(bits: float, then: float | None = None) -> float:
        batch = Batch(model, 64, "auto", chunk=4)
        seq = batch.add([7, 8, 9, 10, 11, 12], 24, sampler(0.0), bits)
        for _ in range(2):  # the prompt, 4 tokens a step
            batch.step()
        if then is not None:
            batch.route([seq], then)
        for _ in range(12):
            batch.step()
        return seq.avg_bits

    assert run(settings[1]) > run(settings[1], then=settings[0]) > run(settings[0])
