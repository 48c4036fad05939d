"""MosaicQuant kernel benchmark: what a sparse 4-bit residual costs on top of the dense base kernel, fused or not.

For random W4 g128 layers (RTN of Gaussian weights) plus a residual of r×c int4 tiles chosen at
random at each density, three ways to compute the same x @ Ŵᵀ (`bitquilt.kernels.mosaic`):

  dense       the base alone (the cost without a residual)
  two-kernel  the base kernel, then `sparse_residual_add_` over y (a second pass over y)
  fused       the residual added inside the base kernel, tile by tile ("ZipperEngine")

Each sample times a loop of calls lasting ≥ ~2 ms (variants interleaved, so all see the same load),
the median of `repeat` samples is reported per call, as wall time and as process CPU time
(time.process_time, all threads). Weights stay cache-resident across calls (smollm2-135m layers are
0.2-0.5 MB at 4 bits), so these are compute costs, not memory-bound decode costs. Overheads are ratios
to dense. Writes bench/results/mosaic_kernels.{json,md}.

    python bench/mosaic_kernels.py                       # smollm2-135m shapes, 1 thread
    python bench/mosaic_kernels.py --threads 2 --densities 0.05,0.1,0.2 --batches 1,8,64
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable

import torch
from common import RESULTS, finish, parser, run, run_facts, run_header, write_atomic

from bitquilt.formats import CompositeFormat, SparseBlockFormat
from bitquilt.kernels import cpu, mosaic
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec

SHAPES = [(576, 576), (1536, 576), (576, 1536)]  # smollm2-135m linears, (out, in)
DENSITIES = [0.05, 0.1, 0.2]
BATCHES = [1, 8, 64]
VARIANTS = {"dense": mosaic.dense_matmul, "two_kernel": mosaic.two_pass_matmul, "fused": mosaic.fused_matmul}
SAMPLE_S = 2e-3  # seconds of calls per timing sample


def mosaic_layer(out: int, inp: int, density: float, block: tuple[int, int], seed: int = 0) -> CompositeFormat:
    """RTN W4 g128 of Gaussian weights plus `density` of the r×c tiles of its error (random tiles) in int4."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen) * 0.02
    base = get_solver("rtn")(w, None, LayerSpec(bits=4, group_size=128))
    n_tiles = out // block[0] * (inp // block[1])
    index = torch.randperm(n_tiles, generator=gen)[:max(1, round(density * n_tiles))]  # at least one tile
    return CompositeFormat({"base": base, "residual": SparseBlockFormat.from_dense(w - base.dequantize(), index,
                                                                                   block)})


def calls_per_sample(fn: Callable[[], object]) -> int:
    """Calls of `fn` that take about SAMPLE_S (after one warm-up call)."""
    fn()
    t0 = time.perf_counter()
    fn()
    return max(1, round(SAMPLE_S / max(time.perf_counter() - t0, 1e-7)))


