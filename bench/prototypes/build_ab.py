"""Ad hoc: the batch-1 int8-activation kernel of two or more builds of `csrc/`, alternating on cold weights.

How a kernel change is judged on this noisy host (docs/benchmarks.md, "Prefetch on the VNNI path"): each source tree
is built as its own extension, and in every round each build's kernel reads its own cold copy of the weights (the
builds in an order rotated each round: in one run the first build of every round ran 3-8% slower), beside the read
ceiling (this tree's read passes: plain, prefetching into L1 2 or 8 KB ahead, and as this tree's kernels prefetch on
this CPU); medians of thread CPU time over the rounds. gemv_ab.py and resident_ab.py share its build helpers.

    python bench/prototypes/build_ab.py old=/tmp/csrc_old new=csrc [--bits 2] [--isas avx512,avx2]

Each build takes a few minutes (`bitquilt.native_build`'s torch extension target; kept under /tmp/bitquilt_ab/<name>
while that tree's sources are unchanged).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_speed import cold_copies, random_uniform  # noqa: E402

from bitquilt import native_build  # noqa: E402
from bitquilt.isa import INT8_ISAS as ISAS  # noqa: E402
from bitquilt.kernels import cpu, q4_int8  # noqa: E402

SHAPES = "1536x1536,8960x1536,1536x8960,4096x4096"
READ_PREFETCH = ((0, 0), (2048, 0), (8192, 0))  # (into L1, into L2) bytes ahead in the ceiling's read passes


def cpu_us(fn, *args) -> float:
    start = time.thread_time_ns()
    fn(*args)
    return (time.thread_time_ns() - start) / 1e3


def compare(builds: dict, shapes: list[tuple[int, int]], bits: int, isas: list[str], rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    reader = cpu.extension()
    passes = (*READ_PREFETCH, tuple(reader.prefetch_plan()))
    for n, k in shapes:
        layouts = [q4_int8.layout(random_uniform(n, k, bits, gen, 128 if bits == 4 else 64))
                   for _ in range(cold_copies(n * k * bits // 8))]
        nbytes = layouts[0].nbytes()
        buffers = [torch.randn(nbytes // 128 * 32, generator=gen) for _ in range(cold_copies(nbytes))]
        x = torch.randn(1, k, generator=gen)
        times: dict[str, list[float]] = {f"{isa} {name}": [] for isa in isas for name in builds}
        reads: dict[tuple[int, int], list[float]] = {d: [] for d in passes}
        copy = 0
        for r in range(rounds):
            for isa in isas:
                for name in in_round_order(list(builds), r):
                    ext = builds[name]
                    lay = layouts[copy % len(layouts)]
                    copy += 1
                    ext.q4_int8_set_isa(ISAS.index(isa))
                    times[f"{isa} {name}"].append(cpu_us(ext.q4_int8_matmul, x, lay.codes, lay.scales, n, lay.group,
                                                         lay.bits))
            for ahead in reads:
                reads[ahead].append(cpu_us(reader.read_pass, buffers[copy % len(buffers)], *ahead))
                copy += 1
        print("reads, GB/s by (L1, L2) bytes ahead: " + ", ".join(
            f"{ahead} {nbytes / statistics.median(t) / 1e3:.1f}" for ahead, t in reads.items()))
        ceiling = max(nbytes / statistics.median(t) / 1e3 for t in reads.values())
        cells = [f"{key} {statistics.median(t):.1f} µs ({100 * nbytes / statistics.median(t) / 1e3 / ceiling:.0f}%)"
                 for key, t in times.items()]
        print(f"w{bits} {n}x{k}, ceiling {ceiling:.1f} GB/s: " + ", ".join(cells), flush=True)


def in_round_order(names: list[str], r: int) -> list[str]:
    """The builds' order in round r: rotated by r, so that each build takes each place equally often."""
    return names[r % len(names):] + names[:r % len(names)]


def named_source(arg: str) -> tuple[str, Path]:
    """`name=path` of a build: a name usable in a module name and a folder holding the extension's sources."""
    name, _, path = arg.partition("=")
    if not name.isidentifier() or not native_build.has_sources(native_build.TORCH_EXTENSION, Path(path)):
        raise argparse.ArgumentTypeError(f"{arg!r}: expected name=path, the name a Python identifier and the path a "
                                         "copy of csrc/")
    return name, Path(path)


def add_builds_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("builds", nargs="+", type=named_source, help="name=path of a copy of csrc/")


def build_all(sources: list[tuple[str, Path]]) -> dict[str, ModuleType]:
    """Each `named_source` built as its own extension (kept under /tmp/bitquilt_ab/<name>), by name."""
    return {name: cpu.build_extension(f"bitquilt_ab_{name}", path, Path("/tmp/bitquilt_ab") / name)
            for name, path in sources}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_builds_argument(ap)
    ap.add_argument("--bits", type=int, choices=(4, 2), default=4)
    ap.add_argument("--isas", default="avx512,avx2", help=f"of: {', '.join(ISAS)}")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    builds = build_all(args.builds)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"load average {Path('/proc/loadavg').read_text().split()[:3]}")
    compare(builds, shapes, args.bits, args.isas.split(","), args.rounds)
    print(f"load average {Path('/proc/loadavg').read_text().split()[:3]}")


if __name__ == "__main__":
    main()
