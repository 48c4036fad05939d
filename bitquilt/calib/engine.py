"""The sequential engine: block by block, statistics → transforms → solvers → QuantLinear.

For block i the calibration inputs come from blocks 0..i−1 *already quantized*, so every
solver sees the activations the quantized model will really produce. Inside a block the
input groups of the architecture adapter are solved in order (q/k/v, o, gate/up, down:
"true sequential"), each from inputs produced by the already-quantized linears before it.
Only one block's calibration activations are held at a time.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from bitquilt.calib.capture import capture_block_inputs, collect_stats, run_block
from bitquilt.formats.uniform import resolve_group_size
from bitquilt.models.adapters import architecture_of, decoder_layers
from bitquilt.nn.act_quant import input_quantizers
from bitquilt.nn.kv_quant import configure_kv_quant, fit_key_center
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import CalibConfig, Recipe
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LinearStats
from bitquilt.transforms import get_transform

log = logging.getLogger(__name__)


@dataclass
class LinearReport:
    name: str
    format: str
    bits_per_weight: float
    nbytes: int
    seconds: float
    rel_error: float | None  # tr(D H Dᵀ) / tr(W H Wᵀ), D = W − Ŵ: relative output error on calibration data


@dataclass
class QuantReport:
    recipe: dict[str, Any]
    calibration: dict[str, Any] | None
    linears: list[LinearReport] = field(default_factory=list)
    block_seconds: list[float] = field(default_factory=list)
    transforms: dict[str, Any] = field(default_factory=dict)
    total_seconds: float = 0.0
    peak_rss_mb: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def reset_peak_rss() -> None:
    """Restart the peak-RSS counter (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """Peak resident memory since the last `reset_peak_rss` (or process start), in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def relative_error(w: torch.Tensor, w_hat: torch.Tensor, stats: LinearStats) -> float:
    h = stats.hessian
    num = torch.einsum("ij,jk,ik->", w - w_hat, h, w - w_hat)
    den = torch.einsum("ij,jk,ik->", w, h, w)
    return float(num / den.clamp(min=1e-30))


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def _solve_linear(block, name, full_name, spec, solver, options, stats, act_quant=None) -> LinearReport:
    t0 = time.perf_counter()
    lin = block.get_submodule(name)
    w = lin.weight.detach().float()
    fmt = solver(w, stats, spec, options)
    qlin = QuantLinear(fmt, lin.bias, act_quant=act_quant).to(lin.weight.device)
    # not qlin.dequantized(): that would cache an fp32 copy of every quantized weight (2× peak memory)
    err = relative_error(w, fmt.dequantize(), stats) if stats is not None else None
    replace_module(block, name, qlin)
    return LinearReport(full_name, fmt.describe(), fmt.bits_per_weight(), fmt.nbytes(), time.perf_counter() - t0, err)


def warn_if_underdetermined(stats: dict[str, LinearStats], prefix: str, warned: set[int]) -> None:
    """Warn (once per input width) when a Hessian has fewer calibration tokens than inputs: it is then
    rank-deficient and Hessian-based solvers fit the calibration text instead of the layer."""
    for name, s in stats.items():
        width = s.act_absmax.numel()
        if s.n_tokens < width and width not in warned:
            warned.add(width)
            log.warning("%s.%s: %d calibration tokens for %d inputs, so its Hessian is rank-deficient and the "
                        "solver may overfit the calibration text; use at least %d tokens (--calib-samples × "
                        "--calib-seqlen) or a larger --damp", prefix, name, s.n_tokens, width, width)


def check_layer_shapes(model: nn.Module, arch, recipe: Recipe) -> None:
    """Fail before any work if a target linear cannot take its grid (e.g. group size vs width)."""
    for i, block in enumerate(decoder_layers(model, arch)):
        for name in arch.linear_names():
            spec = recipe.spec_for(f"{arch.layers}.{i}.{name}")
            if spec is not None:
                width = block.get_submodule(name).in_features
                try:
                    resolve_group_size(spec.group_size, width)
                except ValueError as e:
                    raise ValueError(f"{arch.layers}.{i}.{name}: {e}") from None


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    recipe: Recipe,
    calib_ids: torch.Tensor | None = None,
    calib: CalibConfig | None = None,
    progress: bool = True,
) -> QuantReport:
    """Quantize `model` in place according to `recipe`; returns what was done and what it cost."""
    start = time.perf_counter()
    reset_peak_rss()
    arch = architecture_of(model)
    solver = get_solver(recipe.solver)
    options = solver.make_options(recipe.options)
    transforms = [get_transform(t) for t in recipe.transforms]
    needs_data = recipe.needs_calibration
    if needs_data and calib_ids is None:
        raise ValueError(f"recipe {recipe.label()!r} needs calibration data (solver statistics, a block transform, "
                         "a clipping search or key centring); pass calibration ids")
    # the saved recipe spells out every solver option, so changing a default never changes what it means
    recorded = {**recipe.to_dict(), "options": asdict(options)}
    report = QuantReport(recorded, asdict(calib) if calib and needs_data else None)
    check_layer_shapes(model, arch, recipe)

    for t in transforms:
        if t.scope == "model":
            report.transforms[t.name] = t.fn(model, arch, recipe.transform_options_for(t.name))
    configure_kv_quant(model, arch, recipe.kv_config())
    layers = decoder_layers(model, arch)
    use_cache = getattr(model.config, "use_cache", None)
    model.config.use_cache = False
    inputs, layer_kwargs = capture_block_inputs(model, arch, calib_ids) if needs_data else ([], [])

    warned: set[int] = set()
    bar = tqdm(range(len(layers)), desc=f"quantize {recipe.label()}", unit="block", disable=not progress)
    for i in bar:
        t_block = time.perf_counter()
        block, prefix = layers[i], f"{arch.layers}.{i}"
        kwargs = layer_kwargs[i] if needs_data else {}
        for t in transforms:
            if t.scope == "block":
                report.transforms.setdefault(t.name, {})[prefix] = t.fn(
                    block, arch, inputs, kwargs, recipe.spec_for, recipe.transform_options_for(t.name), prefix
                )
        if recipe.kv_center and recipe.kv_bits < 16:
            fit_key_center(block, arch, inputs, kwargs)
        for group in arch.groups:
            names = [n for n in group.linears if recipe.spec_for(f"{prefix}.{n}") is not None]
            if not names:
                continue
            stats = collect_stats(block, names, inputs, kwargs) if solver.needs_stats else {}
            warn_if_underdetermined(stats, prefix, warned)
            acts = input_quantizers(block, names, {n: recipe.act_config_for(f"{prefix}.{n}") for n in names},
                                    inputs, kwargs)
            for n in names:
                full = f"{prefix}.{n}"
                report.linears.append(
                    _solve_linear(block, n, full, recipe.spec_for(full), solver, options, stats.get(n), acts[n])
                )
        if needs_data:
            inputs = run_block(block, inputs, kwargs)
        report.block_seconds.append(time.perf_counter() - t_block)
        bar.set_postfix(last_block=f"{report.block_seconds[-1]:.1f}s")

    model.config.use_cache = use_cache
    report.total_seconds = time.perf_counter() - start
    report.peak_rss_mb = peak_rss_mb()
    model.bitquilt_quantization = report
    return report
