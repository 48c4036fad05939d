"""What every exporter refuses alike: online modules, quantized input embeddings, and linears whose format holds
NaN/Inf or the target cannot hold exactly (one-line UserErrors naming the first offender); and an output that does
not fit its file system (one OSError line naming the path, the space it needs and the space free)."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

from torch import nn

from bitquilt.errors import UserError
from bitquilt.formats.base import WeightFormat
from bitquilt.nn import online
from bitquilt.nn.finite import all_finite, non_finite_parameter
from bitquilt.nn.quant_embedding import QuantEmbedding
from bitquilt.nn.quant_linear import QuantLinear


def check_layers(model: nn.Module, target: str, runtime_cannot: str,
                 refusal: Callable[[WeightFormat], str | None], exportable: str,
                 quantized_embeddings: bool = False, runs_online: tuple[str, ...] = ()) -> None:
    """Raise for the first part of `model` that `target` (e.g. "GGUF") cannot hold: a module run online at
    inference (`runtime_cannot` says why, e.g. "which llama.cpp cannot run") but at the slots `runs_online` names,
    a NaN/Inf parameter, a quantized input embedding (unless `quantized_embeddings`: then its format must pass
    `refusal` too), or a QuantLinear whose format holds NaN/Inf or for which `refusal(fmt)` gives a reason;
    `exportable` names what the target takes."""
    hosts = {host: rest for host, slots in online.online_state(model).items()
             if (rest := {slot: entry for slot, entry in slots.items() if slot not in runs_online})}
    if hosts:
        host, slots = next(iter(hosts.items()))
        modules = ", ".join(f"{slot} ({entry['class']})" for slot, entry in slots.items())
        raise UserError(f"cannot export {host} to {target}: it runs the online module(s) {modules}, {runtime_cannot}; "
                        f"exportable: weight-only models with {exportable}")
    embeddings = [name for name, m in model.named_modules() if isinstance(m, QuantEmbedding)]
    if embeddings and not quantized_embeddings:
        raise UserError(f"cannot export {embeddings[0]} to {target}: quantized input embeddings (--head-bits, or a "
                        "--gguf-type mix) are not exported yet; quantize with --head-bits 16 and no --gguf-type")
    damaged = non_finite_parameter(model)
    if damaged is not None:
        raise UserError(f"cannot export to {target}: {damaged} holds NaN or Inf (the checkpoint is damaged or was "
                        "edited)")
    refused = [(name, m.fmt, why) for name, m in model.named_modules()
               if isinstance(m, QuantLinear | QuantEmbedding) and (why := _non_finite(m.fmt) or refusal(m.fmt))]
    if refused:
        name, fmt, why = refused[0]
        more = f" (and {len(refused) - 1} more layers)" if len(refused) > 1 else ""
        raise UserError(f"cannot export {name} ({fmt.describe()}) to {target}: {why}{more}; exportable: {exportable}")


def _non_finite(fmt: WeightFormat) -> str | None:
    """Why a format holding NaN or Inf (a damaged or edited checkpoint) is not exported; None when all finite."""
    bad = [key for key, t in fmt.tensors().items() if not all_finite(t)]
    return f"its {', '.join(bad)} hold NaN or Inf (the checkpoint is damaged or was edited)" if bad else None


def no_space(output: Path, need: int, free: int, cause: OSError | None = None) -> OSError:
    """The one-line error of a write of `need` bytes to `output` that does not fit or failed (`cause`): the path, the
    bytes needed and those `free` on its file system before the write, and what the write said."""
    text = f"{output} needs {need / 2**20:.1f} MB and its file system had {free / 2**20:.1f} MB free"
    return OSError((cause and cause.errno) or errno.ENOSPC, text + (f" (the write said: {cause})" if cause else ""))


def check_space(output: Path, need: int) -> int:
    """The bytes free on the file system of `output`; `no_space` raised if fewer than the `need` it will write."""
    free = shutil.disk_usage(output.parent).free
    if free < need:
        raise no_space(output, need, free)
    return free
