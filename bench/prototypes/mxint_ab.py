"""Ad hoc: the MXINT GEMV (batch 1) of two or more builds of `csrc/`, alternating on cold weights.

For qwen2.5-1.5b's shapes, a 4-bit MXINT weight and an MXSens 8/6/4 one (random codes, as bench/kernel_speed.py's
--mxint makes them); each round calls every build's `mxint_gemv` on its own cold copy, the builds' order reversed
every other round; medians of thread CPU time and the layout's bytes per second.

    python bench/prototypes/mxint_ab.py old=/tmp/csrc_old new=bitquilt/kernels/csrc [--isa avx2] [--rounds 60]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from build_ab import named_source  # noqa: E402
from kernel_speed import cold_copies, mxsens_columns, random_mxint  # noqa: E402

from bitquilt.kernels import cpu  # noqa: E402
from bitquilt.kernels import mxint as mxk  # noqa: E402

SHAPES = ((1536, 1536), (8960, 1536), (1536, 8960))
ISA_CODE = {"avx2": 0, "avx512": 1}  # mxint_gemv's `isa` argument


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", type=named_source, help="name=path of a copy of bitquilt/kernels/csrc")
    ap.add_argument("--isa", choices=mxk.supported_isas(), default=mxk.supported_isas()[-1])
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    builds = {name: cpu.build_extension(f"bitquilt_ab_{name}", path, Path("/tmp/bitquilt_ab") / name)
              for name, path in args.builds}
    names = list(builds)
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        for label, fmt in (("mxint4", random_mxint(n, k, [4], [k], False, gen)),
                           ("mxsens 8/6/4", random_mxint(n, k, *mxsens_columns(k), True, gen))):
            lay = mxk.layout(fmt)
            copies = [dataclasses.replace(lay, weights=lay.weights.clone(), exponents=lay.exponents.clone())
                      for _ in range(cold_copies(lay.nbytes()))]
            xs = lay.prepare(torch.randn(1, k, generator=gen))
            times: dict[str, list[float]] = {name: [] for name in names}
            copy = 0
            for r in range(args.rounds):
                for name in names if r % 2 else names[::-1]:
                    c = copies[copy % len(copies)]
                    copy += 1
                    start = time.thread_time_ns()
                    builds[name].mxint_gemv(xs, c.weights, c.exponents, c.segments, ISA_CODE[args.isa])
                    times[name].append((time.thread_time_ns() - start) / 1e3)
            cells = [f"{name} {statistics.median(t):.1f} µs ({lay.nbytes() / statistics.median(t) / 1e3:.1f} GB/s)"
                     for name, t in times.items()]
            print(f"{args.isa} {n}x{k} {label}, {lay.nbytes() / 1e6:.1f} MB: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
