"""The sequential engine: walks a recipe's stages over the model, block by block.

For block i the calibration inputs come from blocks 0..i−1 *already quantized*, so every
stage sees the activations the quantized model will really produce. Inside a block the shared
inputs of the architecture adapter are handled in order (q/k/v, o, gate/up, down: "true
sequential"), each from inputs produced by the already-quantized linears before it. Only one
block's calibration activations are held at a time. What runs is the recipe's stage list
(`bitquilt.calib.stages`); the engine knows no method.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bitquilt.calib.capture import attention_reused, capture_block_inputs, run_block, writer_input_reused
from bitquilt.calib.compute import FP32_CPU, CalibCompute, calibrating
from bitquilt.calib.plan import Plan
from bitquilt.calib.preserve import check_family, checked_block_stage, checked_model_stage, probe_ids
from bitquilt.calib.report import QuantReport
from bitquilt.calib.stages import SCOPES, BlockContext, BlockSource, ModelContext, Stage
from bitquilt.formats.sparse_blocks import check_block_shape
from bitquilt.formats.uniform import resolve_group_size
from bitquilt.io import set_quantization_record
from bitquilt.models.adapters import Architecture, architecture_of, decoder_layers
from bitquilt.pipeline.head import HEAD_STAGE, quantize_head
from bitquilt.pipeline.resume import Progress, fingerprint, load_progress, restore_blocks, save_progress
from bitquilt.progress import progress_bar
from bitquilt.recipes import CalibConfig, Recipe
from bitquilt.resources import peak_rss_mb, reset_peak_rss

log = logging.getLogger(__name__)


def check_layer_shapes(model: nn.Module, plan: Plan, residual_block: tuple[int, int] | None = None) -> None:
    """Fail before any work if a planned linear cannot take its grid (e.g. group size vs width) or its residual
    tiles (`residual_block`, rows × columns), or a planned KV quantizer its groups (KV group size vs head_dim)."""
    for name in plan.quantized():
        linear = model.get_submodule(name)
        try:
            resolve_group_size(plan.weight(name).group_size, linear.in_features)
            if residual_block is not None:
                check_block_shape(linear.out_features, linear.in_features, residual_block)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    for name, config in plan.kv.items():
        check_kv_group_size(config.group_size, head_dim(model, name), config.format)


def residual_block(recipe: Recipe) -> tuple[int, int] | None:
    """The residual tile shape of `recipe`, None without a residual."""
    residual = recipe.residual_spec
    return None if residual is None else tuple(residual.block)


def head_dim(model: nn.Module, attention: str) -> int:
    """Values per head of the attention module `attention` (its own `head_dim`, else the config's)."""
    dim = getattr(model.get_submodule(attention), "head_dim", None) or getattr(model.config, "head_dim", None)
    return int(dim or model.config.hidden_size // model.config.num_attention_heads)


def check_kv_group_size(group_size: int, dim: int, grid: str = "int") -> None:
    """Raise ValueError unless integer KV groups of `group_size` values tile a head of `dim` values (-1 or a size ≥
    `dim`: one group per head). MXINT KV blocks ignore the group size."""
    if grid != "int" or group_size == -1 or group_size >= dim or dim % group_size == 0:
        return
    divisors = ", ".join(str(d) for d in range(1, dim + 1) if dim % d == 0)
    raise ValueError(f"--kv-group-size {group_size} (kv_group_size) does not divide the model's head_dim {dim}; "
                     f"use a divisor of it ({divisors}), or -1 or any size ≥ {dim} for one group per head")


def _record(report: QuantReport, stage: Stage, result: dict[str, Any] | None, where: str | None) -> None:
    if result is None:
        return
    if where is None:
        report.stages[stage.name] = result
    else:
        report.stages.setdefault(stage.name, {}).setdefault(where, {}).update(result)


def _record_head(report: QuantReport, model: nn.Module, recipe: Recipe, arch: Architecture | None = None) -> None:
    """Quantize the LM head and embeddings if `recipe.head_bits` says so (`bitquilt.pipeline.head`), into `report`."""
    result = quantize_head(model, recipe, arch)
    if result is not None:
        report.stages[HEAD_STAGE] = result


def initial_plan(model: nn.Module, arch: Architecture, recipe: Recipe) -> Plan:
    """The static policy: the recipe's grid, globs and overrides for every linear of every block."""
    n = len(decoder_layers(model, arch))
    linears = [f"{arch.layers}.{i}.{name}" for i in range(n) for name in arch.linear_names()]
    attention = [f"{arch.layers}.{i}.{arch.attention}" for i in range(n)]
    if recipe.skip and all(recipe.spec_for(name) is None for name in linears):
        raise ValueError(f"--skip {' '.join(recipe.skip)} keeps every one of the {len(linears)} linears in full "
                         f"precision: nothing to quantize (linears are named like {linears[0]})")
    return Plan.static(linears, attention, recipe.spec_for, recipe.act_config_for, recipe.kv_config())


def warn_unmatched_skips(plan: Plan, recipe: Recipe) -> None:
    """A warning for each --skip glob that matches none of the plan's linears (a typo keeps nothing out)."""
    for pattern in recipe.skip:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in plan.linears):
            log.warning("--skip %r matches no linear (linears are named like %s); it keeps nothing in full "
                        "precision", pattern, next(iter(plan.linears), "?"))


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    recipe: Recipe,
    calib_ids: torch.Tensor | None = None,
    calib: CalibConfig | None = None,
    progress: bool = True,
    blocks: BlockSource | None = None,
    resume_dir: Path | None = None,
    compute: CalibCompute = FP32_CPU,
    on_block: Callable[[int, QuantReport], None] | None = None,
) -> QuantReport:
    """Quantize `model` in place according to `recipe`; returns what was done and what it cost. With `blocks`
    (streaming quantization), block i's weights are loaded from it just before its stages and released after;
    prepass and model stages reach the blocks through it (`ModelContext.each_block`, `walk_blocks`). With
    `resume_dir`, the state after every block is kept there and a rerun carries on from it
    (`bitquilt.pipeline.resume`). `compute` says what calibration multiplies in and which device each block is
    moved to for its stages (`bitquilt.calib.compute`); the model stays where it is. `on_block(i, report)` is called
    after block i, once its wall and CPU seconds are in the report (a benchmark's per-block progress)."""
    with calibrating(compute):
        return _quantize_model(model, recipe, calib_ids, calib, progress, blocks, resume_dir, compute, on_block)


