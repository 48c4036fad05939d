"""Command-line flag values checked before any work by the command lines that have them (`bitquilt`, `bitquilt-run`;
`bitquilt-native` checks the same in C++, csrc/runtime/native_runner.cpp): numbers in their ranges, a prompt that is
text. A value out of range gets one line naming the flag and what it accepts, where it would otherwise wrap in a C
integer (a 2**32 thread count read as 0), overflow a sequence length, or fail deep inside torch or the tokenizer. Also
the two type tests the Python API's checks share (a bool is an int to Python, never a count here). Imports nothing
heavy: `bitquilt-run` uses it without torch."""

from __future__ import annotations

import math
from typing import Any

from bitquilt.errors import UserError

INT32_MAX = 2**31 - 1
MAX_THREADS = 1024
MAX_SEED = 2**63 - 1

# dest -> (lowest, highest or None): every flag of that dest on every command; floats must also be finite.
RANGES: dict[str, tuple[float, float | None]] = {
    "seqlen": (2, INT32_MAX), "ppl_windows": (1, INT32_MAX), "limit": (1, INT32_MAX), "calib_samples": (1, INT32_MAX),
    "calib_seqlen": (16, INT32_MAX), "max_new_tokens": (1, INT32_MAX), "prompt_tokens": (1, INT32_MAX),
    "new_tokens": (2, INT32_MAX), "repeats": (1, INT32_MAX), "temperature": (0, None), "threads": (1, MAX_THREADS),
    "seed": (0, MAX_SEED), "port": (1, 65535), "max_queue": (0, INT32_MAX), "max_batch": (1, INT32_MAX),
    "max_prompt_tokens": (1, INT32_MAX), "max_tokens": (1, INT32_MAX), "max_body_bytes": (1, INT32_MAX),
    "elastic": (0, None),
}


def is_integer(value: Any) -> bool:
    """An int that is not a bool (True would otherwise count as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_flags(args: Any) -> None:
    """Raise UserError for the first flag of `args` (an argparse namespace) outside its RANGES entry, or a --prompt
    that is not UTF-8 (the bytes of argv that are not reach Python as lone surrogates, which no tokenizer takes)."""
    prompt = getattr(args, "prompt", None)
    if isinstance(prompt, str):
        try:
            prompt.encode()
        except UnicodeEncodeError as e:
            raise UserError(f"--prompt is not UTF-8 text (an invalid byte at character {e.start}); pass the text "
                            "in UTF-8") from None
    for dest, (low, high) in RANGES.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{flag} must be a finite number, got {value}")
        if value < low:
            raise UserError(f"{flag} must be ≥ {low}, got {value}")
        if high is not None and value > high:
            raise UserError(f"{flag} must be ≤ {high}, got {value}")


ROUTED_SLACK = 1e-6  # bits: a routed range's ends as printed and read back still fall inside it


def in_routed_range(avg_bits: float, low: float, high: float) -> bool:
    """Whether `avg_bits` lies within a MoBiQuant checkpoint's routed range [low, high] (ROUTED_SLACK either side)."""
    return low - ROUTED_SLACK <= avg_bits <= high + ROUTED_SLACK
