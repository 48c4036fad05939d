"""CPU kernel benchmark: bitquilt.kernels.cpu against torch fp32, cold weights.

Every timed call reads a different copy of the weights (copies rotate through > 96 MiB, three
times the 32 MiB L3), kernel and fp32 calls alternate so both see the same machine load, and
the median of the repeats is reported. Writes bench/results/kernels.{json,md}.

    python bench/kernels.py           # 4 shapes x batch 1/16/128 x 1/2 threads, bitplane and uniform
    python bench/kernels.py --quick   # 4096², batch 1, 1 thread, 2/3/4 bits (< 1 minute)
    python bench/kernels.py --crossover  # batch size where dequantize+sgemm overtakes the tables
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch
from common import RESULTS, cpu_name, loadavg, run, write_atomic

from bitquilt.formats import BitplaneFormat, UniformFormat
from bitquilt.kernels import cpu

COLD_BYTES = 96 << 20
GROUP = 128
SHAPES = [(2048, 2048), (4096, 4096), (4096, 11008), (11008, 4096)]  # (N out, K in)
REPEATS = {1: 25, 16: 7, 128: 3}


def random_words(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """int32 words of random bits: random planes or random bit-stream packed codes."""
    *lead, words = shape
    return torch.randint(0, 256, (*lead, words * 4), generator=gen, dtype=torch.uint8).view(torch.int32)


def random_bitplane(n: int, k: int, bits: int, gen: torch.Generator) -> BitplaneFormat:
    coeffs = (torch.randn(n, k // GROUP, bits + 1, generator=gen) * 0.02).half()
    return BitplaneFormat(random_words((bits, n, k // 32), gen), coeffs, bits, GROUP, k)


def random_uniform(n: int, k: int, bits: int, gen: torch.Generator) -> UniformFormat:
    scales = (torch.rand(n, k // GROUP, generator=gen) * 0.01 + 1e-3).half()
    zeros = torch.randint(0, 2**bits, (n, k // GROUP), generator=gen, dtype=torch.uint8)
    return UniformFormat(random_words((n, k * bits // 32), gen), scales, zeros, bits, GROUP, k)


def cold_copies(nbytes: int) -> int:
    return max(2, -(-COLD_BYTES // nbytes))


def timed(fn, *args) -> tuple[float, float]:
    """(wall ms, this thread's CPU ms): the latter leaves out time the scheduler gave to others."""
    t0, c0 = time.perf_counter(), time.thread_time()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3


def bench_shape(n: int, k: int, batches, threads_list, formats, log) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(n, k, generator=gen) for _ in range(cold_copies(n * k * 4))]
    kernels = []
    for name, bits in formats:
        fmt = (random_bitplane if name == "bitplane" else random_uniform)(n, k, bits, gen)
        p = cpu.packed(fmt)
        copies = [p] + [dataclasses.replace(p, planes=p.planes.clone(), coeffs=p.coeffs.clone())
                        for _ in range(cold_copies(p.nbytes()) - 1)]
        kernels.append((name, bits, copies))
    rows = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        for batch in batches:
            x = torch.randn(batch, k, generator=gen)
            fp32_t: list[tuple[float, float]] = []
            for name, bits, copies in kernels:
                t = []
                for r in range(REPEATS[batch]):
                    t.append(timed(copies[r % len(copies)].matmul, x))
                    fp32_t.append(timed(torch.nn.functional.linear, x, fp32[r % len(fp32)]))
                wall, cpu_ms = zip(*t)
                rows.append(dict(format=name, bits=bits, group_size=GROUP, N=n, K=k, batch=batch, threads=threads,
                                 ms=statistics.median(wall), ms_min=min(wall), cpu_ms=statistics.median(cpu_ms),
                                 bytes=copies[0].nbytes()))
            f32_wall, f32_cpu = (statistics.median(v) for v in zip(*fp32_t))
            for row in rows[-len(kernels):]:
                row.update(fp32_ms=f32_wall, speedup_vs_fp32=f32_wall / row["ms"], fp32_cpu_ms=f32_cpu,
                           speedup_cpu=f32_cpu / row["cpu_ms"], **{"GB/s": row.pop("bytes") / row["ms"] / 1e6})
                if threads > 1:  # CPU time of the calling thread says nothing about a parallel region
                    for key in ("cpu_ms", "fp32_cpu_ms", "speedup_cpu"):
                        row[key] = None
                log(row)
    return rows


