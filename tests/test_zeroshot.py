"""Zero-shot evaluation: exact scoring on a controlled model, task loading, user tasks, caching, real model."""

from __future__ import annotations

import json
import math
import re
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from bitquilt.errors import UserError
from bitquilt.eval import zeroshot
from bitquilt.eval.tasks import TASK_NAMES, Item, Task, choice_item, load_task, subset
from bitquilt.eval.zeroshot import evaluate_tasks, score_items, task_metrics
from tests.conftest import make_tiny

CHARS = "^$q ab"  # ^ = BOS, $ = EOS


class CharTokenizer:
    """One token per character of CHARS (others map to EOS); optionally prepends BOS like Llama-2."""

    bos_token_id, eos_token_id, name_or_path = 0, 1, "chars"

    def __init__(self, add_bos: bool = False):
        self.add_bos = add_bos

    def __len__(self) -> int:
        return len(CHARS)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        bos = [self.bos_token_id] if add_special_tokens and self.add_bos else []
        return {"input_ids": bos + [CHARS.find(c) if c in CHARS else 1 for c in text]}


class Bigram(nn.Module):
    """A causal LM whose next-token log-probs depend only on the current token (row of ``logp``).

    It honours the HF calling convention the engine uses (KV cache, ``logits_to_keep``) and counts calls.
    """

    def __init__(self, probs: dict[tuple[str, str], float]):
        super().__init__()
        table = torch.full((len(CHARS), len(CHARS)), 1e-3)
        for (cur, nxt), p in probs.items():
            table[CHARS.index(cur), CHARS.index(nxt)] = p
        table /= table.sum(dim=1, keepdim=True)
        self.logp = nn.Parameter(table.log())
        self.calls = 0

    def forward(self, input_ids, attention_mask, position_ids, cache=None, use_cache=False, logits_to_keep=0):
        self.calls += 1
        assert attention_mask.shape[1] == input_ids.shape[1] + (cache.get_seq_length() if cache is not None else 0)
        if use_cache:
            cache = cache if cache is not None else DynamicCache()
            kv = input_ids[:, None, :, None].float()
            cache.update(kv, kv, 0)
        logits = self.logp[input_ids]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits, cache=cache)


def p(cur: str, nxt: str, probs: dict) -> float:
    row = {n: probs.get((cur, n), 1e-3) for n in CHARS}
    return math.log(row[nxt] / sum(row.values()))


# After "q" a space is likely; after a space "a" (0.3) loses to "b" (0.4), but "bb" (0.4 × 0.6) loses to "a":
# " a" wins on log-likelihood, " bb" on log-likelihood per character. Unlisted transitions get 1e-3.
PROBS = {("q", " "): 0.9, (" ", "a"): 0.3, (" ", "b"): 0.4, (" ", "$"): 0.3, ("b", "b"): 0.6, ("b", "$"): 0.4,
         ("a", "q"): 0.5, ("a", "$"): 0.5, ("^", "q"): 0.5, ("^", "a"): 0.5}


def test_scores_are_exact_sums_of_log_probs():
    model, tok = Bigram(PROBS), CharTokenizer()
    items = [choice_item("q", ["a", "bb"], 0), choice_item("qaq", ["a", "bb"], 1)]
    scores = score_items(model, tok, items, batch_size=3)
    for s in scores:  # the bigram model ignores everything before the last context token
        assert s[0][0] == pytest.approx(p("q", " ", PROBS) + p(" ", "a", PROBS), abs=1e-5)
        assert s[1][0] == pytest.approx(p("q", " ", PROBS) + p(" ", "b", PROBS) + p("b", "b", PROBS), abs=1e-5)
        assert [g for _, g in s] == [False, True]  # greedy after " " is "b", after "b" is "b"


