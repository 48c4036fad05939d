"""Token windows for perplexity (consecutive) and calibration (random, seeded).

A text source's documents are joined with blank lines and tokenized as one string, without
BOS or other special tokens. Tokenizing ~1.6 MB takes ~10 s on this class of CPU, so the ids
are cached under cache_dir()/tokens/, keyed by a hash of the tokenizer and of the text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from bitquilt.cache import atomic_file, cache_dir
from bitquilt.data.corpora import load_documents
from bitquilt.errors import UserError

log = logging.getLogger(__name__)

SEPARATOR = "\n\n"


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.to_str()
    return type(tokenizer).__name__ + json.dumps(sorted(tokenizer.get_vocab().items()))


def corpus_ids(tokenizer: Any, source: str | Path) -> torch.Tensor:
    """All token ids of `source` (a TEXT_SETS name or a .txt/.jsonl path) as a 1-D LongTensor."""
    text = SEPARATOR.join(load_documents(source))
    h = hashlib.sha256(_tokenizer_fingerprint(tokenizer).encode())
    h.update(b"\0" + text.encode())
    path = cache_dir() / "tokens" / f"{h.hexdigest()[:32]}.safetensors"
    if path.is_file():
        try:
            return load_file(path)["ids"].long()
        except (SafetensorError, OSError, KeyError):
            path.unlink(missing_ok=True)  # a damaged cache entry: rebuild it
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.int32)
    with atomic_file(path) as tmp:
        save_file({"ids": ids}, tmp)
    return ids.long()


def _check_positive(**values: int | None) -> None:
    for name, v in values.items():
        if v is not None and v < 1:
            raise UserError(f"{name} must be a positive integer, got {v}")


def eval_windows(
    tokenizer: Any, source: str | Path, seqlen: int, max_windows: int | None = None
) -> torch.Tensor:
    """Consecutive non-overlapping windows [n, seqlen] from the start of `source`; the rest is dropped."""
    _check_positive(seqlen=seqlen, max_windows=max_windows)
    if seqlen < 2:
        raise UserError(f"evaluation windows need at least 2 tokens (each predicts from the one before), got {seqlen}")
    ids = corpus_ids(tokenizer, source)
    n = len(ids) // seqlen
    if n == 0:
        raise UserError(f"text {str(source)!r} has {len(ids)} tokens, fewer than one window of {seqlen}")
    if max_windows is not None:
        n = min(n, max_windows)
    return ids[: n * seqlen].view(n, seqlen)


def calibration_windows(
    tokenizer: Any, source: str | Path, n_samples: int, seqlen: int, seed: int = 0
) -> torch.Tensor:
    """`n_samples` windows [n_samples, seqlen] at random offsets drawn with `random.Random(seed)`."""
    _check_positive(n_samples=n_samples, seqlen=seqlen)
    ids = corpus_ids(tokenizer, source)
    if len(ids) < seqlen:
        raise UserError(f"calibration text {str(source)!r} has {len(ids)} tokens; one window of "
                        f"seqlen {seqlen} needs at least {seqlen}")
    if n_samples * seqlen > len(ids):
        log.warning("calibration text %r has %d tokens for %d windows of %d: the windows overlap, so the statistics "
                    "see fewer distinct tokens than %d windows would; give a longer text or fewer --calib-samples",
                    str(source), len(ids), n_samples, seqlen, n_samples)
    rng = random.Random(seed)
    starts = [rng.randint(0, len(ids) - seqlen) for _ in range(n_samples)]
    return torch.stack([ids[s : s + seqlen] for s in starts])