def sample(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(wall ms, process CPU ms) per call over `calls` calls."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e3 / calls, (time.process_time() - c0) * 1e3 / calls


def kernel_latency(shapes=SHAPES, densities=DENSITIES, batches=BATCHES, block: tuple[int, int] = (1, 32),
                   threads: int = 1, repeat: int = 15, log: Callable[[dict], None] | None = None) -> list[dict]:
    """Median per-call latency of dense, two-kernel and fused on each (shape, density, batch): one dict each."""
    if cpu.extension() is None:
        raise RuntimeError("the CPU extension is unavailable; nothing to benchmark")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        with torch.no_grad():
            for out, inp in shapes:
                for density in densities:
                    fmt = mosaic_layer(out, inp, density, block)
                    base, residual = fmt.parts["base"], fmt.parts["residual"]
                    for batch in batches:
                        x = torch.randn(batch, inp, generator=torch.Generator().manual_seed(batch))
                        fns = {name: functools.partial(f, fmt, x) for name, f in VARIANTS.items()}
                        calls = {name: calls_per_sample(fn) for name, fn in fns.items()}
                        times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
                        for _ in range(repeat):
                            for name, fn in fns.items():
                                times[name].append(sample(fn, calls[name]))
                        row = dict(out=out, inp=inp, density=residual.density, block=list(block), batch=batch,
                                   threads=threads, path="sgemm" if batch >= cpu._SGEMM_BATCH[4] else "lut",
                                   base_bytes=cpu.packed(base).nbytes(),
                                   residual_bytes=mosaic.segments(residual).nbytes())
                        for name, t in times.items():
                            wall, cpu_ms = zip(*t)
                            row[f"{name}_ms"] = statistics.median(wall)
                            row[f"{name}_cpu_ms"] = statistics.median(cpu_ms)
                        for name in ("fused", "two_kernel"):
                            row[f"{name}_over_dense"] = row[f"{name}_ms"] / row["dense_ms"]
                            row[f"{name}_over_dense_cpu"] = row[f"{name}_cpu_ms"] / row["dense_cpu_ms"]
                        rows.append(row)
                        if log is not None:
                            log(row)
    finally:
        torch.set_num_threads(before)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# MosaicQuant kernels: dense base vs base + sparse int4 residual (two kernels, fused)",
        "",
        run_header(meta),
        "",
        f"Random W4 g128 base (RTN) plus a residual of {meta['block'][0]}×{meta['block'][1]} int4 tiles at random; "
        f"{meta['threads']} thread(s); median of {meta['repeat']} samples per call, weights cache-resident. "
        "Cells: dense ms, then fused / dense and two-kernel / dense (wall time; CPU time in the JSON). "
        f"Batches from {cpu._SGEMM_BATCH[4]} on take the dequantize + sgemm path, smaller ones the lookup tables.",
        "",
    ] + latency_table(rows)
    return "\n".join(lines) + "\n"


def latency_table(rows: list[dict]) -> list[str]:
    """Markdown rows: per shape and density, per batch: dense ms; fused / dense and two-kernel / dense."""
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    lines = ["| out×in | density | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---|---|" + "---|" * len(batches)]
    for key in dict.fromkeys((r["out"], r["inp"], r["density"]) for r in rows):
        cells = {r["batch"]: r for r in rows if (r["out"], r["inp"], r["density"]) == key}
        lines.append(f"| {key[0]}×{key[1]} | {100 * key[2]:.0f}% | " + " | ".join(
            f"{c['dense_ms']:.3f} ms; {c['fused_over_dense']:.2f}× / {c['two_kernel_over_dense']:.2f}×"
            if (c := cells.get(b)) else "" for b in batches) + " |")
    return lines


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    ap = parser(__doc__.splitlines()[0], threads=1, helps={"threads": "torch/OpenMP threads (default 1)"})
    ap.add_argument("--densities", type=floats, default=DENSITIES, help="residual tile densities, e.g. 0.05,0.1,0.2")
    ap.add_argument("--batches", type=ints, default=BATCHES, help="tokens per call, e.g. 1,8,64")
    ap.add_argument("--block", default="1x32", help="residual tile shape r x c, c a multiple of 32 (default 1x32)")
    ap.add_argument("--repeat", type=int, default=15, help="timing samples per variant (median reported)")
    args = ap.parse_args()
    block = tuple(int(v) for v in args.block.lower().split("x"))
    torch.set_num_threads(args.threads)  # before run_facts(): its machine record states the thread count
    meta = dict(**run_facts(), threads=args.threads, block=list(block), repeat=args.repeat)

    def log(r: dict) -> None:
        print(f"{r['out']}x{r['inp']} density {r['density']:.3f} batch {r['batch']:3d} ({r['path']}): "
              f"dense {r['dense_ms']:.4f} ms  two-kernel {r['two_kernel_ms']:.4f} ms "
              f"({r['two_kernel_over_dense']:.2f}x)  fused {r['fused_ms']:.4f} ms ({r['fused_over_dense']:.2f}x)",
              flush=True)

    rows = kernel_latency(SHAPES, args.densities, args.batches, block, args.threads, args.repeat, log)
    finish(meta)
    write_atomic(RESULTS / "mosaic_kernels.json", json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
    write_atomic(RESULTS / "mosaic_kernels.md", markdown(rows, meta))
    print(f"wrote {RESULTS / 'mosaic_kernels.json'} and {RESULTS / 'mosaic_kernels.md'}")


if __name__ == "__main__":
    run(main)
