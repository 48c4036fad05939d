"""What calibration computes in and on: the precision of its matrix products (fp32, or bf16 with fp32 accumulation
where the machine multiplies bf16 fast) and the device its blocks are moved to, one at a time.

In bf16, a calibration pass through a block (`block_pass`: the passes that feed statistics and produce the next
block's inputs) runs under autocast, so its linears, attention and the quantized stream multiply in bf16 while the
residual stream between blocks, the norms and every statistic stay fp32; Hessians are bf16 products summed in fp32
(`LinearStats`). What the solvers compute with stays fp32 (Hessian sums, Cholesky, GPTQ's error feedback, the packed
result). In either precision the block's quantized linears multiply by one dense copy of their dequantized weight,
made on their first call of the block (`dense_weight`): a calibration batch is hundreds of tokens, where the packed
kernels would dequantize the weight again at every call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn

from bitquilt.isa import fast_bf16
from bitquilt.nn.online import get
from bitquilt.nn.quant_linear import QuantLinear

CALIB_DTYPES = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class CalibCompute:
    """The precision ("fp32" or "bf16") and device calibration runs on, and why that precision."""

    precision: str = "fp32"
    device: str = "cpu"
    reason: str = "fp32 asked for"

    @property
    def dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.precision]

    def to_dict(self) -> dict[str, str]:
        return {"precision": self.precision, "device": self.device, "reason": self.reason}


def choose_device(choice: str = "auto") -> str:
    """The device of `choice`: cpu, cuda (ValueError when torch sees no CUDA GPU), or auto (cuda if there is one)."""
    if choice not in DEVICES:
        raise ValueError(f"unknown calibration device {choice!r}; choose {', '.join(DEVICES)}")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda (device='cuda'): torch sees no CUDA GPU on this machine (a CPU-only torch "
                         "build, or no GPU); use --device cpu or auto")
    return choice


def choose_compute(calib_dtype: str = "auto", device: str = "auto") -> CalibCompute:
    """The calibration precision and device of the given choices. `auto` precision is bf16 on a CUDA GPU that has
    it and on a CPU with a fast bf16 matmul (AMX or AVX-512 BF16: `bitquilt.isa.fast_bf16`), fp32 elsewhere (a CPU
    without them emulates bf16 matmul, slower than fp32)."""
    if calib_dtype not in CALIB_DTYPES:
        raise ValueError(f"unknown calibration dtype {calib_dtype!r}; choose {', '.join(CALIB_DTYPES)}")
    where = choose_device(device)
    if calib_dtype != "auto":
        return CalibCompute(calib_dtype, where, f"{calib_dtype} asked for")
    if where == "cuda":
        if torch.cuda.is_bf16_supported():
            return CalibCompute("bf16", where, "auto: the GPU multiplies bf16 natively")
        return CalibCompute("fp32", where, "auto: the GPU has no bf16")
    flag = fast_bf16()
    if flag is not None:
        return CalibCompute("bf16", where, f"auto: the CPU has {flag} (fast bf16 matmul)")
    return CalibCompute("fp32", where, "auto: the CPU has neither AMX nor AVX-512 BF16, so bf16 matmul is slower "
                        "than fp32")


FP32_CPU = CalibCompute()
_active: list[CalibCompute] = [FP32_CPU]
_dense: dict[int, tuple[QuantLinear, Any, Any, torch.dtype, torch.Tensor]] = {}  # id(module) -> its dense weight
_dense_block: list[nn.Module | None] = [None]


@contextmanager
def calibrating(compute: CalibCompute) -> Iterator[None]:
    """Within: calibration passes (`block_pass`) and statistics compute as `compute` says."""
    _active.append(compute)
    try:
        yield
    finally:
        _active.pop()
        _dense.clear()
        _dense_block[0] = None


def active() -> CalibCompute:
    """The calibration precision and device in force (fp32 on the CPU outside `calibrating`)."""
    return _active[-1]


def compute_dtype() -> torch.dtype:
    """The dtype calibration multiplies in now."""
    return active().dtype


def autocast(device: torch.device | str) -> Any:
    """A context running matrix products in the active calibration precision on `device` (autocast to bf16, or
    nothing in fp32)."""
    if active().precision == "fp32":
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=compute_dtype())


def block_device(block: nn.Module) -> torch.device:
    """The device `block`'s weights are on."""
    return next(chain(block.parameters(), block.buffers())).device


def dense_weight(linear: QuantLinear, dtype: torch.dtype) -> torch.Tensor:
    """`linear`'s dequantized weight in `dtype`, made once per block (and again if its format or slices change)."""
    key = id(linear)
    held = _dense.get(key)
    if held is None or held[1] is not linear.fmt or held[2] != linear.slices or held[3] != dtype:
        weight = linear.fmt.dequantize(linear.slices).to(dtype)
        held = _dense[key] = (linear, linear.fmt, linear.slices, dtype, weight)
    return held[4]


def _dense_forward(linear: QuantLinear, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """QuantLinear.forward on the dense copy: x Ŵᵀ (+ bias), in `dtype`."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = x.to(dtype) @ dense_weight(linear, dtype).T
        return y if linear.bias is None else y + linear.bias.to(y.dtype)

    return forward


@contextmanager
def block_pass(block: nn.Module) -> Iterator[None]:
    """Within: `block` runs in the active calibration precision, its quantized linears (those without a per-token
    router) on their dense copies. The copies of another block are let go when a pass of this one starts."""
    if _dense_block[0] is not block:
        _dense.clear()
        _dense_block[0] = block
    dtype = compute_dtype()
    patched = [m for m in block.modules()
               if isinstance(m, QuantLinear) and get(m, "router") is None and "forward" not in m.__dict__]
    for m in patched:
        m.forward = _dense_forward(m, dtype)
    try:
        with autocast(block_device(block)):
            yield
    finally:
        for m in patched:
            del m.forward
        if len(_active) == 1:  # a pass outside a quantization run (an analysis): nothing to keep for later passes
            _dense.clear()
            _dense_block[0] = None
