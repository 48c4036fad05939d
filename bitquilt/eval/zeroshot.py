"""Zero-shot scoring engine: log-likelihoods of continuations, lm-eval's metrics, cached results.

How the scores match lm-evaluation-harness (HFLM, v0.4):

- Tokenization: trailing whitespace of a context moves onto its continuation; the continuation's
  tokens are ``encode(context + continuation)[len(encode(context)):]`` and the model reads
  ``encode(context) + continuation tokens``, left-truncated to the model's maximum length. An empty
  context becomes the BOS token (EOS when there is none). No other special tokens are added.
- acc: the choice with the highest summed log-likelihood (first on ties) is the gold one.
- acc_norm: the same with each log-likelihood divided by the length of the choice text in characters
  (Python ``len``, without the leading space), exactly lm-eval's ``acc_norm``; this equals the UTF-8
  byte length for ASCII text (lm-eval's separate ``acc_bytes`` is not computed).
- lambada acc: greedy decoding reproduces every target token; perplexity is
  ``exp(-mean over items of the target's summed log-likelihood)``, lm-eval's per-document perplexity.
- ``*_stderr``: sample standard error of the mean (ddof=1) of acc / acc_norm, as lm-eval reports
  (none for perplexity, which lm-eval bootstraps).

Deviations from lm-eval:

- BOS: lm-eval never adds special tokens for causal LMs unless ``add_bos_token=True``; here the BOS
  token is prepended whenever the model's tokenizer adds it by default (Llama-2-style tokenizers),
  i.e. lm-eval's ``add_bos_token=True`` for those. SmolLM2 and Qwen tokenizers add none, so for them
  the inputs are identical.
- ``limit``: a fixed random sample of N items (``seed``), not lm-eval's first N.
- Batching: the tokens all choices of an item share (the context) run once and are reused through
  the KV cache (faster than padding every choice where contexts are long), and padding differs from
  lm-eval's, so log-likelihoods differ at float rounding level only (≈1e-5 in float32).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bitquilt.cache import atomic_file, cache_dir
from bitquilt.errors import UserError
from bitquilt.eval.precision import eval_precision, evaluating_in
from bitquilt.eval.tasks import Item, Task, load_task, subset
from bitquilt.progress import progress_bar

log = logging.getLogger(__name__)

SCORING_VERSION = 1  # bump when scoring changes, to invalidate cached results


@dataclass
class _Row:
    """One choice of one item: the token sequence and where its continuation starts."""

    item: int
    choice: int
    tokens: list[int]
    cont_start: int


# ---------------------------------------------------------------- tokenization
def _bos_prefix(tokenizer: Any) -> list[int]:
    bos = tokenizer.bos_token_id
    return [bos] if bos is not None and tokenizer("a")["input_ids"][:1] == [bos] else []


def _encode_requests(items: list[Item], tokenizer: Any, max_len: int) -> list[list[_Row]]:
    """Token rows per item (lm-eval's ``_encode_pair``); choices whose continuation has no tokens are left out."""
    prefix = _bos_prefix(tokenizer)
    empty_ctx = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id]

    def encode(text: str) -> list[int]:
        return prefix + tokenizer(text, add_special_tokens=False)["input_ids"]

    out = []
    for i, item in enumerate(items):
        rows = []
        for c, (ctx, cont) in enumerate(zip(item.contexts, item.continuations)):
            n_space = len(ctx) - len(ctx.rstrip())
            ctx, cont = ctx[:len(ctx) - n_space], ctx[len(ctx) - n_space:] + cont
            ctx_ids = encode(ctx)
            cont_ids = encode(ctx + cont)[len(ctx_ids):]
            ctx_ids = ctx_ids or empty_ctx
            if not cont_ids:
                continue
            tokens = ctx_ids + cont_ids
            drop = max(0, len(tokens) - (max_len + 1))
            rows.append(_Row(i, c, tokens[drop:], max(1, len(ctx_ids) - drop)))
        out.append(rows)
    return out


def _shared_prefix(rows: list[_Row]) -> int:
    """Tokens every row of an item shares before its first scored position: computed once, then cached."""
    n = min(r.cont_start for r in rows)
    first = rows[0].tokens
    for r in rows[1:]:
        n = next((k for k, (a, b) in enumerate(zip(first[:n], r.tokens[:n])) if a != b), n)
    return max(n - 1, 0)  # the last shared token is fed with the rest, so its logits come from the second pass


