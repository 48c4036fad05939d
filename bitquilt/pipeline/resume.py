"""Resumable quantization: the engine's state after every block, so a long calibration survives an interruption.

A calibrated run on a large model takes hours on a CPU (MoBiQuant on qwen2.5-1.5b: about 10 minutes per block on
one core). With a resume directory the engine writes, after block i,

    block_{i:04d}.pt   the quantized block (the module, pickled)
    state.pt           i, block i + 1's calibration inputs, the stages' scratch (e.g. full-precision streams),
                       the plan and the report so far, and the run's fingerprint

and a rerun with the same directory, recipe, calibration ids and model loads blocks 0..i into the freshly loaded
model and carries on at block i + 1. The model-scope stages run again first (they are deterministic and cheap next
to the blocks); every block stage seeds itself per block, so the result equals an uninterrupted run's. Each file
is written to a temporary name and renamed: an interruption mid-write leaves the previous state. A directory
holding another run is refused rather than mixed in.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bitquilt.calib.plan import Plan
from bitquilt.calib.report import QuantReport

STATE = "state.pt"


def fingerprint(model: nn.Module, first_block: nn.Module, recipe: dict[str, Any],
                calib_ids: torch.Tensor | None) -> str:
    """SHA-256 of what a run's blocks depend on: the model's config and its first block's weights (before any stage
    touches them), the recipe and the calibration token ids."""
    digest = hashlib.sha256()
    digest.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for name, tensor in sorted(first_block.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(json.dumps(recipe, sort_keys=True, default=str).encode())
    if calib_ids is not None:
        digest.update(calib_ids.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass
class Progress:
    """The engine's state after block `index` (module docstring)."""

    fingerprint: str
    index: int
    inputs: list[torch.Tensor]
    scratch: dict[str, Any]
    plan: Plan
    report: QuantReport


def _write(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _read(path: Path, directory: Path) -> Any:
    """A file `_write` wrote; ValueError naming it when it cannot be read back (cut short by a full disk or a kill
    outside `_write`'s rename, or edited)."""
    try:
        return torch.load(path, weights_only=False)
    except Exception as e:  # torch.load fails as whatever its unpickler meets: EOFError, RuntimeError, UnpicklingError
        raise ValueError(f"resume file {path} cannot be read back ({type(e).__name__}: {e}); delete {directory} to "
                         "start again") from None


def block_path(directory: Path, index: int) -> Path:
    return directory / f"block_{index:04d}.pt"


def save_progress(directory: Path, block: nn.Module, progress: Progress) -> None:
    """Write block `progress.index` and then the state that names it (the state last, so it never points at a block
    that is not on disk)."""
    directory.mkdir(parents=True, exist_ok=True)
    _write(block, block_path(directory, progress.index))
    _write(progress, directory / STATE)


def load_progress(directory: Path, expected: str) -> Progress | None:
    """The saved state of the run with fingerprint `expected` in `directory`; None when it holds no state. Raises
    ValueError when it holds another run's."""
    path = directory / STATE
    if not path.exists():
        return None
    progress = _read(path, directory)
    if not isinstance(progress, Progress) or progress.fingerprint != expected:
        raise ValueError(f"resume directory {directory} holds the progress of another run (a different model, "
                         f"recipe or calibration data); give a new directory or delete it")
    return progress


def restore_blocks(directory: Path, layers: nn.ModuleList, last: int) -> None:
    """Put the saved blocks 0..last in place of the model's."""
    for i in range(last + 1):
        path = block_path(directory, i)
        if not path.exists():
            raise ValueError(f"resume directory {directory} lacks {path.name}, which its state needs; delete the "
                             "directory to start again")
        layers[i] = _read(path, directory)
