"""The standalone runtime's C library (csrc/standalone.cpp and the torch-free kernels) and the native runner
(`bitquilt-native`, csrc/native_runner.cpp on the same sources), compiled on first use.

Built with the system's C++ compiler (`$CXX`, default g++) for the AVX2 baseline, with the AVX-512 VNNI path
compiled in and taken at run time where the CPU has it (as the torch extension does), into
`$BITQUILT_CACHE/standalone/` under a name hashed from the sources and flags: an edit rebuilds, concurrent first
uses wait on one build (`bitquilt.cache.file_lock`), and a failed build leaves nothing behind. Loaded with ctypes;
`library()` returns the loaded library with every function's argument and result types declared; `runner_path()`
the runner's executable.
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

CSRC = Path(__file__).resolve().parents[2] / "kernels" / "csrc"
SOURCES = ("standalone.cpp", "bpe_tokenizer.cpp", "q4_int8.cpp", "q4_int8_vnni.cpp", "q4_int8_avxvnni.cpp",
           "uniform8_gemv.cpp", "uniform8_vnni.cpp")
HEADERS = ("avx2_simd.h", "bpe_tokenizer.h", "decoder_core.h", "int8_round.h", "json_value.h", "parallel.h",
           "q4_int8.h", "q4_int8_ymm.h", "standalone.h", "standalone_file.h", "stream_prefetch.h", "uniform8.h",
           "uniform8_rows.h", "vnni_dot.h")
RUNNER = "native_runner.cpp"  # main() of bitquilt-native, on the library's sources
FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
CPU_FLAGS = ("avx2", "fma", "f16c")  # the baseline the library is compiled for

_p, _i64 = ctypes.c_void_p, ctypes.c_int64  # any pointer, int64
SIGNATURES = {  # name: (result, arguments), as csrc/standalone.h declares them
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
    "bq_tokenizer_open": (_p, [_p]),
    "bq_tokenizer_free": (None, [_p]),
    "bq_tokenize": (_i64, [_p, ctypes.c_char_p, _i64, _p, _i64]),
    "bq_detokenize": (_i64, [_p, _p, _i64, ctypes.c_int, _p, _i64]),
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


def _build_key(compiler: str, sources: tuple[str, ...], flags: tuple[str, ...]) -> str:
    h = hashlib.sha256(" ".join((compiler, *flags)).encode())
    for name in (*sources, *HEADERS):
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    return h.hexdigest()[:16]


def _built(name: str, sources: tuple[str, ...], *links: tuple[str, ...]) -> Path:
    """`name` (a file name, "{key}" for the build key) compiled from `sources` with FLAGS and the first of `links`
    (flags) that links here, built first if this version of the sources has not been."""
    cpu = _cpu_flags()
    missing = [f for f in CPU_FLAGS if cpu and f not in cpu]
    if missing:
        raise UserError(f"the standalone runtime needs a CPU with AVX2, FMA and F16C; this one lacks "
                        f"{', '.join(missing)}")
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise UserError(f"the standalone runtime compiles its kernels on first use with a C++ compiler; {compiler!r} "
                        "was not found (install g++, or set CXX)")
    path = cache.cache_dir() / "standalone" / name.format(key=_build_key(compiler, sources, (*FLAGS, *sum(links, ()))))
    if path.is_file():
        return path
    with cache.file_lock("standalone-build"):
        if path.is_file():
            return path
        with cache.atomic_file(path) as tmp:
            for flags in links:
                result = subprocess.run([compiler, *FLAGS, *flags, "-o", str(tmp), *(str(CSRC / s) for s in sources)],
                                        capture_output=True, text=True)
                if result.returncode == 0:
                    break
            else:
                errors = [line for line in result.stderr.splitlines() if "error" in line][:5]
                raise UserError(f"compiling the standalone runtime's kernels failed ({compiler}):\n" +
                                "\n".join(errors or result.stderr.splitlines()[-5:]))
    return path


def library_path() -> Path:
    """The compiled library, built first if this version of the sources has not been."""
    return _built("libbitquilt_standalone-{key}.so", SOURCES, ("-fPIC", "-shared"))


def runner_path() -> Path:
    """The compiled native runner (`bitquilt-native`: a program without Python), built first if needed: linked
    statically where the toolchain has the static libraries (a program that runs on any x86-64 Linux with AVX2,
    2.4 MB less resident than with libstdc++ and libgomp shared), else against the shared ones (the choice made
    once, when it is built)."""
    return _built("bitquilt-native-{key}", (RUNNER, *SOURCES), ("-static",), ())


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