def to_device(value: Any, device: str) -> Any:
    """`value` with every tensor in it (inside tuples, lists and dicts) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def writer_shortcuts(arch: Architecture) -> dict[int, str]:
    """{j: writer} for each writer linear (`Architecture.writers`) that is alone in group j + 1 and the only linear
    of its module solved after group j: once group j is solved, the module's work up to the writer's input is
    final (`bitquilt.calib.capture.writer_input_reused`)."""
    groups = [g.linears for g in arch.shared_inputs]
    shortcuts = {}
    for writer in arch.writers:
        module = writer.rsplit(".", 1)[0]
        at = next((j for j, names in enumerate(groups) if writer in names), None)
        later = [n for names in groups[at or 0:] for n in names if n.startswith(f"{module}.")]
        if at and groups[at] == (writer,) and later == [writer]:
            shortcuts[at - 1] = writer
    return shortcuts


def _quantize_model(model: nn.Module, recipe: Recipe, calib_ids: torch.Tensor | None, calib: CalibConfig | None,
                    progress: bool, blocks: BlockSource | None, resume_dir: Path | None,
                    compute: CalibCompute, on_block: Callable[[int, QuantReport], None] | None) -> QuantReport:
    start = time.perf_counter()
    reset_peak_rss()
    arch = architecture_of(model)
    check_family(recipe, arch)
    if resume_dir is not None and blocks is not None:
        raise ValueError("a resume directory cannot be combined with streaming quantization")
    stages = recipe.stages()
    needs_data = recipe.needs_calibration
    if needs_data and calib_ids is None:
        raise ValueError(f"recipe {recipe.label()!r} needs calibration data (solver statistics or a calibrated "
                         f"stage: {', '.join(s.name for s, _ in stages if s.needs_calibration)}); pass calibration ids")
    plan = initial_plan(model, arch, recipe)
    check_layer_shapes(model, plan, residual_block(recipe))
    warn_unmatched_skips(plan, recipe)
    report = QuantReport(recipe.record(), asdict(calib) if calib and needs_data else None, compute=compute.to_dict())
    by_scope = {scope: [(s, o) for s, o in stages if s.scope == scope] for scope in SCOPES}
    layers = decoder_layers(model, arch)
    run_id = None if resume_dir is None else fingerprint(model, layers[0], {**recipe.to_dict(),
                                                                             "calib_precision": compute.precision},
                                                         calib_ids)
    ctx = ModelContext(model, arch, plan, calib_ids if needs_data else None, recipe.to_dict(), blocks=blocks,
                       progress=progress)

    for stage, opts in by_scope["prepass"] + by_scope["model"]:
        _record(report, stage, checked_model_stage(stage, ctx, opts), None)
    use_cache = getattr(model.config, "use_cache", None)
    model.config.use_cache = False
    inputs, layer_kwargs = capture_block_inputs(model, arch, calib_ids) if needs_data else ([], [])
    # without calibration data, block transforms are checked (`bitquilt.calib.preserve`) on a probe window of their
    # own, carried through the blocks beside the run; with it, on the first calibration window
    probing = not needs_data and any(s.kind == "transform" for s, _ in by_scope["block"] + by_scope["post_block"])
    probe, probe_kwargs = (capture_block_inputs(model, arch, probe_ids(None, model.config.vocab_size)) if probing
                           else ([], layer_kwargs))
    if blocks is not None:
        blocks.inputs_captured()
    home = next(model.parameters()).device
    moving = torch.device(compute.device).type != home.type  # each block to the device for its stages, then back
    if moving:
        inputs, layer_kwargs = to_device(inputs, compute.device), to_device(layer_kwargs, compute.device)
        probe, probe_kwargs = to_device(probe, compute.device), to_device(probe_kwargs, compute.device)
    first = 0
    saved = None if resume_dir is None else load_progress(resume_dir, run_id)
    if saved is not None:  # carry on after the last saved block
        restore_blocks(resume_dir, model, arch.layers, saved.index)
        first, inputs, plan, report = saved.index + 1, saved.inputs, saved.plan, saved.report
        report.resumed_at = first
        ctx.plan, ctx.scratch = plan, saved.scratch

    last_attention_group = max((j for j, g in enumerate(arch.shared_inputs)
                                if any(n.startswith(f"{arch.attention}.") for n in g.linears)), default=None)
    writers_next = writer_shortcuts(arch)
    bar = progress_bar(range(first, len(layers)), desc=f"quantize {recipe.label()}", unit="block", disable=not progress,
               initial=first, total=len(layers))
    for i in bar:
        t_block, cpu_block = time.perf_counter(), time.process_time()
        if blocks is not None:
            blocks.load(i)
        if moving:
            layers[i].to(compute.device)
        block_ctx = BlockContext(model, arch, plan, ctx.calib_ids, ctx.settings, ctx.scratch, index=i,
                                 block=layers[i], inputs=inputs, kwargs=layer_kwargs[i] if needs_data else {})
        window = (probe if probing else inputs)[:1], probe_kwargs[i] if probing or needs_data else {}
        for stage, opts in by_scope["block"]:
            _record(report, stage, checked_block_stage(stage, block_ctx, opts, *window), block_ctx.prefix)
        with ExitStack() as reuse:
            for j, shared in enumerate(arch.shared_inputs):
                block_ctx.linears = shared.linears
                for stage, opts in by_scope["inputs"]:
                    _record(report, stage, stage.fn(block_ctx, opts), block_ctx.prefix)
                if needs_data and j == last_attention_group:  # the attention is final until post-block stages
                    reuse.enter_context(attention_reused(layers[i], arch.attention))
                if needs_data and j in writers_next:  # what the next group's writer receives is now final
                    reuse.enter_context(writer_input_reused(layers[i], writers_next[j]))
            block_ctx.linears = ()
            if by_scope["post_block"]:
                reuse.close()
            for stage, opts in by_scope["post_block"]:
                _record(report, stage, checked_block_stage(stage, block_ctx, opts, *window), block_ctx.prefix)
            report.linears.extend(block_ctx.results)
            if needs_data:
                inputs = run_block(layers[i], inputs, block_ctx.kwargs)
            if probing:
                probe = run_block(layers[i], probe, probe_kwargs[i])
        if moving:
            layers[i].to(home)
        if blocks is not None:
            blocks.release(i)
        report.block_seconds.append(time.perf_counter() - t_block)
        report.block_cpu_seconds.append(time.process_time() - cpu_block)
        bar.set_postfix(last_block=f"{report.block_seconds[-1]:.1f}s")
        if resume_dir is not None:
            save_progress(resume_dir, layers[i], Progress(run_id, i, inputs, ctx.scratch, plan, report))
        if on_block is not None:
            on_block(i, report)

    model.config.use_cache = use_cache
    if blocks is None:  # streaming quantizes them once it has loaded the LM head (`bitquilt.api.quantize_streaming`)
        _record_head(report, model, recipe, arch)
    report.plan = plan.to_dict()
    report.total_seconds = time.perf_counter() - start
    report.peak_rss_mb = peak_rss_mb()
    set_quantization_record(model, {"recipe": report.recipe, "calibration": report.calibration,
                                    "report": report.to_dict()})
    return report
