"""Capturing what flows into decoder blocks and their linears during calibration."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bitquilt.models.adapters import Architecture, decoder_layers
from bitquilt.solvers.base import LinearStats


class _Stop(Exception):
    """Raised from a hook to end a forward pass once everything needed has been seen."""


def _layer_output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def capture_block_inputs(
    model: nn.Module, arch: Architecture, calib_ids: torch.Tensor
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Hidden states entering block 0 for every calibration sample, and each block's kwargs.

    The kwargs (position embeddings, masks, ...) depend only on the sequence length, so they
    are recorded once per block from the first sample; recording them per block keeps
    architectures with per-layer attention types (Gemma 3: sliding/global) correct.
    """
    layers = decoder_layers(model, arch)
    per_layer_kwargs: list[dict[str, Any]] = [{} for _ in layers]
    inputs: list[torch.Tensor] = []
    device = next(model.parameters()).device

    def record_kwargs(i):
        def hook(_module, args, kwargs):
            per_layer_kwargs[i] = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
            per_layer_kwargs[i]["use_cache"] = False
            if i == len(layers) - 1:
                raise _Stop

        return hook

    def record_input(_module, args, kwargs):
        inputs.append((args[0] if args else kwargs["hidden_states"]).detach())
        raise _Stop

    handles = [layer.register_forward_pre_hook(record_kwargs(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        try:
            model(calib_ids[:1].to(device), use_cache=False)
        except _Stop:
            pass
    finally:
        for h in handles:
            h.remove()
    handle = layers[0].register_forward_pre_hook(record_input, with_kwargs=True)
    try:
        for ids in calib_ids:
            try:
                model(ids.unsqueeze(0).to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return inputs, per_layer_kwargs


@torch.no_grad()
def collect_stats(
    block: nn.Module, linear_names: list[str], inputs: list[torch.Tensor], kwargs: dict[str, Any]
) -> dict[str, LinearStats]:
    """Input statistics of `linear_names` in `block`, stopping each forward once all were seen.

    Linears fed the very same tensor (q/k/v, gate/up) share one statistics object, so each
    Hessian is accumulated once per distinct input.
    """
    modules = {n: block.get_submodule(n) for n in linear_names}
    stats: dict[str, LinearStats] = {}
    seen: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(_module, args):
            x = args[0]
            twin = next((other for other, t in seen.items() if t is x), None)
            if twin is not None:
                stats.setdefault(name, stats[twin])
            else:
                if name not in stats:
                    stats[name] = LinearStats.empty(modules[name].in_features, device=x.device)
                stats[name].update(x)
            seen[name] = x
            if len(seen) == len(modules):
                raise _Stop

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    try:
        for x in inputs:
            seen.clear()
            try:
                block(x, **kwargs)
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()
    return stats


@torch.no_grad()
def run_block(block: nn.Module, inputs: list[torch.Tensor], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [_layer_output(block(x, **kwargs)) for x in inputs]
