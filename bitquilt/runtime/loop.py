"""The decode loop every runtime shares, free of any tensor library: prompt, then one token at a time.

`run_decode(step, prompt, max_new_tokens, pick, stop_ids)` calls `step(ids)` (logits of the last of `ids`,
appended to the sequence's cache) on the prompt, then on each new token, `pick(logits)` choosing it, until
`max_new_tokens` or a stop id; it times the prompt (prefill) and the steps after it (decode) apart. A pick that
returns a negative id found NaN or Inf among the logits: the loop stops with `NON_FINITE` (a ValueError, one line and
exit code 2 on the command lines) instead of emitting a token chosen from garbage. The torch
runtimes (`bitquilt.runtime.engines.decode`) and the standalone runtime (`bitquilt.runtime.standalone.generate`)
bring their own step and pick.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bitquilt.flag_checks import is_integer, is_number

NON_FINITE = ("the model's logits are NaN or infinite, so it has no next token: its weights or scales hold NaN/Inf "
              "(a diverged quantization, or a damaged or edited file); check them with `bitquilt eval`")


PREFILL_CHUNK = 16  # prompt tokens a batch step reads for a joining sequence while others decode
IDLE_CHUNK = 256  # ... while none does: a lone prompt holds no stream up, so it is read in few steps


def prompt_chunk(pending: int, decoding: bool, chunk: int = PREFILL_CHUNK, idle_chunk: int = IDLE_CHUNK) -> int:
    """How many of a joining sequence's `pending` prompt ids a batch step reads (both runtimes' batches): `chunk`
    while other sequences decode in the same step (each waits for the chunk), `idle_chunk` while none does."""
    return min(chunk if decoding else idle_chunk, pending)


def picked(seq: Any, logits: Any) -> tuple[Any, int]:
    """A batch's sequence (either runtime's: `pick`, `pending`, `new_ids`), its input all read, with its next token
    picked from `logits`, and that token pending (read next); the token is -1 for logits that are not all finite."""
    token = seq.pick(logits)
    seq.pending = [token]
    if token >= 0:
        seq.new_ids.append(token)
    return seq, token


@dataclass
class DecodeRun:
    new_ids: list[int]
    prefill_seconds: float  # prompt forward + first token
    decode_seconds: float  # the remaining tokens
    engine: str = ""  # what ran the steps (fused, lean, transformers; the standalone runtime's kernel path)


def run_decode(step: Callable[[Sequence[int]], Any], prompt: Sequence[int], max_new_tokens: int,
               pick: Callable[[Any], int], stop_ids: set[int] | None = None,
               on_token: Callable[[int], bool | None] | None = None) -> DecodeRun:
    """Continue `prompt` (module docstring); `on_token` sees each new token as it is picked (streaming output) and
    ends the run there by returning True (a stop string, a client gone); `pick` returns -1 for logits that are not
    all finite.
    The caller checks its settings first (`check_generation`), before it sizes a cache for them."""
    if len(prompt) == 0:
        raise ValueError("decode needs a non-empty prompt")
    def next_token(ids: Sequence[int]) -> int:
        token = pick(step(ids))
        if token < 0:
            raise ValueError(NON_FINITE)
        return token

    t0 = time.perf_counter()
    token = next_token(prompt)
    t1 = time.perf_counter()
    new_ids = [token]
    ended = on_token is not None and bool(on_token(token))
    while not ended and len(new_ids) < max_new_tokens and not (stop_ids and token in stop_ids):
        token = next_token([token])
        new_ids.append(token)
        ended = on_token is not None and bool(on_token(token))
    return DecodeRun(new_ids, t1 - t0, time.perf_counter() - t1)


def check_generation(max_new_tokens: int, temperature: float, top_p: float = 1.0) -> None:
    """What every runtime's generation takes: at least one new token, a finite temperature ≥ 0 (0: greedy) and a
    nucleus `top_p` in (0, 1]."""
    if not is_integer(max_new_tokens):
        raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if not is_number(temperature):
        raise ValueError(f"temperature must be a number, got {temperature!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number ≥ 0 (0: greedy), got {temperature}")
    if not is_number(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")


def generation_stats(prompt_tokens: int, run: DecodeRun) -> dict[str, float | int | None]:
    """What `bitquilt generate` and `bitquilt-run` report of a run: token counts and prefill / decode tokens/s (the
    decode rate over the tokens after the first; None with a single token)."""
    n = len(run.new_ids)
    return {"prompt_tokens": prompt_tokens, "new_tokens": n,
            "prefill_tokens_per_s": prompt_tokens / run.prefill_seconds,
            "decode_tokens_per_s": (n - 1) / run.decode_seconds if n > 1 else None}


def stats_line(stats: dict[str, Any]) -> str:
    """A run's figures on one line, `key=value` (numbers to 4 significant digits; None left out)."""
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items() if v is not None)


def check_speed_settings(prompt_tokens: int, new_tokens: int, repeats: int, vocab_size: int = 2) -> None:
    """The settings of a speed measurement (`bitquilt bench`): a prompt, at least one decode step, one run, and a
    vocabulary (of at least two ids) to draw the random prompt from."""
    named = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats, "vocab_size": vocab_size}
    wrong = [f"{name}={value!r}" for name, value in named.items() if not is_integer(value)]
    if wrong:
        raise ValueError(f"speed settings must be integers, got {', '.join(wrong)}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2 (the prompt is drawn from it), got {vocab_size}")
    if prompt_tokens < 1 or new_tokens < 2 or repeats < 1:
        raise ValueError(f"need prompt_tokens >= 1, new_tokens >= 2 and repeats >= 1, got {prompt_tokens}, "
                         f"{new_tokens} and {repeats}")


def median_rates(runs: Sequence[DecodeRun], prompt_tokens: int) -> tuple[float, float]:
    """Prefill and decode tokens/s of repeated runs on one prompt, each the median over the runs (decode: per step
    after the first token): what every runtime's speed measurement reports."""
    prefill = statistics.median(r.prefill_seconds for r in runs)
    per_token = statistics.median(r.decode_seconds / (len(r.new_ids) - 1) for r in runs)
    return prompt_tokens / prefill, 1.0 / per_token
