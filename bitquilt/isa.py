"""Which instruction-set path a compiled kernel takes: the widest the CPU runs, unless `BITQUILT_ISA` or the
caller names one.

Kernels with an AVX-512 twin (the MXINT GEMV, the 4- and 2-bit × int8 matmul, in the torch extension and in the
standalone runtime's library) detect the CPU in C++ and report the paths they support, in order, AVX2 first;
`choose` picks among them. No torch here: the standalone runtime imports it. `BITQUILT_ISA=avx2` forces the baseline
everywhere (to compare paths, or to rule one out); a value a kernel does not support warns once and is ignored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

# the 4- and 2-bit × int8 kernel's paths, in csrc/kernels/q4_int8.h's Isa order;
# avxvnni: 256-bit VEX vpdpbusd; avx512: F, BW, VL, DQ and VNNI
INT8_ISAS = ("avx2", "avxvnni", "avx512")
# /proc/cpuinfo flags of a fast bf16 matmul in oneDNN (what torch's CPU bf16 GEMM runs on), fastest first: AMX tiles,
# then AVX-512 BF16 dot products. Without either, torch emulates bf16 GEMM and it is slower than fp32.
FAST_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
log = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()


def int8_supported(runs: Callable[[int], Any]) -> tuple[str, ...]:
    """The INT8_ISAS paths for which `runs(index)` (a compiled library's test, by csrc/kernels/q4_int8.h's Isa index)
    holds, narrowest first."""
    return tuple(name for index, name in enumerate(INT8_ISAS) if runs(index))


def choose(kernel: str, supported: tuple[str, ...], isa: str | None = None) -> str | None:
    """The path `kernel` runs: `isa` if given (ValueError unless supported), else `$BITQUILT_ISA` if supported,
    else the widest of `supported`; None when nothing is supported (no extension)."""
    if not supported:
        return None
    if isa is not None:
        if isa not in supported:
            raise ValueError(f"{kernel} kernel path {isa!r} unavailable here; supported: {', '.join(supported)}")
        return isa
    wanted = os.environ.get("BITQUILT_ISA", "").strip().lower()
    if wanted in supported:
        return wanted
    if wanted and (kernel, wanted) not in _warned:
        _warned.add((kernel, wanted))
        log.warning("bitquilt: BITQUILT_ISA=%s is not a supported %s kernel path (%s); using %s",
                    wanted, kernel, ", ".join(supported), supported[-1])
    return supported[-1]


@cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of /proc/cpuinfo's first processor (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def fast_bf16() -> str | None:
    """The flag of FAST_BF16_FLAGS this CPU has (the fastest), None if it has neither."""
    return next((flag for flag in FAST_BF16_FLAGS if flag in cpu_flags()), None)
