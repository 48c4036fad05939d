"""Ad hoc: the batch-1 4-bit x int8 kernel on weights in cache against cold copies and a cold read of the same bytes.

Whether a shape is bound by instructions or by memory (docs/benchmarks.md, "Two loops that did not pay"): if the
kernel on the same weights over and over (hot) is no faster than one streaming read of them from DRAM, no memory
layout can bring it to the read ceiling. 1 thread, each path's calls and the read alternating within a round,
median thread CPU time.

    python bench/prototypes/hot_cold.py [--shapes 1536x1536,4096x4096] [--rounds 300]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_speed import alternating_cpu_ms, cold_copies, random_uniform  # noqa: E402

from bitquilt.kernels import cpu, q4_int8  # noqa: E402

GROUP = 128


def measure(n: int, k: int, rounds: int, gen: torch.Generator) -> tuple[dict[str, float], int]:
    """Median µs of each call (the kernel hot and cold on each instruction-set path, and the cold read, plain and
    prefetching as bench/kernel_speed.py's ceiling), and the bytes each reads."""
    ext = cpu.extension()
    layouts = [q4_int8.layout(random_uniform(n, k, 4, gen, GROUP)) for _ in range(cold_copies(n * k // 2))]
    buffers = [torch.randn(layouts[0].nbytes() // 128 * 32, generator=gen) for _ in layouts]
    x = torch.randn(1, k, generator=gen)

    def on(isa: str, lay) -> None:
        q4_int8.set_isa(isa)
        ext.q4_int8_matmul(x, lay.codes, lay.scales, n, GROUP, 4)

    isas = q4_int8.supported_isas()

    def cold(r: int, j: int):  # layouts[0] is the hot one; each cold call reads a copy no other call read lately
        return layouts[1 + (r * len(isas) + j) % (len(layouts) - 1)]

    ms = alternating_cpu_ms([{**{f"hot {isa}": (on, isa, layouts[0]) for isa in isas},
                              **{f"cold {isa}": (on, isa, cold(r, j)) for j, isa in enumerate(isas)},
                              "read": (ext.read_pass, buffers[2 * r % len(buffers)], 0),
                              "read prefetching": (ext.read_pass, buffers[(2 * r + 1) % len(buffers)],
                                                   *ext.prefetch_plan())}
                             for r in range(rounds)])
    q4_int8.set_isa()
    return {name: v * 1e3 for name, v in ms.items()}, layouts[0].nbytes()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1536x1536,4096x4096")
    p.add_argument("--rounds", type=int, default=300)
    args = p.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        us, nbytes = measure(n, k, args.rounds, gen)
        print(f"{n}x{k} ({nbytes / 1e6:.2f} MB): " + ", ".join(f"{name} {v:.1f} µs" for name, v in us.items())
              + f"; read ceiling {nbytes / min(us['read'], us['read prefetching']) / 1e3:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
