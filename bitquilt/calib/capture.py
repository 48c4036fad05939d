"""Capturing what flows into decoder blocks and their linears during calibration."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from bitquilt.calib.compute import block_pass, compute_dtype
from bitquilt.models.adapters import Architecture, decoder_layers
from bitquilt.solvers.base import LinearStats


class _Stop(Exception):
    """Raised from a hook to end a forward pass once everything needed has been seen."""


def block_output(block: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """The hidden states `block` returns for input x (decoder layers return a tensor or a tuple)."""
    out = block(x, **kwargs)
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
def feed_linears(block: nn.Module, linear_names: list[str], inputs: list[torch.Tensor], kwargs: dict[str, Any],
                 on_input: Callable[[str, torch.Tensor], None]) -> None:
    """Run `block` on each input, calling `on_input(name, x)` with what each linear of `linear_names`
    receives; every forward stops as soon as all of them have been fed, skipping the rest of the block."""
    pending: set[str] = set()

    def hook(name):
        def fn(_module, args):
            on_input(name, args[0])
            pending.discard(name)
            if not pending:
                raise _Stop

        return fn

    handles = [block.get_submodule(n).register_forward_pre_hook(hook(n)) for n in linear_names]
    try:
        with block_pass(block):
            for x in inputs:
                pending.update(linear_names)
                try:
                    block(x, **kwargs)
                except _Stop:
                    pass
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def collect_stats(
    block: nn.Module, linear_names: list[str], inputs: list[torch.Tensor], kwargs: dict[str, Any],
    hessian: bool = True,
) -> dict[str, LinearStats]:
    """Input statistics of `linear_names` in `block` (`hessian=False`: ranges only, which skips the
    costly XᵀX of wide inputs when only ranges are needed).

    Linears fed the very same tensor (q/k/v, gate/up) share one statistics object, so each
    Hessian is accumulated once per distinct input.
    """
    stats: dict[str, LinearStats] = {}
    last: list = [None, None]  # the tensor last accumulated (held, so its identity is not reused) and its owner

    def take(name: str, x: torch.Tensor) -> None:
        if last[0] is x:  # the same input as the linear just fed: share its statistics
            stats.setdefault(name, stats[last[1]])
            return
        if name not in stats:
            stats[name] = LinearStats.empty(x.shape[-1], device=x.device, hessian=hessian, products=compute_dtype())
        stats[name].update(x)
        last[:] = [x, name]

    feed_linears(block, linear_names, inputs, kwargs, take)
    return stats


@torch.no_grad()
def sample_inputs(block: nn.Module, linear_names: list[str], inputs: list[torch.Tensor], kwargs: dict[str, Any],
                  max_tokens: int = 1024, max_samples: int = 4) -> dict[str, torch.Tensor]:
    """Inputs [tokens, in_features] of `linear_names` (as their matmul sees them), evenly subsampled
    from the first `max_samples` calibration inputs of `block`."""
    got: dict[str, list[torch.Tensor]] = {n: [] for n in linear_names}
    feed_linears(block, linear_names, inputs[:max_samples], kwargs,
                 lambda name, x: got[name].append(x.detach().reshape(-1, x.shape[-1]).float()))
    out = {}
    for n, xs in got.items():
        x = torch.cat(xs)
        out[n] = x[torch.linspace(0, x.shape[0] - 1, min(max_tokens, x.shape[0]), device=x.device).long()]
    return out


@torch.no_grad()
def run_block(block: nn.Module, inputs: list[torch.Tensor], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The block's outputs for each input, in the calibration precision (`bitquilt.calib.compute.block_pass`), each
    in its input's dtype (the residual stream between blocks stays fp32)."""
    with block_pass(block):
        return [block_output(block, x, kwargs).to(x.dtype) for x in inputs]


def _hook_ids(module: nn.Module, but: nn.Module | None = None) -> set[tuple[int, int]]:
    """The forward hooks inside `module`, those inside `but` left out."""
    left_out = set() if but is None else {id(m) for m in but.modules()}
    return {(id(m), k) for m in module.modules() if id(m) not in left_out
            for hooks in (m._forward_pre_hooks, m._forward_hooks) for k in hooks}


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    return tuple(_copy(v) for v in value) if isinstance(value, tuple) else value


@contextmanager
def _block_input_tracked(block: nn.Module) -> Iterator[list[torch.Tensor | None]]:
    """Within: yields [the input of `block`'s current forward], kept up to date by a pre-hook on `block`."""
    current: list[torch.Tensor | None] = [None]

    def remember(_block: nn.Module, args: tuple, kwargs: dict) -> None:
        current[0] = args[0] if args else kwargs.get("hidden_states")

    handle = block.register_forward_pre_hook(remember, with_kwargs=True)
    try:
        yield current
    finally:
        handle.remove()


