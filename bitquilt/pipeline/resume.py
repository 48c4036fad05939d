"""Resumable quantization: the engine's state after every block, so a long calibration survives an interruption.

A calibrated run on a large model takes hours on a CPU (MoBiQuant on qwen2.5-1.5b: about 10 minutes per block on
one core). With a resume directory the engine writes, after block i,

    block_{i:04d}.pt   the quantized block as data: each quantized linear's format name, meta and tensors, its
                       online modules' settings and the block's other tensors
    state.pt           the run's fingerprint, i, block i + 1's calibration inputs, the stages' scratch (e.g.
                       full-precision streams), the plan and the report so far

and a rerun with the same directory, recipe, calibration ids and model loads blocks 0..i into the freshly loaded
model and carries on at block i + 1. The model-scope stages run again first (they are deterministic and cheap next
to the blocks); every block stage seeds itself per block, so the result equals an uninterrupted run's. Each file
is written to a temporary name and renamed: an interruption mid-write leaves the previous state.

Nothing in the directory is trusted to be code: both files hold only tensors and plain Python values (dicts, lists,
tuples, sets, strings, numbers) and are read with `torch.load(weights_only=True)`, whose unpickler builds nothing
else, so a planted pickle payload is refused rather than run. The state's fingerprint is checked before any block
is read, and a directory another user owns is refused outright: its content would become this user's model.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bitquilt.calib.plan import LinearPlan, Plan
from bitquilt.calib.report import LinearReport, QuantReport
from bitquilt.formats import format_class
from bitquilt.formats.base import split_buffers
from bitquilt.nn import online
from bitquilt.nn.act_quant import ActQuantConfig
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.solvers.base import LayerSpec

STATE = "state.pt"
VERSION = 2  # 2: plain data read with weights_only=True (1 pickled the modules and the engine's objects)


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


def _plan_data(plan: Plan) -> dict[str, Any]:
    """`plan` as plain data, every solver parameter kept (`Plan.to_dict` keeps only JSON-like ones)."""
    return {"linears": {n: {"weight": None if p.weight is None else dataclasses.asdict(p.weight),
                            "act": None if p.act is None else dataclasses.asdict(p.act), "params": p.params}
                        for n, p in plan.linears.items()},
            "kv": {n: dataclasses.asdict(c) for n, c in plan.kv.items()}, "decisions": plan.decisions}


def _plan_from(data: dict[str, Any]) -> Plan:
    linears = {n: LinearPlan(None if p["weight"] is None else LayerSpec(**p["weight"]),
                             None if p["act"] is None else ActQuantConfig(**p["act"]), p["params"])
               for n, p in data["linears"].items()}
    return Plan(linears, {n: ActQuantConfig(**c) for n, c in data["kv"].items()}, data["decisions"])


def _report_from(data: dict[str, Any]) -> QuantReport:
    return QuantReport(**{**data, "linears": [LinearReport(**r) for r in data["linears"]]})


def block_data(block: nn.Module) -> dict[str, Any]:
    """A quantized block as plain data: {"layers": {name: {format, meta}}, "online": its online modules' settings,
    "tensors": its state dict}."""
    layers = {name: {"format": m.fmt.name, "meta": m.fmt.meta()} for name, m in block.named_modules()
              if isinstance(m, QuantLinear)}
    tensors = {k: v.detach() for k, v in block.state_dict().items()}
    return {"layers": layers, "online": online.online_state(block), "tensors": tensors}


def restore_block(model: nn.Module, prefix: str, data: dict[str, Any]) -> None:
    """Make the block at `prefix` of `model` the one `block_data` described: its quantized linears rebuilt from their
    formats, its online modules attached (on the model: some need the model's attention switch), its tensors loaded
    (strictly: a file that does not fit the block raises)."""
    block = model.get_submodule(prefix)
    tensors = data["tensors"]
    for name, info in data["layers"].items():
        fmt = format_class(info["format"]).from_tensors(split_buffers(dict(tensors), name), info["meta"])
        bias = tensors.get(f"{name}.bias")
        parent, _, child = name.rpartition(".")
        setattr(block.get_submodule(parent) if parent else block, child, QuantLinear(fmt, bias))
    online.restore(model, {f"{prefix}.{host}" if host else prefix: slots for host, slots in data["online"].items()})
    block.load_state_dict(tensors, strict=True)


def _write(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _read(path: Path, directory: Path) -> Any:
    """A file `_write` wrote, as plain data; ValueError naming it when it cannot be read back (cut short by a full
    disk or a kill outside `_write`'s rename, edited, or holding anything but tensors and plain values)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # the unpickler fails as whatever it meets: EOFError, RuntimeError, UnpicklingError
        reason = " ".join(str(e).split())[:200]
        raise ValueError(f"resume file {path} cannot be read back as plain data ({type(e).__name__}: {reason}); "
                         f"delete {directory} to start again") from None


def block_path(directory: Path, index: int) -> Path:
    return directory / f"block_{index:04d}.pt"


def save_progress(directory: Path, block: nn.Module, progress: Progress) -> None:
    """Write block `progress.index` and then the state that names it (the state last, so it never points at a block
    that is not on disk). A write that fails (a full disk) says what the directory still holds."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write(block_data(block), block_path(directory, progress.index))
        _write({"version": VERSION, "fingerprint": progress.fingerprint, "index": progress.index,
                "inputs": progress.inputs, "scratch": progress.scratch, "plan": _plan_data(progress.plan),
                "report": dataclasses.asdict(progress.report)}, directory / STATE)
    except OSError as e:
        kept = f"the state after block {progress.index - 1}" if progress.index else "no usable state"
        raise OSError(e.errno or errno.EIO, f"saving the resume state of block {progress.index} to {directory} failed "
                      f"({e.strerror or e}); it keeps {kept}: free space and run again with --resume to carry on, "
                      f"or delete {directory}") from None


def check_owner(directory: Path) -> None:
    """Raise ValueError unless `directory` (if it exists) belongs to this user: what it holds becomes this user's
    model."""
    if directory.exists() and directory.stat().st_uid != os.getuid():
        raise ValueError(f"resume directory {directory} belongs to another user; its state would become your model: "
                         "give a directory of your own")


def load_progress(directory: Path, expected: str) -> Progress | None:
    """The saved state of the run with fingerprint `expected` in `directory`; None when it holds no state. Raises
    ValueError when it holds another run's, or is not this user's."""
    check_owner(directory)
    path = directory / STATE
    if not path.exists():
        return None
    state = _read(path, directory)
    if not isinstance(state, dict) or state.get("version") != VERSION or state.get("fingerprint") != expected:
        raise ValueError(f"resume directory {directory} holds the progress of another run (a different model, "
                         f"recipe or calibration data, or another bitquilt version); give a new directory or delete it")
    try:
        return Progress(expected, state["index"], state["inputs"], state["scratch"], _plan_from(state["plan"]),
                        _report_from(state["report"]))
    except (KeyError, TypeError) as e:
        raise ValueError(f"resume file {path} is damaged ({type(e).__name__}: {e}); delete {directory} to start "
                         "again") from None


def restore_blocks(directory: Path, model: nn.Module, prefix: str, last: int) -> None:
    """Put the saved blocks 0..last in place of the model's (`prefix`: where its decoder layers are)."""
    for i in range(last + 1):
        path = block_path(directory, i)
        if not path.exists():
            raise ValueError(f"resume directory {directory} lacks {path.name}, which its state needs; delete the "
                             "directory to start again")
        data = _read(path, directory)
        try:
            restore_block(model, f"{prefix}.{i}", data)
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
            raise ValueError(f"resume file {path} does not fit the model ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]}); delete {directory} to start again") from None
