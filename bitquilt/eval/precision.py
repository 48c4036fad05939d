"""The precision evaluation multiplies in: fp32 (the reference), or bf16 with fp32 accumulation where the machine
multiplies bf16 fast.

bf16 evaluation is calibration's bf16 pass (`bitquilt.calib.compute.block_pass`) applied to the whole model: its
linears and attention multiply under autocast, its quantized linears on one dense bf16 copy of their dequantized
weight each (made on first use, let go on exit), while norms, softmaxes and the loss stay fp32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from bitquilt.calib.compute import (
    CALIB_DTYPES,
    CalibCompute,
    block_device,
    block_pass,
    calibrating,
    choose_compute,
)

EVAL_DTYPES = CALIB_DTYPES


def eval_precision(choice: str) -> str:
    """"fp32" or "bf16" for `choice` (auto: bf16 where the CPU has AMX or AVX-512 BF16, as calibration chooses)."""
    if choice not in EVAL_DTYPES:
        raise ValueError(f"unknown evaluation dtype {choice!r}; choose {', '.join(EVAL_DTYPES)}")
    return choose_compute(choice, "cpu").precision


@contextmanager
def evaluating_in(model: nn.Module, precision: str) -> Iterator[None]:
    """Within: `model`'s forward passes multiply in `precision` ("fp32" leaves them as they are, "bf16" as above)."""
    if precision == "fp32":
        yield
        return
    with calibrating(CalibCompute(precision, block_device(model).type, "evaluation")), block_pass(model):
        yield