@contextmanager
def _forward_replaced(module: nn.Module, forward: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Within: `module.forward` is `forward`; yields the forward it replaced."""
    original = module.forward
    patched = "forward" in module.__dict__
    module.forward = forward
    try:
        yield original
    finally:
        if patched:
            module.forward = original
        else:
            del module.forward


@contextmanager
def writer_input_reused(block: nn.Module, writer: str) -> Iterator[None]:
    """Within: the module holding linear `writer` (e.g. `mlp` for `mlp.down_proj`) computes, for a block input it has
    seen, only `writer` on the input `writer` received then.

    True-sequential calibration runs a block once per group of linears. Once every linear before `writer` inside
    its module is solved, what `writer` receives for a given block input no longer changes: the pass that feeds
    `writer`'s statistics records it, and later passes (the next group's, the block's final pass) skip the rest of
    the module: the MLP's gate/up products, or the attention's q/k/v, RoPE and attention product. The caller opens
    this after the last group before `writer`'s and closes it before any stage changes those linears.

    The first later call checks the shortcut against the full computation (`torch.equal`, which also fixes the
    structure of what the module returns: a tensor, or a tuple of it and Nones) and turns it off for good if they
    differ, so the result is bit-identical by construction. Bypassed when a gradient is wanted or a hook other than
    the writer's was added inside the module. Costs one `writer` input per calibration window of memory.
    """
    module = block.get_submodule(writer.rsplit(".", 1)[0])
    hooks = _hook_ids(module, but=block.get_submodule(writer))  # the writer's own (online modules) may change
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(block input) -> (block input, writer's input)
    agrees: list[bool | None] = [None]  # None: the shortcut not yet compared with the full computation
    like: list[Any] = [None]  # what the module returned in that comparison (its structure)

    def record(_linear: nn.Module, args: tuple) -> None:
        if current[0] is not None and not torch.is_grad_enabled():
            seen[id(current[0])] = (current[0], args[0])  # the block input kept: its id stays unique while held

    recorder = block.get_submodule(writer).register_forward_pre_hook(record, prepend=True)

    def shortcut(x: torch.Tensor) -> Any:
        out = block.get_submodule(writer)(x)
        return (out, *like[0][1:]) if isinstance(like[0], tuple) else out

    def forward(*args: Any, **kwargs: Any) -> Any:
        held = seen.get(id(current[0]))
        foreign_hooks = _hook_ids(module, but=block.get_submodule(writer)) != hooks
        if held is None or agrees[0] is False or torch.is_grad_enabled() or foreign_hooks:
            return original(*args, **kwargs)
        if agrees[0] is None:
            like[0] = full = original(*args, **kwargs)
            short = shortcut(held[1])
            first = (lambda out: out[0]) if isinstance(full, tuple) else (lambda out: out)
            agrees[0] = (not isinstance(full, tuple) or all(r is None for r in full[1:])) and torch.equal(
                first(short), first(full))
            return full
        return shortcut(held[1])

    try:
        with _block_input_tracked(block) as current, _forward_replaced(module, forward) as original:
            yield
    finally:
        recorder.remove()
        seen.clear()


@contextmanager
def attention_reused(block: nn.Module, attention: str) -> Iterator[None]:
    """Within: `block`'s attention module runs once per block input, later passes get a copy of that output.

    True-sequential calibration runs a block once per group of linears (to feed the group the outputs of
    the groups already solved); once the attention's own linears are solved, what it returns for a given
    block input no longer changes, so the MLP groups' passes and the block's final pass can skip its
    projections and the attention itself. The caller guarantees that, for the duration, nothing changes the
    attention module or the norm before it (the engine opens this after the last group inside the attention
    and closes it before any post-block stage). The result is bit-identical: the same computation is reused,
    not redone. The cache is keyed by the block input tensor (the calibration windows, alive for the block) and
    bypassed when a gradient is wanted or a hook was added inside the attention (a capture of its linears).
    Costs one attention output per calibration window of memory, as the windows themselves.
    """
    module = block.get_submodule(attention)
    hooks = _hook_ids(module)
    outputs: dict[int, tuple[torch.Tensor, Any]] = {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        x = current[0]
        if x is None or torch.is_grad_enabled() or _hook_ids(module) != hooks:
            return original(*args, **kwargs)
        if id(x) not in outputs:
            outputs[id(x)] = (x, original(*args, **kwargs))  # x kept: its id stays unique while cached
        return _copy(outputs[id(x)][1])

    with _block_input_tracked(block) as current, _forward_replaced(module, forward) as original:
        yield
    outputs.clear()