def test_acc_and_acc_norm_differ_as_lm_eval_defines_them():
    model, tok = Bigram(PROBS), CharTokenizer()
    items = [choice_item("q", ["a", "bb"], 0), choice_item("aq", ["a", "bb"], 0), choice_item("q", ["a", "bb"], 1)]
    task = Task("toy", "test", ("acc", "acc_norm"), items)
    m = task_metrics(task, items, score_items(model, tok, items))
    assert m["acc"] == pytest.approx(2 / 3) and m["acc_norm"] == pytest.approx(1 / 3)
    assert m["acc_stderr"] == pytest.approx(math.sqrt(2 / 9 / 2))


ITEMS = [choice_item("q", ["a", "bb"], 0), choice_item("qaqaq", ["ab", "b", "ba"], 2),
         Item(("qa", "qb"), (" ab", " ab"), 1, (2, 2)),  # winogrande-style: shared continuation
         Item(("aq",), (" bba",), 0, (3,)), Item(("",), ("q",), 0, (1,)), choice_item("a", ["a"] * 3, 0)]


def _flat(scores):
    return [ll for s in scores for ll, _ in s]


def test_batching_and_prefix_sharing_do_not_change_scores():
    model, tok = Bigram(PROBS), CharTokenizer()
    one = score_items(model, tok, ITEMS, batch_size=1)
    assert _flat(one) == pytest.approx(_flat(score_items(model, tok, ITEMS, batch_size=64)), abs=1e-5)
    assert one[4][0][0] == pytest.approx(p("^", "q", PROBS), abs=1e-5)  # empty context = BOS, as in lm-eval


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_kv_cache_scoring_matches_full_sequences_on_a_transformer(family):
    model, tok = make_tiny(family), CharTokenizer()
    got = score_items(model, tok, ITEMS, batch_size=5)
    want = []
    for rows in zeroshot._encode_requests(ITEMS, tok, 512):  # lm-eval: one full sequence per choice
        for r in rows:
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([r.tokens[:-1]])).logits[0], -1)
            want.append(sum(logp[i - 1, t].item() for i, t in enumerate(r.tokens) if i >= r.cont_start))
    assert _flat(got) == pytest.approx(want, abs=1e-4)


def test_bos_is_prepended_only_when_the_tokenizer_adds_it():
    item = [choice_item("q", ["a"], 0)]
    assert zeroshot._encode_requests(item, CharTokenizer(add_bos=False), 64)[0][0].tokens == [2, 3, 4]
    assert zeroshot._encode_requests(item, CharTokenizer(add_bos=True), 64)[0][0].tokens == [0, 2, 3, 4]


def test_trailing_context_space_moves_to_the_continuation():
    row = zeroshot._encode_requests([choice_item("q ", ["a"], 0)], CharTokenizer(), 64)[0][0]
    assert row.tokens == [2, 3, 3, 4] and row.cont_start == 1  # "q" | "  a"
    row = zeroshot._encode_requests([Item((" ",), ("q",), 0, (1,))], CharTokenizer(), 64)[0][0]
    assert row.tokens == [0, 3, 2] and row.cont_start == 1  # nothing left of the context: BOS | " q"


def test_lambada_metrics_are_greedy_match_and_per_document_perplexity():
    model, tok = Bigram(PROBS), CharTokenizer()
    items = [Item(("q",), (" b",), 0, (1,)), Item(("q",), (" a",), 0, (1,))]
    m = task_metrics(Task("lambada", "t", ("acc", "perplexity"), items), items, score_items(model, tok, items))
    lls = [p("q", " ", PROBS) + p(" ", x, PROBS) for x in "ba"]
    assert m["acc"] == 0.5 and m["perplexity"] == pytest.approx(math.exp(-sum(lls) / 2), rel=1e-5)


