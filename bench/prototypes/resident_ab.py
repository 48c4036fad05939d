"""Ad hoc: builds of `csrc/` on weights that stay in the last-level cache, as a small model's decode step reads them.

smollm2-135m's 210 linears (30 layers of q, k, v, o, gate, up, down; random uniform codes) are called in order, one
token, as one "step"; each round runs one step per build, the builds' order rotated each round, all builds
on the same layouts (32 MB at 2 bits, 56 MB at 4: resident in a large server L3). Median and 10th percentile of
thread CPU time per step, Python calls included (≈ 3 µs each). bench/prototypes/build_ab.py judges cold weights.

    python bench/prototypes/resident_ab.py old=/tmp/csrc_old new=csrc [--bits 2] [--rounds 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from build_ab import add_builds_argument, build_all, in_round_order  # noqa: E402
from kernel_speed import random_uniform  # noqa: E402

from bitquilt.kernels import q4_int8  # noqa: E402

LAYER = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))  # smollm2-135m
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_builds_argument(ap)
    ap.add_argument("--bits", type=int, choices=(4, 2), default=4)
    ap.add_argument("--rounds", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(1)
    builds = build_all(args.builds)
    group = 128 if args.bits == 4 else 64
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER * LAYERS
    layouts = [q4_int8.layout(random_uniform(n, k, args.bits, gen, group)) for n, k in shapes]
    x = {k: torch.randn(1, k, generator=gen) for k in {k for _, k in LAYER}}
    names = list(builds)
    steps: dict[str, list[float]] = {name: [] for name in names}
    print(f"{sum(lay.nbytes() for lay in layouts) / 1e6:.1f} MB of layouts; load average "
          f"{Path('/proc/loadavg').read_text().split()[:3]}")
    for r in range(args.rounds):
        for name in in_round_order(names, r):
            ext = builds[name]
            start = time.thread_time_ns()
            for (n, k), lay in zip(shapes, layouts, strict=True):
                ext.q4_int8_matmul(x[k], lay.codes, lay.scales, n, group, args.bits)
            steps[name].append((time.thread_time_ns() - start) / 1e6)
    for name, t in steps.items():
        p10 = sorted(t)[len(t) // 10]
        print(f"w{args.bits} {name}: median {statistics.median(t):.2f} ms, p10 {p10:.2f} ms per step")


if __name__ == "__main__":
    main()
