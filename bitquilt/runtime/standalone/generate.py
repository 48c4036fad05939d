"""Text from a standalone model: the shared decode loop (`bitquilt.runtime.loop`) with the C library's sampling.

Greedy at temperature 0, else one draw from softmax(logits / temperature) (`bq_sample`) at a uniform number from
Python's generator seeded by `seed` (reproducible here, not the same draws as the torch runtimes' generator).
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bitquilt.errors import UserError
from bitquilt.isa import INT8_ISAS
from bitquilt.resources import peak_rss_mb
from bitquilt.runtime.loop import (
    DecodeRun,
    check_generation,
    check_speed_settings,
    generation_stats,
    median_rates,
    run_decode,
)
from bitquilt.runtime.standalone.library import library
from bitquilt.runtime.standalone.model import StandaloneModel


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    run: DecodeRun
    avg_bits: float | None = None  # a MoBiQuant export's: the bits per weight its tokens used on average

    def stats(self) -> dict[str, float | int | str | None]:
        return {"engine": self.run.engine, **generation_stats(self.prompt_tokens, self.run), "avg_bits": self.avg_bits}


def picker(temperature: float = 0.0, seed: int = 0, top_p: float = 1.0) -> Callable[[array], int]:
    """logits (fp32 `array.array`) -> token: argmax at temperature 0, else a draw from softmax(logits / temperature)
    (from the fewest most likely tokens whose probability reaches `top_p`); -1 when the logits are not all finite
    (`run_decode` says so)."""
    lib = library()
    if temperature <= 0:
        return lambda logits: lib.bq_argmax(logits.buffer_info()[0], len(logits))
    draws = random.Random(seed)
    return lambda logits: lib.bq_sample(logits.buffer_info()[0], len(logits), temperature, top_p, draws.random())


def generate_ids(model: StandaloneModel, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, stop_ids: set[int] | None = None,
                 on_token: Callable[[int], None] | None = None) -> DecodeRun:
    """New token ids after `prompt` (and the prefill and decode seconds), from an empty sequence; `on_token` sees each
    as it comes."""
    check_generation(max_new_tokens, temperature)
    if not prompt:
        raise UserError("the prompt has no tokens; give the text to continue")
    model.begin(len(prompt) + max_new_tokens)
    run = run_decode(model.forward, prompt, max_new_tokens, picker(temperature, seed), stop_ids, on_token)
    run.engine = f"standalone ({INT8_ISAS[library().bq_active_isa()]} kernels)"
    return run


def generate(model: StandaloneModel, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
             ignore_eos: bool = False, on_text: Callable[[str], None] | None = None) -> Generation:
    """Continue `prompt` (text), stopping at the tokenizer's end-of-sequence token unless `ignore_eos`; `on_text`
    receives the completion piece by piece as tokens come (a piece held back while it ends inside a character)."""
    if not isinstance(prompt, str):
        raise UserError(f"the prompt must be text (str), got {type(prompt).__name__}; token ids go to generate_ids")
    if not prompt:
        raise UserError("--prompt is empty; give the text to continue")
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise UserError(f"{model.directory} has no tokenizer files; cannot generate text")
    ids = tokenizer.encode(prompt)
    eos = tokenizer.eos_token_id
    new_ids: list[int] = []
    shown = [""]

    def stream(token: int) -> None:
        new_ids.append(token)
        text = tokenizer.decode(new_ids, skip_special_tokens=True)
        if not text.endswith("\ufffd") and len(text) > len(shown[0]) and text.startswith(shown[0]):
            on_text(text[len(shown[0]):])
            shown[0] = text

    run = generate_ids(model, ids, max_new_tokens, temperature, seed, None if ignore_eos or eos is None else {eos},
                       stream if on_text is not None else None)
    text = tokenizer.decode(run.new_ids, skip_special_tokens=True)
    if on_text is not None and len(text) > len(shown[0]) and text.startswith(shown[0]):
        on_text(text[len(shown[0]):])
    return Generation(text, len(ids), run, model.routed_bits())


def measure_speed(model: StandaloneModel, prompt_tokens: int = 128, new_tokens: int = 32, repeats: int = 3,
                  seed: int = 0) -> dict[str, Any]:
    """Median prefill and decode throughput over `repeats` greedy runs on a random-token prompt, after a short
    warm-up: `bitquilt.eval.speed.measure_speed`'s protocol and fields (`bitquilt bench`), for a standalone export."""
    check_speed_settings(prompt_tokens, new_tokens, repeats)
    draws = random.Random(seed)
    prompt = [draws.randrange(model.vocab_size) for _ in range(prompt_tokens)]
    generate_ids(model, prompt[:8], 2)  # warm-up: the first pages of the mapping, the allocator
    runs = [generate_ids(model, prompt, new_tokens) for _ in range(repeats)]
    prefill, decode = median_rates(runs, prompt_tokens)
    return {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "prefill_tokens_per_s": prefill,
            "decode_tokens_per_s": decode, "weights_mb": model.size_mb(), "kernel_layout_mb": 0.0,
            "peak_rss_mb": peak_rss_mb(), "threads": library().bq_threads()}