def _max_length(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions", "n_ctx"):
        if isinstance(getattr(config, attr, None), int):
            return getattr(config, attr)
    return 2048


# ---------------------------------------------------------------- scoring
def _batches(groups: list[tuple[int, list[_Row]]], batch_size: int):
    """Consecutive runs of items holding at most ``batch_size`` rows; prefix and no-prefix items apart."""
    batch: list[tuple[int, list[_Row]]] = []
    for k, rows in groups:
        if batch and (sum(len(r) for _, r in batch) + len(rows) > batch_size or (batch[-1][0] > 0) != (k > 0)):
            yield batch
            batch = []
        batch.append((k, rows))
    if batch:
        yield batch


def _pad(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and their attention mask."""
    n = max(len(x) for x in seqs)
    ids = torch.tensor([x + [0] * (n - len(x)) for x in seqs], device=device)
    mask = torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x in seqs], device=device)
    return ids, mask


@torch.inference_mode()
def _score_batch(model: nn.Module, batch: list[tuple[int, list[_Row]]], device: torch.device):
    """(row, log-likelihood, greedy) for every row: one pass over the shared prefixes, one over the rests."""
    rows = [r for _, rs in batch for r in rs]
    k_of_row = [k for k, rs in batch for _ in rs]
    ids, mask = _pad([r.tokens[k:-1] for r, k in zip(rows, k_of_row)], device)
    position_ids = torch.tensor(k_of_row, device=device)[:, None] + torch.arange(ids.shape[1], device=device)
    cache = None
    if k_of_row[0] > 0:  # batches never mix items with and without a shared prefix
        pids, pmask = _pad([rs[0].tokens[:k] for k, rs in batch], device)
        out = model(input_ids=pids, attention_mask=pmask, use_cache=True, logits_to_keep=1,
                    position_ids=torch.arange(pids.shape[1], device=device).expand_as(pids))
        item_of_row = torch.tensor([j for j, (_, rs) in enumerate(batch) for _ in rs], device=device)
        cache = out.cache
        cache.reorder_cache(item_of_row)
        mask = torch.cat([pmask[item_of_row], mask], dim=1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, cache=cache,
                   use_cache=cache is not None).logits
    if cache is not None and cache.get_seq_length() != mask.shape[1]:
        raise RuntimeError("the model ignored the KV cache passed as `cache=` (transformers too old?)")
    # Positions whose logits predict continuation tokens, and those tokens.
    where = [(i, j, r.tokens[k + 1 + j]) for i, (r, k) in enumerate(zip(rows, k_of_row))
             for j in range(r.cont_start - 1 - k, len(r.tokens) - 1 - k)]
    row_idx, pos_idx, target = (torch.tensor(x, device=device) for x in zip(*where))
    picked = logits[row_idx, pos_idx].float()
    logp = torch.log_softmax(picked, dim=-1).gather(1, target[:, None])[:, 0]
    hit = picked.argmax(dim=-1) == target
    ll = torch.zeros(len(rows), dtype=torch.float64).index_add_(0, row_idx.cpu(), logp.double().cpu())
    misses = torch.zeros(len(rows), dtype=torch.long).index_add_(0, row_idx.cpu(), (~hit).long().cpu())
    return [(r, float(v), int(m) == 0) for r, v, m in zip(rows, ll, misses)]


def score_items(model: nn.Module, tokenizer: Any, items: list[Item], batch_size: int = 32,
                desc: str | None = None) -> list[list[tuple[float, bool]]]:
    """Per item, per choice: (summed log-likelihood of the continuation, greedy decoding reproduces it).

    ``batch_size`` counts choices per forward pass; ``desc`` shows a progress bar with that label.
    """
    if batch_size < 1:
        raise UserError(f"batch size must be ≥ 1, got {batch_size}")
    scores = [[(0.0, True)] * len(it.contexts) for it in items]
    encoded = _encode_requests(items, tokenizer, _max_length(model))
    groups = sorted(((_shared_prefix(rows), rows) for rows in encoded if rows),
                    key=lambda g: (-g[0], -max(len(r.tokens) for r in g[1])))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with progress_bar(total=len(items), desc=desc, disable=desc is None, unit="item") as bar:
            bar.update(len(items) - len(groups))
            for batch in _batches(groups, batch_size):
                for row, ll, greedy in _score_batch(model, batch, device):
                    scores[row.item][row.choice] = (ll, greedy)
                bar.update(len(batch))
    finally:
        model.train(was_training)
    return scores


# ---------------------------------------------------------------- metrics
def _first_argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _mean_and_stderr(hits: list[bool]) -> tuple[float, float]:
    n, p = len(hits), sum(hits) / len(hits)
    return p, math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0


def task_metrics(task: Task, items: list[Item], scores: list[list[tuple[float, bool]]]) -> dict[str, float]:
    """lm-eval's metrics (see the module docstring) for ``task.metrics``, with standard errors."""
    out: dict[str, float] = {}
    for metric in task.metrics:
        if metric == "perplexity":
            out[metric] = math.exp(-sum(s[0][0] for s in scores) / len(scores))
            continue
        if metric == "acc" and "perplexity" in task.metrics:  # lambada: greedy match of the one target
            hits = [s[0][1] for s in scores]
        elif metric == "acc":
            hits = [_first_argmax([ll for ll, _ in s]) == it.gold for it, s in zip(items, scores)]
        else:
            hits = [_first_argmax([ll / n for (ll, _), n in zip(s, it.norm_lens)]) == it.gold
                    for it, s in zip(items, scores)]
        out[metric], out[f"{metric}_stderr"] = _mean_and_stderr(hits)
    return out


def primary_metric(metrics: dict[str, float]) -> float:
    """The accuracy that summarises a task: acc_norm where reported, else acc."""
    return metrics.get("acc_norm", metrics["acc"])


def average_accuracy(results: dict[str, dict[str, float]]) -> float:
    """Mean over tasks of their primary accuracy."""
    return sum(primary_metric(m) for m in results.values()) / len(results)


# ---------------------------------------------------------------- caching
def model_fingerprint(model: nn.Module, tokenizer: Any) -> str:
    """Hash of the config, module types, every tensor's shape/dtype/sum and a strided sample, and the tokenizer.

    Quantizing, or any change to the weights, gives a different fingerprint.
    """
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    h.update(config.to_json_string().encode() if hasattr(config, "to_json_string") else b"")
    h.update(",".join(type(m).__name__ for m in model.modules()).encode())
    with torch.no_grad():
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            if t.is_meta or t.numel() == 0:
                continue
            flat = t.detach().reshape(-1)
            h.update(f"{flat.sum(dtype=torch.float64).item()!r}".encode())
            h.update(flat[:: max(1, flat.numel() // 1024)].contiguous().cpu().view(torch.uint8).numpy().tobytes())
    probe = tokenizer("Hello world!\n  x")["input_ids"]
    h.update(f"{type(tokenizer).__name__}|{getattr(tokenizer, 'name_or_path', '')}|{len(tokenizer)}|{probe}".encode())
    return h.hexdigest()[:24]


def _cache_path(fingerprint: str, task: Task, limit: int | None, seed: int) -> Path:
    key = json.dumps([SCORING_VERSION, fingerprint, task.name, task.digest(), limit, seed])
    return cache_dir() / "evals" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _read_cached(path: Path) -> dict[str, float] | None:
    try:
        return json.loads(path.read_text())["metrics"]
    except (OSError, ValueError, KeyError):
        return None


def _write_cached(path: Path, record: dict[str, Any]) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(record, indent=1))


# ---------------------------------------------------------------- entry point
def evaluate_tasks(model: nn.Module, tokenizer: Any, tasks: list[str], limit: int | None = None, seed: int = 0,
                   batch_size: int = 32, cache_key: str | None = None,
                   progress: bool = True, precision: str = "fp32") -> dict[str, dict[str, float]]:
    """Zero-shot metrics per task: acc / acc_norm / perplexity (+ ``*_stderr``), ``n`` items and ``seconds``.

    ``tasks`` are built-in names (see ``bitquilt.eval.tasks``) or paths to .jsonl task files. ``limit``
    scores a fixed random subset of that many items per task (``seed`` picks it). Results are cached
    under ``cache_dir()/evals`` by the model's weight fingerprint, ``cache_key`` (an extra string the
    caller may add, e.g. a recipe), the task's data and prompts, ``limit`` and ``seed``; ``seconds``
    is the time of the run that filled the cache. ``precision`` (fp32, bf16, auto: `bitquilt.eval.precision`) is
    what the forward passes multiply in; results other than fp32's are cached apart.
    """
    loaded = [load_task(name) for name in tasks]
    precision = eval_precision(precision)
    fingerprint = f"{model_fingerprint(model, tokenizer)}|{cache_key or ''}"
    if precision != "fp32":
        fingerprint += f"|{precision}"
    results: dict[str, dict[str, float]] = {}
    for task in loaded:
        path = _cache_path(fingerprint, task, limit, seed)
        cached = _read_cached(path)
        if cached is not None:
            log.info("%s: cached result %s", task.name, path)
            results[task.name] = cached
            continue
        items = subset(task.items, limit, seed)
        t0 = time.perf_counter()
        with evaluating_in(model, precision):
            scores = score_items(model, tokenizer, items, batch_size, desc=task.name if progress else None)
        metrics = {**task_metrics(task, items, scores), "n": len(items), "seconds": time.perf_counter() - t0}
        _write_cached(path, {"task": task.name, "split": task.split, "limit": limit, "seed": seed,
                             "metrics": metrics})
        results[task.name] = metrics
    return results
