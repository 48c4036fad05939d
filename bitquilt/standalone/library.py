"""The standalone runtime's C library (csrc/standalone.cpp and the torch-free kernels), compiled on first use.

Built with the system's C++ compiler (`$CXX`, default g++) for the AVX2 baseline, with the AVX-512 VNNI path
compiled in and taken at run time where the CPU has it (as the torch extension does), into
`$BITQUILT_CACHE/standalone/` under a name hashed from the sources and flags: an edit rebuilds, concurrent first
uses wait on one build (`bitquilt.cache.file_lock`), and a failed build leaves nothing behind. Loaded with ctypes;
`library()` returns the loaded library with every function's argument and result types declared.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from bitquilt import cache
from bitquilt.errors import UserError

CSRC = Path(__file__).resolve().parent.parent / "kernels" / "csrc"
SOURCES = ("standalone.cpp", "q4_int8.cpp", "q4_int8_vnni.cpp", "uniform8_gemv.cpp", "uniform8_vnni.cpp")
HEADERS = ("avx2_simd.h", "decoder_core.h", "int8_round.h", "json_value.h", "parallel.h", "q4_int8.h",
           "standalone_file.h", "uniform8.h")
FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared")
CPU_FLAGS = ("avx2", "fma", "f16c")  # the baseline the library is compiled for

_p, _i64 = ctypes.c_void_p, ctypes.c_int64  # any pointer, int64
SIGNATURES = {  # name: (result, arguments)
    "bq_error": (ctypes.c_char_p, []),
    "bq_has_vnni": (ctypes.c_int, []),
    "bq_vnni_enabled": (ctypes.c_int, []),
    "bq_set_vnni": (ctypes.c_int, [ctypes.c_int]),
    "bq_set_threads": (None, [ctypes.c_int]),
    "bq_threads": (ctypes.c_int, []),
    "bq_open": (_p, [ctypes.c_char_p, _i64]),
    "bq_free": (None, [_p]),
    "bq_cache": (_p, [_p, _i64, ctypes.c_int]),
    "bq_rope": (_p, [_p, ctypes.c_int]),
    "bq_vocab": (_i64, [_p]),
    "bq_forward": (ctypes.c_int, [_p, _p, _i64, _i64, _p]),
    "bq_argmax": (_i64, [_p, _i64]),
    "bq_sample": (_i64, [_p, _i64, ctypes.c_double, ctypes.c_double]),
}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build_key(compiler: str) -> str:
    h = hashlib.sha256(" ".join((compiler, *FLAGS)).encode())
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    return h.hexdigest()[:16]


def library_path() -> Path:
    """The compiled library, built first if this version of the sources has not been."""
    flags = _cpu_flags()
    missing = [f for f in CPU_FLAGS if flags and f not in flags]
    if missing:
        raise UserError(f"the standalone runtime needs a CPU with AVX2, FMA and F16C; this one lacks "
                        f"{', '.join(missing)}")
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise UserError(f"the standalone runtime compiles its kernels on first use with a C++ compiler; {compiler!r} "
                        "was not found (install g++, or set CXX)")
    path = cache.cache_dir() / "standalone" / f"libbitquilt_standalone-{_build_key(compiler)}.so"
    if path.is_file():
        return path
    with cache.file_lock("standalone-build"):
        if path.is_file():
            return path
        with cache.atomic_file(path) as tmp:
            result = subprocess.run([compiler, *FLAGS, "-o", str(tmp), *(str(CSRC / s) for s in SOURCES)],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                errors = [line for line in result.stderr.splitlines() if "error" in line][:5]
                raise UserError(f"compiling the standalone runtime's kernels failed ({compiler}):\n" +
                                "\n".join(errors or result.stderr.splitlines()[-5:]))
    return path


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