def test_user_task_is_cached_per_model(tmp_path, monkeypatch):
    monkeypatch.setenv("BITQUILT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "toy.jsonl"
    lines = [{"context": "q", "choices": ["a", "bb"], "gold": g, "id": i} for i, g in enumerate([0, 0, 1])]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    model, tok = Bigram(PROBS), CharTokenizer()
    first = evaluate_tasks(model, tok, [str(path)], progress=False)[str(path)]
    assert (first["acc"], first["acc_norm"], first["n"]) == (pytest.approx(2 / 3), pytest.approx(1 / 3), 3)
    calls = model.calls
    t0 = time.perf_counter()
    assert evaluate_tasks(model, tok, [str(path)], progress=False)[str(path)] == first
    assert model.calls == calls and time.perf_counter() - t0 < 1.0  # cache hit: no forward pass
    assert len(list((tmp_path / "cache" / "evals").glob("*.json"))) == 1
    with torch.no_grad():
        model.logp[2, 3] += 1.0  # changed weights: a new fingerprint, scored again
    evaluate_tasks(model, tok, [str(path)], progress=False)
    assert model.calls > calls
    calls = model.calls
    evaluate_tasks(model, tok, [str(path)], progress=False, cache_key="other")  # caller's extra key
    assert model.calls > calls
    calls = model.calls
    evaluate_tasks(model, tok, [str(path)], progress=False, precision="bf16")  # bf16 results are kept apart
    assert model.calls > calls
    calls = model.calls
    evaluate_tasks(model, tok, [str(path)], progress=False, precision="bf16")
    assert model.calls == calls


@pytest.mark.parametrize("content, message", [
    ('{"context": "q", "choices": ["a", "b"], "gold": 0}\n{"context": "q", ', r"toy.jsonl:2: not valid JSON"),
    ('{"context": "q", "choices": ["a", "b"]}', r"toy.jsonl:1: expected an object"),
    ('{"context": "q", "choices": ["a", "b"], "gold": 2}', r":1: \"gold\" must be an integer index"),
    ('{"context": "q", "choices": ["a", "b"], "gold": true}', r":1: \"gold\" must be"),
    ('\n{"context": "q", "choices": "ab", "gold": 0}', r"toy.jsonl:2: \"choices\" must be a list"),
    ('{"context": 3, "choices": ["a", "b"], "gold": 0}', r":1: \"context\" must be a string"),
    ("\n\n", "has no items"),
])
def test_malformed_user_task_names_the_line(tmp_path, content, message):
    (tmp_path / "toy.jsonl").write_text(content)
    with pytest.raises(UserError, match=message):
        load_task(str(tmp_path / "toy.jsonl"))


def test_user_task_must_be_utf8(tmp_path):
    (tmp_path / "toy.jsonl").write_bytes(b'{"context": "\xff", "choices": ["a", "b"], "gold": 0}')
    with pytest.raises(UserError, match="not UTF-8"):
        load_task(str(tmp_path / "toy.jsonl"))


def test_unknown_task_and_missing_file_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="unknown task 'piqa2'.*piqa, arc_easy, arc_challenge"):
        load_task("piqa2")
    with pytest.raises(UserError, match="does not exist"):
        load_task(str(tmp_path / "nope.jsonl"))
    with pytest.raises(UserError, match="unknown task"):
        evaluate_tasks(Bigram(PROBS), CharTokenizer(), ["nope"])


def test_subset_is_a_fixed_random_sample():
    items = [choice_item("q", ["a", "b"], i % 2) for i in range(50)]
    a, b, c = subset(items, 10, 0), subset(items, 10, 0), subset(items, 10, 1)
    assert a == b and a != c and len(a) == 10 and a != items[:10]
    assert subset(items, None, 0) is items and subset(items, 99, 0) is items
    with pytest.raises(UserError, match="--limit"):
        subset(items, 0, 0)


# ---------------------------------------------------------------- real data and model
@pytest.fixture(scope="module")
def eval_data():
    from bitquilt.data.assets import eval_data_dir

    try:
        return eval_data_dir()
    except UserError as e:
        pytest.skip(str(e))


EXPECTED = {"piqa": 1838, "arc_easy": 2376, "arc_challenge": 1172, "hellaswag": 10042, "winogrande": 1267,
            "boolq": 3270, "lambada": 5153}


