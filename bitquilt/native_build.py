"""The one description of bitquilt's C++ build (what is compiled from `csrc/`, with which flags, into which file) and
the builder that runs it: at install time (setup.py's build hook), by `make kernels` (`python -m
bitquilt.native_build`), and for benchmarks that compare builds of edited sources (`kernels.cpu.build_extension`).

Three targets, each for the AVX2 baseline with the AVX-512 VNNI and AVX-VNNI paths compiled in (per-file target
pragmas) and chosen at run time by CPU flags:

- the torch extension (`bitquilt.kernels.cpu`): every kernel and the fused decode step; built only where torch
  imports, against torch's headers and libraries, with the flags torch.utils.cpp_extension uses;
- the standalone runtime's C library (`bitquilt.runtime.standalone.library`, loaded with ctypes): no torch;
- `bitquilt-native`, the runner: the library's sources and a main(), linked statically where the toolchain can (a
  program that runs on any x86-64 Linux with AVX2), else against the shared C++ and OpenMP libraries.

Each product goes into the package's `_native/` folder with `<product>.hash` beside it: a hash of its sources, the
headers they include and its flags. Nothing compiles at run time: the loaders take the product as built, and where
the package sits in a checkout (`csrc/` beside it) refuse one whose hash differs from the sources' (`problem`), so
an edited source never runs silently on an old binary. Standard library only: setup.py loads this file by path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CSRC = PACKAGE.parent / "csrc"  # a checkout's sources (an installed package has none)
OUT = PACKAGE / "_native"
BASELINE = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
HOW_TO_BUILD = "`make kernels` in a checkout, or `pip install` with g++ on PATH, builds it"


class BuildError(Exception):
    """A target that did not compile or link (the compiler's first error lines)."""


@dataclass(frozen=True)
class Target:
    what: str  # its name in messages
    output: str  # the product's file name
    sources: tuple[str, ...]  # under csrc/; the headers they include are found by `files`
    flags: tuple[str, ...]  # compiling and linking
    links: tuple[tuple[str, ...], ...] = ((),)  # link flags: the first set that links is used
    torch: bool = False  # a torch extension: torch's headers and libraries, module name = output's stem

    @property
    def module(self) -> str:
        return self.output.split(".")[0]


INT8_KERNELS = ("kernels/q4_int8.cpp", "kernels/avx512/q4_int8.cpp", "kernels/avxvnni/q4_int8.cpp",
                "kernels/uniform8_gemv.cpp", "kernels/avx512/uniform8.cpp")
# torch-free: built into every target
SHARED_KERNELS = (*INT8_KERNELS, "kernels/lut_parts.cpp", "kernels/plane_int8.cpp", "kernels/avx512/plane_int8.cpp")
STANDALONE = ("runtime/standalone.cpp", "text/bpe_tokenizer.cpp", *SHARED_KERNELS)
TORCH_EXTENSION = Target(
    "the CPU kernels' torch extension", "bitquilt_cpu.so",
    ("kernels/lut_matmul.cpp", "kernels/mxint_matmul.cpp", "kernels/slice_router.cpp", "kernels/hadamard.cpp",
     "kernels/repack.cpp", "kernels/read_rate.cpp", "runtime/decode_step.cpp", *SHARED_KERNELS),
    ("-fPIC", "-std=c++20", *BASELINE), (("-shared",),), torch=True)
LIBRARY = Target("the standalone runtime library", "libbitquilt_standalone.so", STANDALONE,
                 ("-fPIC", "-std=c++17", *BASELINE), (("-shared",),))
RUNNER = Target("the native runner (bitquilt-native)", "bitquilt-native", ("runtime/native_runner.cpp", *STANDALONE),
                ("-std=c++17", *BASELINE), (("-static",), ()))
TARGETS = (TORCH_EXTENSION, LIBRARY, RUNNER)

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def files(target: Target, root: Path = CSRC) -> list[str]:
    """The target's sources and every header under `root` they include, transitively (includes are root-relative)."""
    seen: set[str] = set()
    todo = list(target.sources)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [inc for inc in _INCLUDE.findall((root / name).read_text()) if (root / inc).is_file()]
    return sorted(seen)


def source_hash(target: Target, root: Path = CSRC) -> str:
    """A hash of the target's flags and of every file `files` lists, names and contents."""
    h = hashlib.sha256(repr((target.flags, target.links)).encode())
    for name in files(target, root):
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    return h.hexdigest()


def _stamp_path(product: Path) -> Path:
    return product.with_name(product.name + ".hash")


def _stamp(product: Path) -> str | None:
    """The hash recorded beside `product`, None if there is none."""
    try:
        return _stamp_path(product).read_text().strip()
    except OSError:
        return None


def has_sources(target: Target, root: Path = CSRC) -> bool:
    """Whether `root` holds the target's sources (a checkout does; an installed package has none beside it)."""
    return all((root / s).is_file() for s in target.sources)


def is_current(target: Target, out: Path = OUT, root: Path = CSRC) -> bool:
    """Whether the product in `out` was built from the sources in `root` with the target's flags."""
    product = out / target.output
    return product.is_file() and _stamp(product) == source_hash(target, root)


def problem(target: Target, out: Path = OUT, root: Path = CSRC) -> str | None:
    """Why the target's product in `out` must not be used, in one line, or None: it was not built, or `root` holds
    its sources (a checkout) and they or the flags differ from those it was built from."""
    product = out / target.output
    if not product.is_file():
        return f"{target.what} is not built (no {product}): {HOW_TO_BUILD}"
    if has_sources(target, root) and not is_current(target, out, root):
        return f"{target.what} ({product}) is older than its sources in {root}: `make kernels` rebuilds it"
    return None


def _torch_flags(module: str) -> tuple[list[str], list[str]]:
    """Compile and link flags of a torch extension named `module`, as torch.utils.cpp_extension builds one."""
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    compile_flags = [f"-DTORCH_EXTENSION_NAME={module}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                     *(f"-isystem{p}" for p in includes)]
    link_flags = [*(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-ltorch",
                  "-ltorch_python"]
    return compile_flags, link_flags


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if "error" in line][:5]
        raise BuildError("\n".join(errors or done.stderr.splitlines()[-5:]))


def _compile(target: Target, root: Path, work: Path) -> Path:
    """The product linked in `work` from its sources compiled in parallel (one object per source)."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler: {compiler!r} was not found (install g++, or set CXX)")
    cflags, ldflags = _torch_flags(target.module) if target.torch else ([], [])
    flags = [*target.flags, f"-I{root}", *cflags]
    objects = [work / (s.replace("/", "_") + ".o") for s in target.sources]
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(lambda src, obj: _run([compiler, *flags, "-c", str(root / src), "-o", str(obj)]),
                      target.sources, objects))
    product = work / target.output
    failures = []
    for link in target.links:
        try:
            _run([compiler, *target.flags, *link, "-o", str(product), *map(str, objects), *ldflags])
            return product
        except BuildError as e:
            failures.append(e)
    raise failures[-1]


def build(target: Target, out: Path = OUT, root: Path = CSRC) -> Path:
    """The target built from the sources in `root` into `out` with its hash beside it, unless the product there is
    current; its path. BuildError when it does not compile; the product and hash in `out` are replaced only by a
    build that succeeded."""
    product = out / target.output
    if is_current(target, out, root):
        return product
    key = source_hash(target, root)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bitquilt-build-") as work:
        built = _compile(target, root, Path(work))
        _stamp_path(product).unlink(missing_ok=True)
        staged = out / f".{target.output}.{os.getpid()}"
        shutil.copy2(built, staged)
        os.replace(staged, product)
    _stamp_path(product).write_text(key + "\n")
    return product


def build_all(out: Path = OUT, root: Path = CSRC, log: Callable[[str], None] = print) -> bool:
    """Every target into `out`, one line each (the torch extension only where torch imports); False if one failed."""
    ok = True
    for target in TARGETS:
        if target.torch and importlib.util.find_spec("torch") is None:
            log(f"bitquilt: skipped {target.what}: torch does not import here (the torch reference path runs instead)")
            continue
        current = is_current(target, out, root)
        try:
            product = build(target, out, root)
        except BuildError as e:
            ok = False
            log(f"bitquilt: building {target.what} failed:\n{e}")
            continue
        log(f"bitquilt: {target.what}: {product}{' (up to date)' if current else ''}")
    return ok


def main(argv: list[str] | None = None) -> int:
    """`python -m bitquilt.native_build` (`make kernels`): every target brought up to date in the package."""
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print(f"bitquilt: error: python -m bitquilt.native_build takes no arguments, got {' '.join(argv)!r} (it "
              f"builds what is missing or older than its sources in {CSRC} into {OUT})", file=sys.stderr)
        return 2
    if not CSRC.is_dir():
        print(f"bitquilt: error: no C++ sources in {CSRC}: build from a checkout", file=sys.stderr)
        return 2
    return 0 if build_all() else 1


if __name__ == "__main__":
    sys.exit(main())
