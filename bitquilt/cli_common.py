"""What every `bitquilt` command shares, and nothing that quantizes: printing tables and JSON, the numeric flag
minimums, thread count, the model argument's help and the --int8-activations flag. Imported by the run-time
commands (`bitquilt.cli`: generate, bench) and the rest (`bitquilt.commands`), so neither imports the other's
dependencies."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from bitquilt.errors import UserError
from bitquilt.models.registry import DEFAULT_MODEL
from bitquilt.tables import markdown_table

MODEL_HELP = (f"packaged model name (e.g. {DEFAULT_MODEL}; see `bitquilt models`), a Hugging Face directory, a .gguf "
              "file, or a directory saved by `bitquilt quantize`")
# The lowest value of numeric flags (by dest) that would otherwise be checked only after loading a model, or not at
# all; checked before any work. (Recipe flags are checked when the recipe is built, bench's by its speed check.)
MINIMUMS = {"seqlen": 1, "ppl_windows": 1, "limit": 1, "calib_samples": 1, "calib_seqlen": 16, "temperature": 0,
            "threads": 1}


def check_minimums(args) -> None:
    """Refuse a numeric flag below its MINIMUMS value before anything is loaded."""
    for dest, low in MINIMUMS.items():
        value = getattr(args, dest, None)
        if value is not None and value < low:
            raise UserError(f"--{dest.replace('_', '-')} must be ≥ {low}, got {value}")


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    print(markdown_table(rows, columns), end="")


def finite_or_null(obj: Any) -> Any:
    """`obj` with every NaN/Inf float, however nested, replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def print_json(obj: Any) -> None:
    """Valid JSON (which has no NaN/Inf: they print as null)."""
    print(json.dumps(finite_or_null(obj), indent=2, default=str, allow_nan=False))


def set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def add_int8_activations(s: argparse.ArgumentParser) -> None:
    """--int8-activations of the commands that run a model (eval, generate, bench)."""
    s.add_argument("--int8-activations", action="store_true",
                   help="let 4- and 2-bit uniform linears round their input to int8 per block of 32 (faster on CPU, "
                   "llama.cpp's Q8 activations; not exact: the perplexity cost is in docs/benchmarks.md)")