def test_builtin_tasks_load_with_lm_eval_prompts(eval_data):
    tasks = {name: load_task(name, eval_data) for name in TASK_NAMES}
    assert {n: len(t.items) for n, t in tasks.items()} == EXPECTED
    piqa = tasks["piqa"].items[0]
    assert piqa.contexts[0].startswith("Question: How do I ready a guinea pig cage") and \
        piqa.contexts[0].endswith("?\nAnswer:") and piqa.continuations[0].startswith(" Provide")
    assert piqa.norm_lens == tuple(len(c) - 1 for c in piqa.continuations)
    hs = tasks["hellaswag"].items[0]
    assert hs.contexts[0] == "Roof shingle removal: A man is sitting on a roof. He" and hs.gold == 3
    texts = [c for it in tasks["hellaswag"].items for c in it.contexts + it.continuations]
    assert not any(re.search(r"\[.*?\]", c) for c in texts)  # WikiHow "[title]"-style markup removed
    wg = tasks["winogrande"].items[0]
    assert wg.contexts == ("Sarah was a much better surgeon than Maria so Sarah",
                           "Sarah was a much better surgeon than Maria so Maria")
    assert wg.continuations == (" always got the easier cases.",) * 2 and wg.gold == 1
    bq = tasks["boolq"].items[0]
    assert bq.contexts[0].startswith("Ethanol fuel -- All biomass") and \
        bq.contexts[0].endswith("\nQuestion: does ethanol take more energy make that produces?\nAnswer:")
    assert bq.continuations == (" no", " yes") and bq.gold == 0
    arc = tasks["arc_challenge"].items
    assert {len(it.contexts) for it in arc} == {3, 4, 5}
    assert all(it.contexts[0].startswith("Question: ") and it.contexts[0].endswith("\nAnswer:") for it in arc)
    lam = tasks["lambada"].items[0]
    assert lam.continuations == (" signs",) and lam.contexts[0].endswith("I don't care about")


@pytest.fixture(scope="module")
def smollm_pair():
    from bitquilt.models.loading import load_model

    try:
        model, tok = load_model("smollm2-135m")
    except UserError as e:
        pytest.skip(str(e))
    torch.manual_seed(0)
    random_model = type(model)(model.config).eval()  # same architecture, random weights
    return model, random_model, tok


def test_real_model_beats_random_weights_on_lambada(smollm_pair, eval_data, tmp_path, monkeypatch):
    """Fast variant: 20 LAMBADA items. Chance is 0 (greedy decoding must produce the exact last word)."""
    monkeypatch.setattr(zeroshot, "cache_dir", lambda: tmp_path)  # fresh results; models and data stay put
    model, random_model, tok = smollm_pair
    real = evaluate_tasks(model, tok, ["lambada"], limit=20, progress=False)["lambada"]
    rand = evaluate_tasks(random_model, tok, ["lambada"], limit=10, progress=False)["lambada"]
    assert rand["acc"] == 0 and real["acc"] >= 0.1, (real, rand)  # fp smollm2-135m: 0.20
    assert real["perplexity"] * 1000 < rand["perplexity"], (real, rand)  # fp: 78 vs 4e6
    calls = []
    monkeypatch.setattr(zeroshot, "score_items", lambda *a, **k: calls.append(a))
    assert evaluate_tasks(model, tok, ["lambada"], limit=20, progress=False)["lambada"] == real
    assert not calls  # the re-run is served from the cache


@pytest.mark.slow
@pytest.mark.parametrize("task, chance", [("piqa", 0.5), ("arc_easy", 0.25)])
def test_real_model_beats_random_weights_limit_200(smollm_pair, eval_data, tmp_path, monkeypatch, task, chance):
    monkeypatch.setattr(zeroshot, "cache_dir", lambda: tmp_path)
    model, random_model, tok = smollm_pair
    real = evaluate_tasks(model, tok, [task], limit=200, progress=False)[task]
    rand = evaluate_tasks(random_model, tok, [task], limit=200, progress=False)[task]
    three_se = 3 * math.sqrt(chance * (1 - chance) / 200)  # of a chance-level score
    assert abs(rand["acc"] - chance) < three_se, rand
    assert real["acc"] > chance + three_se, real  # fp smollm2-135m: piqa 0.645, arc_easy 0.45
