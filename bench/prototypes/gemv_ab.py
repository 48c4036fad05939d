"""Ad hoc: the batch-1 MXINT GEMV or bit-plane lookup-table kernel of two or more builds of `csrc/`, on cold weights.

For qwen2.5-1.5b's shapes (random codes, as bench/kernel_speed.py makes them): `--kernel mxint` a 4-bit MXINT weight
and an MXSens 8/6/4 one through `mxint_gemv` (on `--isa`); `--kernel lut` uniform 4-bit g128 and 2-bit g64 weights
through `lut_matmul`. Each round calls every build on its own cold copy, the builds' order rotated each round;
medians of thread CPU time and the layout's bytes per second (build_ab.py does the same for the int8 kernels).

    python bench/prototypes/gemv_ab.py old=/tmp/csrc_old new=csrc --kernel mxint [--isa avx2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from build_ab import add_builds_argument, build_all, in_round_order  # noqa: E402
from kernel_speed import cold_copies, mxsens_columns, random_mxint, random_uniform  # noqa: E402

from bitquilt.kernels import cpu  # noqa: E402
from bitquilt.kernels import mxint as mxk  # noqa: E402

SHAPES = ((1536, 1536), (8960, 1536), (1536, 8960))
MXINT_ISA_CODE = {"avx2": 0, "avx512": 1}  # mxint_gemv's `isa` argument

# A case: its label, its bytes, its cold copies, and how a build runs one copy on one token.
Case = tuple[str, int, list, Callable]


def mxint_cases(n: int, k: int, gen: torch.Generator, isa: str) -> Iterator[Case]:
    for label, fmt in (("mxint4", random_mxint(n, k, [4], [k], False, gen)),
                       ("mxsens 8/6/4", random_mxint(n, k, *mxsens_columns(k), True, gen))):
        lay = mxk.layout(fmt)
        copies = [dataclasses.replace(lay, weights=lay.weights.clone(), exponents=lay.exponents.clone())
                  for _ in range(cold_copies(lay.nbytes()))]
        xs = lay.prepare(torch.randn(1, k, generator=gen))
        yield (f"{isa} {label}", lay.nbytes(), copies,
               lambda ext, c, xs=xs: ext.mxint_gemv(xs, c.weights, c.exponents, c.segments, MXINT_ISA_CODE[isa]))


def lut_cases(n: int, k: int, gen: torch.Generator, isa: str) -> Iterator[Case]:
    for bits, group in ((4, 128), (2, 64)):
        p = cpu.packed(random_uniform(n, k, bits, gen, group))
        copies = [dataclasses.replace(p, planes=p.planes.clone(), coeffs=p.coeffs.clone())
                  for _ in range(cold_copies(p.nbytes()))]
        x = torch.randn(1, k, generator=gen)
        yield f"w{bits} g{group}", p.nbytes(), copies, lambda ext, c, x=x: ext.lut_matmul(x, *c._args(), [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_builds_argument(ap)
    ap.add_argument("--kernel", choices=("mxint", "lut"), required=True)
    ap.add_argument("--isa", choices=mxk.supported_isas(), default=mxk.supported_isas()[-1], help="--kernel mxint")
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    builds = build_all(args.builds)
    names = list(builds)
    cases = mxint_cases if args.kernel == "mxint" else lut_cases
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        for label, nbytes, copies, run in cases(n, k, gen, args.isa):
            times: dict[str, list[float]] = {name: [] for name in names}
            copy = 0
            for r in range(args.rounds):
                for name in in_round_order(names, r):
                    c = copies[copy % len(copies)]
                    copy += 1
                    start = time.thread_time_ns()
                    run(builds[name], c)
                    times[name].append((time.thread_time_ns() - start) / 1e3)
            cells = [f"{name} {statistics.median(t):.1f} µs ({nbytes / statistics.median(t) / 1e3:.1f} GB/s)"
                     for name, t in times.items()]
            print(f"{n}x{k} {label}, {nbytes / 1e6:.1f} MB: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
