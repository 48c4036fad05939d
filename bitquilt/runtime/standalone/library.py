"""The standalone runtime's C library (csrc/runtime/standalone.cpp and the torch-free kernels) and the native runner
(`bitquilt-native`, csrc/runtime/native_runner.cpp on the same sources), as built at install time
(`bitquilt.native_build`: LIBRARY and RUNNER, in the package's `_native/`).

Both are compiled for the AVX2 baseline with the AVX-512 VNNI and AVX-VNNI paths compiled in and taken at run time
where the CPU has them. Nothing compiles here: a product that was not built, or (in a checkout) is older than its
sources, is refused with one line (`UserError`) saying how to build it. `library()` returns the library loaded with
ctypes, every function's argument and result types declared; `runner_path()` the runner's executable.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from bitquilt import native_build
from bitquilt.errors import UserError
from bitquilt.isa import cpu_flags

CPU_FLAGS = ("avx2", "fma", "f16c")  # the baseline the library is compiled for

_p, _i64 = ctypes.c_void_p, ctypes.c_int64  # any pointer, int64
SIGNATURES = {  # name: (result, arguments), as csrc/runtime/standalone.h declares them
    "bq_error": (ctypes.c_char_p, []),
    "bq_isa_supported": (ctypes.c_int, [ctypes.c_int]),
    "bq_active_isa": (ctypes.c_int, []),
    "bq_set_isa": (ctypes.c_int, [ctypes.c_int]),
    "bq_set_threads": (None, [ctypes.c_int]),
    "bq_threads": (ctypes.c_int, []),
    "bq_file_open": (_p, [ctypes.c_char_p]),
    "bq_file_free": (None, [_p]),
    "bq_open": (_p, [_p, _i64]),
    "bq_free": (None, [_p]),
    "bq_cache": (_p, [_p, _i64, ctypes.c_int]),
    "bq_rope": (_p, [_p, ctypes.c_int]),
    "bq_vocab": (_i64, [_p]),
    "bq_forward": (ctypes.c_int, [_p, _p, _i64, _i64, _p]),
    "bq_step": (ctypes.c_int, [_p, _i64, _p, _p, _p, _p]),
    "bq_threshold": (ctypes.c_int, [_p, ctypes.c_double, ctypes.POINTER(ctypes.c_float)]),
    "bq_set_threshold": (None, [_p, ctypes.c_float]),
    "bq_routed_bits": (ctypes.c_double, [_p]),
    "bq_tokenizer_open": (_p, [_p]),
    "bq_tokenizer_free": (None, [_p]),
    "bq_tokenize": (_i64, [_p, ctypes.c_char_p, _i64, _p, _i64]),
    "bq_detokenize": (_i64, [_p, _p, _i64, ctypes.c_int, _p, _i64]),
    "bq_argmax": (_i64, [_p, _i64]),
    "bq_sample": (_i64, [_p, _i64, ctypes.c_double, ctypes.c_double, ctypes.c_double]),
}


def _built(target: native_build.Target) -> Path:
    """The target's product; UserError (one line) if this CPU cannot run it, or it is not built or out of date."""
    cpu = cpu_flags()
    missing = [f for f in CPU_FLAGS if cpu and f not in cpu]
    if missing:
        raise UserError(f"the standalone runtime needs a CPU with AVX2, FMA and F16C; this one lacks "
                        f"{', '.join(missing)}")
    problem = native_build.problem(target)
    if problem:
        raise UserError(problem)
    return native_build.OUT / target.output


def library_path() -> Path:
    """The built library."""
    return _built(native_build.LIBRARY)


def runner_path() -> Path:
    """The built native runner (`bitquilt-native`: a program without Python)."""
    return _built(native_build.RUNNER)


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded library, its functions typed (SIGNATURES)."""
    lib = ctypes.CDLL(str(library_path()))
    for name, (result, arguments) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = result, arguments
    return lib


def last_error() -> str:
    """What the library's last failing call said."""
    return library().bq_error().decode()