def crossover() -> None:
    """Tables vs dequantize+sgemm by batch size, 4096², 1 thread (CPU time): tunes cpu._SGEMM_BATCH."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print("bits batch  tables ms  sgemm ms  (median CPU time of the calling thread)")
    for bits in (2, 3, 4, 8):
        p = cpu.packed((random_uniform if bits == 8 else random_bitplane)(4096, 4096, bits, gen))
        for batch in (16, 32, 64, 128, 256):
            x = torch.randn(batch, 4096, generator=gen)
            lut = statistics.median(timed(p.lut, x)[1] for _ in range(5))
            mm = statistics.median(timed(p.sgemm, x)[1] for _ in range(5))
            print(f"{bits:4d} {batch:5d} {lut:10.1f} {mm:9.1f}", flush=True)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# CPU kernels vs torch fp32 (cold weights)",
        "",
        f"{meta['cpu']}; torch {meta['torch']}; load average at start {meta['loadavg_start']}, "
        f"at end {meta['loadavg_end']}. Group size 128, random weights; medians of alternating kernel and "
        "fp32 calls; GB/s counts the bytes the kernel streams (packed planes + coefficients).",
        "",
        "On a shared machine the wall-clock columns flatter the kernels (a 5 ms fp32 call is preempted more",
        "often than a 1 ms kernel call) and 2-thread runs wait on descheduled OpenMP workers; with 1 thread",
        "the CPU-time columns (time the calling thread actually ran) are the better estimate.",
        "",
        "| format | bits | N×K | batch | threads | ms (median) | ms (min) | fp32 ms | speedup | GB/s "
        "| CPU ms | fp32 CPU ms | CPU speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def opt(v, spec):
        return "–" if v is None else format(v, spec)

    for r in rows:
        lines.append(f"| {r['format']} | {r['bits']} | {r['N']}×{r['K']} | {r['batch']} | {r['threads']} | "
                     f"{r['ms']:.3f} | {r['ms_min']:.3f} | {r['fp32_ms']:.2f} | {r['speedup_vs_fp32']:.1f}× | "
                     f"{r['GB/s']:.1f} | {opt(r['cpu_ms'], '.3f')} | {opt(r['fp32_cpu_ms'], '.2f')} | "
                     f"{opt(r['speedup_cpu'], '.1f')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4096² batch 1, 1 thread, bits 2/3/4 only")
    ap.add_argument("--crossover", action="store_true", help="tables vs sgemm by batch size (prints only)")
    args = ap.parse_args()
    if cpu.extension() is None:
        raise SystemExit("the CPU extension is unavailable; nothing to benchmark")
    torch.set_grad_enabled(False)
    if args.crossover:
        crossover()
        return
    if args.quick:
        shapes, batches, threads = [(4096, 4096)], [1], [1]
        formats = [("bitplane", b) for b in (2, 3, 4)] + [("uniform", b) for b in (2, 3, 4)]
    else:
        shapes, batches, threads = SHAPES, [1, 16, 128], [1, 2]
        formats = [("bitplane", b) for b in (2, 3, 4)] + [("uniform", b) for b in (2, 3, 4, 8)]
    meta = dict(cpu=f"{cpu_name()}, {os.cpu_count()} cores", torch=torch.__version__, loadavg_start=loadavg(),
                quick=args.quick)

    def log(r: dict) -> None:
        cpu_time = ""
        if r["cpu_ms"] is not None:
            cpu_time = f"  | CPU {r['cpu_ms']:.3f} vs {r['fp32_cpu_ms']:.2f} ms {r['speedup_cpu']:.1f}x"
        print(f"{r['format']:8s} w{r['bits']} {r['N']}x{r['K']} batch {r['batch']:3d} threads {r['threads']}: "
              f"{r['ms']:8.3f} ms (min {r['ms_min']:.3f})  fp32 {r['fp32_ms']:8.2f} ms  "
              f"{r['speedup_vs_fp32']:5.1f}x  {r['GB/s']:5.1f} GB/s{cpu_time}", flush=True)

    rows = []
    for n, k in shapes:
        rows += bench_shape(n, k, batches, threads, formats, log)
    meta["loadavg_end"] = loadavg()
    write_atomic(RESULTS / "kernels.json", json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
    write_atomic(RESULTS / "kernels.md", markdown(rows, meta))
    print(f"wrote {RESULTS / 'kernels.json'} and {RESULTS / 'kernels.md'}")


if __name__ == "__main__":
    run(main)
