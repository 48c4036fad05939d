"""What the run-time commands (`bitquilt.cli`: generate, bench) and the rest (`bitquilt.commands`) share, and nothing
that quantizes: printing tables and JSON, the model argument's help, the --runtime, --int8-activations and --threads
flags; so neither imports the other's dependencies."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from bitquilt.errors import UserError
from bitquilt.io import RUNTIMES
from bitquilt.models.registry import DEFAULT_MODEL
from bitquilt.tables import markdown_table

MODEL_HELP = (f"packaged model name (e.g. {DEFAULT_MODEL}; see `bitquilt models`), a Hugging Face directory, a .gguf "
              "file, or a directory saved by `bitquilt quantize`")


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


def add_runtime(s: argparse.ArgumentParser, auto: str) -> None:
    """--runtime of the commands that run a saved model (generate, bench, eval); `auto` says what auto picks."""
    s.add_argument("--runtime", choices=RUNTIMES, default="auto",
                   help="what a saved model is loaded into: bitquilt (bitquilt's own module tree, "
                   "llama/mistral/qwen2/qwen3, no transformers import: less memory, a faster start), transformers, "
                   "or auto (" + auto + ")")


def chosen_runtime(args, transformers_only: str | None) -> str:
    """The runtime a saved model loads into: --runtime, or "transformers" when an option runs only on the transformers
    model; `transformers_only` then says which and why, the error for an explicit --runtime bitquilt."""
    if transformers_only is None:
        return args.runtime
    if args.runtime == "bitquilt":
        raise UserError(transformers_only)
    return "transformers"


def add_int8_activations(s: argparse.ArgumentParser) -> None:
    """--int8-activations of the commands that run a model (eval, generate, bench)."""
    s.add_argument("--int8-activations", action="store_true",
                   help="let 4-, 2- and 8-bit uniform linears and MoBiQuant slices round their input to int8 per block "
                   "of 32 (faster on CPU, llama.cpp's Q8 activations; not exact: the perplexity cost is in "
                   "docs/speed.md)")


def add_threads(s: argparse.ArgumentParser) -> None:
    """The --threads flag (its range is checked with the others: `bitquilt.flag_checks.RANGES`)."""
    s.add_argument("--threads", type=int, default=None,
                   help="CPU threads of torch and of bitquilt's kernels, an integer ≥ 1 (default: torch's, every core)")


def set_threads(threads: int | None) -> None:
    """Run torch, and the compiled kernels (which split their work with torch's thread pool), on `threads` threads
    (None: leave torch's default)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
