"""CPU kernel benchmark: bitquilt.kernels.cpu against torch fp32, cold weights.

Every timed call reads a different copy of the weights (copies rotate through at least 96 MiB and
twice the last-level cache, so that they come from memory: 32 MiB of L3 on the AMD hosts, 300 MiB
on one Intel Xeon), kernel and fp32 calls alternate so both see the same machine load, and
the median of the repeats is reported. Writes bench/results/kernels.{json,md}.

    python bench/kernel_speed.py           # 4 shapes x batch 1/16/128 x 1/2 threads, bitplane and uniform
    python bench/kernel_speed.py --quick   # 4096², batch 1, 1 thread, 2/3/4 bits (< 1 minute)
    python bench/kernel_speed.py --crossover  # batch size where dequantize+sgemm overtakes the tables
    python bench/kernel_speed.py --mxint      # MXINT kernel (AVX2 and AVX-512) vs fp32 and uniform int4,
                                         # gather cost, crossover: bench/results/mxint_kernels.{json,md}
    python bench/kernel_speed.py --uniform8   # 8-bit uniform GEMV vs the 8-plane tables and fp32 at decode
                                         # batches (LM-head shapes): bench/results/uniform8_kernel.{json,md}
    python bench/kernel_speed.py --int8       # 4-bit x int8-activation kernel vs the exact 4-bit kernel and fp32,
                                         # and the read-bandwidth ceiling: bench/results/int8_kernel.{json,md}
    python bench/kernel_speed.py --int8 --int8-bits 2   # the same for 2-bit codes (group 64): int8_kernel_w2
    python bench/kernel_speed.py --hadamard   # QuaRot's online Hadamard, compiled vs torch butterflies, at the packaged
                                         # models' widths: bench/results/hadamard_kernel.{json,md}
    python bench/kernel_speed.py --slices     # MoBiQuant's sliced weights: a prefix of slices in one call vs part by
                                         # part vs fp32, static and routed: bench/results/slice_kernel.{json,md}
    python bench/kernel_speed.py --slices-int8  # MoBiQuant slices on int8 activations (VNNI, and the tables on the
                                         # rounded activations) vs exact, decode batches: slice_int8_kernel.{json,md}
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch
from common import RESULTS, cpu_name, loadavg, run, write_atomic

from bitquilt import kernels
from bitquilt.formats import BitplaneFormat, UniformFormat
from bitquilt.formats.mxint import BLOCK, MXIntFormat
from bitquilt.isa import cpu_flags
from bitquilt.kernels import composite, cpu, q4_int8, uniform8
from bitquilt.kernels import mxint as mxk
from bitquilt.kernels.huge_pages import layout_empty
from bitquilt.nn.hadamard import hadamard_transform, random_signs, reference_transform
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec


def last_level_cache_bytes() -> int:
    """The largest CPU cache this machine reports (sysfs), 0 where it reports none."""
    sizes = [0]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        if text[:-1].isdigit():
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0))
    return max(sizes)


COLD_BYTES = max(96 << 20, 2 * last_level_cache_bytes())
GROUP = 128
SHAPES = [(2048, 2048), (4096, 4096), (4096, 11008), (11008, 4096)]  # (N out, K in)
REPEATS = {1: 101, 16: 7, 128: 3}


def random_words(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """int32 words of random bits: random planes or random bit-stream packed codes."""
    *lead, words = shape
    return torch.randint(0, 256, (*lead, words * 4), generator=gen, dtype=torch.uint8).view(torch.int32)


def random_bitplane(n: int, k: int, bits: int, gen: torch.Generator) -> BitplaneFormat:
    coeffs = (torch.randn(n, k // GROUP, bits + 1, generator=gen) * 0.02).half()
    return BitplaneFormat(random_words((bits, n, k // 32), gen), coeffs, bits, GROUP, k)


def random_uniform(n: int, k: int, bits: int, gen: torch.Generator, group: int = GROUP) -> UniformFormat:
    groups = -(-k // group)  # the last group may be shorter
    scales = (torch.rand(n, groups, generator=gen) * 0.01 + 1e-3).half()
    zeros = torch.randint(0, 2**bits, (n, groups), generator=gen, dtype=torch.uint8)
    return UniformFormat(random_words((n, k * bits // 32), gen), scales, zeros, bits, group, k)


def cold_copies(nbytes: int) -> int:
    return max(2, -(-COLD_BYTES // nbytes))


def timed(fn, *args) -> tuple[float, float]:
    """(wall ms, this thread's CPU ms): the latter leaves out time the scheduler gave to others."""
    t0, c0 = time.perf_counter(), time.thread_time()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3


def alternating_cpu_times(rounds: list[dict[str, tuple]],
                          self_timed: frozenset[str] = frozenset()) -> dict[str, list[float]]:
    """CPU ms of each named call in each round, the calls alternating within a round so all see the same load; a
    round maps each name to its (function, *args), e.g. another cold copy of the weights each round. The calls named
    in `self_timed` time themselves: they return their own thread CPU seconds (timed in C)."""
    times: dict[str, list[float]] = {name: [] for name in rounds[0]}
    for calls in rounds:
        for name, (fn, *args) in calls.items():
            times[name].append(fn(*args) * 1e3 if name in self_timed else timed(fn, *args)[1])
    return times


def alternating_cpu_ms(rounds: list[dict[str, tuple]], self_timed: frozenset[str] = frozenset()) -> dict[str, float]:
    """Median CPU ms of each named call over the rounds (`alternating_cpu_times`)."""
    return {name: statistics.median(t) for name, t in alternating_cpu_times(rounds, self_timed).items()}


def run_meta(**extra) -> dict:
    """The facts every report starts with: CPU, torch, the load average now (plus `extra`)."""
    return dict(cpu=f"{cpu_name()}, {os.cpu_count()} cores", torch=torch.__version__, loadavg_start=loadavg(), **extra)


def single_thread(seed: int = 0) -> torch.Generator:
    """One torch thread (the kernels' batch-1 setting) and the seeded generator of a mode's random weights."""
    torch.set_num_threads(1)
    return torch.Generator().manual_seed(seed)


def report_flags(flag: str, report: str, default: str) -> str:
    """The command-line flags that wrote `report` (its name only when not the default)."""
    return flag + ("" if report == default else f" --report {report}")


def write_report(name: str, meta: dict, rows: list[dict], markdown_text: str) -> None:
    """results/NAME.json ({"meta", "results"}) and results/NAME.md."""
    write_atomic(RESULTS / f"{name}.json", json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
    write_atomic(RESULTS / f"{name}.md", markdown_text)


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
    gen = single_thread()
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


# ---- MXINT mode -------------------------------------------------------------------------------

MX_SHAPES = [(896, 896), (4864, 896), (896, 4864), (576, 576), (1536, 576), (576, 1536)]  # (N out, K in)
MX_REPEATS = {1: 41, 128: 7}
MX_CROSSOVER = [4, 8, 12, 16, 24, 32, 48, 64]
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
             "amx_tile")


def random_mxint(n: int, k: int, widths: list[int], columns: list[int], permute: bool,
                 gen: torch.Generator) -> MXIntFormat:
    """Random codes and exponents (steps near LLM weight scales) in the given classes."""
    q = torch.cat([torch.randint(-(2 ** (m - 1) - 1), 2 ** (m - 1), (n, c), generator=gen)
                   for m, c in zip(widths, columns)], 1)
    e = torch.randint(-9, -3, (n, k // BLOCK), generator=gen)
    return MXIntFormat.from_codes(q, e, widths, columns, torch.randperm(k, generator=gen) if permute else None)


def mxsens_columns(k: int) -> tuple[list[int], list[int]]:
    """MXSens-like split: one 8-bit block, about 12% of the blocks 6-bit, the rest 4-bit."""
    six = round(0.12 * k / BLOCK) * BLOCK
    return [8, 6, 4], [BLOCK, six, k - BLOCK - six]


def mx_variants(n: int, k: int, gen: torch.Generator) -> list[tuple[str, str | None, list]]:
    """(name, isa, cold copies of a callable x -> y) for fp32, uniform int4 and both MXINT formats per path."""
    w = torch.randn(n, k, generator=gen)
    weights = [w.clone() for _ in range(cold_copies(n * k * 4))]
    fp32 = [(lambda x, c=c: torch.nn.functional.linear(x, c)) for c in weights]
    p = cpu.packed(random_uniform(n, k, 4, gen, group=BLOCK))  # the MXINT block size (576 has no g128)
    int4 = [dataclasses.replace(p, planes=p.planes.clone(), coeffs=p.coeffs.clone())
            for _ in range(cold_copies(p.nbytes()))]
    out = [("fp32", None, fp32), ("uniform int4 g32", None, [c.matmul for c in int4])]
    for name, fmt in [("mxint4", random_mxint(n, k, [4], [k], False, gen)),
                      ("mxsens 8/6/4", random_mxint(n, k, *mxsens_columns(k), True, gen))]:
        lay = mxk.layout(fmt)
        copies = [dataclasses.replace(lay, weights=lay.weights.clone(), exponents=lay.exponents.clone())
                  for _ in range(cold_copies(lay.nbytes()))]
        for isa in mxk.supported_isas():
            out.append((name, isa, [lambda x, c=c, isa=isa: c.matmul(x, isa) for c in copies]))
        if fmt.perm is not None:
            out.append(("gather", None, [lay.prepare]))
    return out


def mx_bench_shape(n: int, k: int, threads_list, log) -> list[dict]:
    """All variants on one shape, calls interleaved (every variant sees the same machine load)."""
    gen = torch.Generator().manual_seed(0)
    variants = mx_variants(n, k, gen)
    rows = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        for batch, repeats in MX_REPEATS.items():
            x = torch.randn(batch, k, generator=gen)
            times: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(variants))}
            for r in range(repeats):
                for i, (_, _, fns) in enumerate(variants):
                    times[i].append(timed(fns[r % len(fns)], x))
            stats = []
            for (name, isa, _), t in zip(variants, times.values()):
                wall, cpu_ms = zip(*t[1:])  # the first call of each warms up
                stats.append(dict(variant=name, isa=isa, N=n, K=k, batch=batch, threads=threads,
                                  ms=statistics.median(wall), ms_min=min(wall),
                                  cpu_ms=statistics.median(cpu_ms) if threads == 1 else None))
            fp32, int4 = stats[0], stats[1]
            for row in stats:
                row.update(vs_fp32=fp32["ms"] / row["ms"], vs_int4=int4["ms"] / row["ms"],
                           cpu_vs_fp32=None if row["cpu_ms"] is None else fp32["cpu_ms"] / row["cpu_ms"])
                log(row)
            rows += stats
    return rows


def mx_crossover(log) -> list[dict]:
    """Registers vs dequantize+sgemm by batch size (1 thread, CPU time, MXSens-like): tunes mxint.SGEMM_BATCH."""
    gen = single_thread(seed=1)
    rows = []
    for n, k in [(4864, 896), (896, 896)]:
        lay = mxk.layout(random_mxint(n, k, *mxsens_columns(k), True, gen))
        for batch in MX_CROSSOVER:
            xs = lay.prepare(torch.randn(batch, k, generator=gen))
            row = dict(N=n, K=k, batch=batch)
            for isa in mxk.supported_isas():
                for path in ("gemv", "sgemm"):
                    fn = getattr(lay, path)
                    row[f"{isa}_{path}_ms"] = statistics.median(timed(fn, xs, isa)[1] for _ in range(7))
            log(row)
            rows.append(row)
    return rows


def machine_info() -> dict:
    flags = cpu_flags()
    try:
        gcc = subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        gcc = "unknown"
    return dict(cpu=cpu_name(), cores=os.cpu_count(), isa_flags=[f for f in ISA_FLAGS if f in flags],
                kernel_paths=list(mxk.supported_isas()), default_path=mxk.active_isa(), torch=torch.__version__,
                mkl=torch.backends.mkl.is_available(), python=platform.python_version(), compiler=gcc,
                loadavg_start=loadavg())


def mx_cell(r: dict) -> str:
    return f"{r['ms']:.3f} ({r['vs_fp32']:.2f}× / {r['vs_int4']:.2f}×)"


def mx_markdown(rows: list[dict], cross: list[dict], meta: dict) -> str:
    kernels_ = [r for r in rows if r["variant"] not in ("fp32", "gather")]
    columns = list(dict.fromkeys((r["variant"], r["isa"]) for r in kernels_))
    lines = [
        "# MXINT CPU kernel vs fp32 and uniform int4",
        "",
        f"{meta['cpu']}, {meta['cores']} cores; flags {' '.join(meta['isa_flags'])}; torch {meta['torch']} "
        f"(MKL {meta['mkl']}), Python {meta['python']}, {meta['compiler']}; load average {meta['loadavg_start']} "
        f"at start, {meta['loadavg_end']} at end. Written by `{meta['command']}`.",
        "",
        "Median wall time (ms) of calls interleaved round-robin over all variants, each call on a different copy",
        "of the weights (copies rotate through 96 MiB). In parentheses: speedup vs torch fp32 (F.linear) and vs",
        "the uniform int4 g32 lookup-table kernel (`bitquilt.kernels.cpu`). MXINT calls include the x gather",
        "and the batch-size dispatch (registers below, dequantize+sgemm from "
        f"{meta['sgemm_batch']} tokens on). mxint4: one 4-bit class; mxsens: one 8-bit block, ~12% 6-bit, the",
        "rest 4-bit, permuted columns. Random codes, exponents near LLM weight scales.",
        "",
        "With a load average above the core count (other jobs on this shared machine), 2-thread calls wait for a",
        "descheduled OpenMP worker (up to a scheduler quantum, ~8 ms, for fp32 as much as for the kernels): their",
        "wall times then say little, and the 1-thread CPU-time table is the better comparison.",
        "",
    ]
    for threads in sorted({r["threads"] for r in rows}):
        lines += [f"## {threads} thread{'s' if threads > 1 else ''}", "",
                  "| N×K | batch | fp32 ms | " + " | ".join(f"{v} {isa or ''}".strip() for v, isa in columns) + " |",
                  "|---|---|---|" + "---|" * len(columns)]
        for (n, k), batch in [((n, k), b) for n, k in MX_SHAPES for b in MX_REPEATS]:
            sel = {(r["variant"], r["isa"]): r for r in rows
                   if (r["N"], r["K"], r["batch"], r["threads"]) == (n, k, batch, threads)}
            if sel:
                lines.append(f"| {n}×{k} | {batch} | {sel['fp32', None]['ms']:.3f} | "
                             + " | ".join(mx_cell(sel[c]) for c in columns) + " |")
        lines.append("")
    single = [r for r in rows if r["threads"] == 1]
    lines += ["## CPU time, 1 thread (ms; speedup vs fp32)", "",
              "| N×K | batch | fp32 | " + " | ".join(f"{v} {isa or ''}".strip() for v, isa in columns) + " |",
              "|---|---|---|" + "---|" * len(columns)]
    for (n, k), batch in [((n, k), b) for n, k in MX_SHAPES for b in MX_REPEATS]:
        sel = {(r["variant"], r["isa"]): r for r in single if (r["N"], r["K"], r["batch"]) == (n, k, batch)}
        if sel:
            lines.append(f"| {n}×{k} | {batch} | {sel['fp32', None]['cpu_ms']:.3f} | " + " | ".join(
                f"{sel[c]['cpu_ms']:.3f} ({sel[c]['cpu_vs_fp32']:.2f}×)" for c in columns) + " |")
    lines += ["", "## Gather cost (x[:, perm] into the padded stored order, mxsens)", "",
              "| N×K | batch | threads | gather ms | mxsens matmul ms (default path) | share |",
              "|---|---|---|---|---|---|"]
    for g in (r for r in rows if r["variant"] == "gather"):
        m = next(r for r in rows if r["variant"] == "mxsens 8/6/4" and r["isa"] == meta["default_path"]
                 and all(r[f] == g[f] for f in ("N", "K", "batch", "threads")))
        lines.append(f"| {g['N']}×{g['K']} | {g['batch']} | {g['threads']} | {g['ms']:.4f} | {m['ms']:.3f} | "
                     f"{100 * g['ms'] / m['ms']:.1f}% |")
    isas = mxk.supported_isas()
    lines += ["", "## Crossover: registers vs dequantize+sgemm (mxsens, 1 thread, CPU ms)", "",
              "| N×K | batch | " + " | ".join(f"{i} registers | {i} sgemm" for i in isas) + " |",
              "|---|---|" + "---|---|" * len(isas)]
    for c in cross:
        lines.append(f"| {c['N']}×{c['K']} | {c['batch']} | " + " | ".join(
            f"{c[f'{i}_gemv_ms']:.3f} | {c[f'{i}_sgemm_ms']:.3f}" for i in isas) + " |")
    return "\n".join(lines) + "\n"


def mxint_main() -> None:
    """The MXINT comparison (about 2 minutes on 2 cores)."""
    from common import command_line

    meta = machine_info()
    meta.update(command=command_line(), sgemm_batch=mxk.SGEMM_BATCH)

    def log(r: dict) -> None:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)

    rows = []
    for n, k in MX_SHAPES:
        rows += mx_bench_shape(n, k, [1, 2], log)
    cross = mx_crossover(log)
    meta["loadavg_end"] = loadavg()
    write_atomic(RESULTS / "mxint_kernels.json",
                 json.dumps({"meta": meta, "results": rows, "crossover": cross}, indent=1) + "\n")
    write_atomic(RESULTS / "mxint_kernels.md", mx_markdown(rows, cross, meta))
    print(f"wrote {RESULTS / 'mxint_kernels.json'} and {RESULTS / 'mxint_kernels.md'}")


# ---- 8-bit uniform GEMV mode ------------------------------------------------------------------

U8_SHAPES = [(49152, 576), (151936, 1536), (4096, 4096)]  # smollm2 and qwen2.5-1.5b LM heads, a square layer
U8_BATCHES = (1, 4, 16)
U8_REPORT = "uniform8_kernel"  # the report's name under bench/results unless --report names another


def uniform8_main(report: str = U8_REPORT) -> None:
    """`bitquilt.kernels.uniform8` against the lookup tables (8 planes) and fp32, cold weights, 1 thread."""
    gen = single_thread()
    meta = run_meta()
    rows = []
    for n, k in U8_SHAPES:
        fmts = [random_uniform(n, k, 8, gen) for _ in range(cold_copies(n * k))]
        for f in fmts:  # each copy's kernel layout built before timing (the first call builds and caches it)
            uniform8.matmul(f, torch.zeros(1, k))
        tables = [cpu.packed(f) for f in fmts]
        fp32 = [torch.randn(n, k, generator=gen) for _ in range(cold_copies(n * k * 4))]
        for batch in U8_BATCHES:
            x = torch.randn(batch, k, generator=gen)
            ms = alternating_cpu_ms([{"uniform8": (uniform8.matmul, fmts[r % len(fmts)], x),
                                      "tables": (tables[r % len(tables)].lut, x),
                                      "fp32": (torch.nn.functional.linear, x, fp32[r % len(fp32)])} for r in range(7)])
            row = dict(N=n, K=k, batch=batch, **{f"{name}_cpu_ms": v for name, v in ms.items()},
                       GBps=n * k / ms["uniform8"] / 1e6)
            print(f"{n}x{k} batch {batch:2d}: uniform8 {ms['uniform8']:.2f} ms ({row['GBps']:.1f} GB/s), tables "
                  f"{ms['tables']:.2f}, fp32 {ms['fp32']:.2f} ms (CPU time)", flush=True)
            rows.append(row)
    meta["loadavg_end"] = loadavg()
    lines = ["# 8-bit uniform GEMV vs lookup tables vs fp32 (cold weights, 1 thread)", "",
             f"Generated by `python bench/kernel_speed.py {report_flags('--uniform8', report, U8_REPORT)}`. "
             f"{meta['cpu']}; torch {meta['torch']}; load average "
             f"{meta['loadavg_start']} at the start, {meta['loadavg_end']} at the end. Random 8-bit codes, group 128; "
             "median CPU time of the calling thread over 7 alternating calls, each reading another copy of the "
             "weights. GB/s: the uniform8 kernel's code bytes per second.", "",
             "| N×K | batch | uniform8 ms | GB/s | tables (8 planes) ms | fp32 ms | tables ÷ uniform8 "
             "| fp32 ÷ uniform8 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['N']}×{r['K']} | {r['batch']} | {r['uniform8_cpu_ms']:.2f} | {r['GBps']:.1f} | "
                     f"{r['tables_cpu_ms']:.2f} | {r['fp32_cpu_ms']:.2f} | "
                     f"{r['tables_cpu_ms'] / r['uniform8_cpu_ms']:.2f}× | "
                     f"{r['fp32_cpu_ms'] / r['uniform8_cpu_ms']:.2f}× |")
    write_report(report, meta, rows, "\n".join(lines) + "\n")
    print(f"wrote {RESULTS / report}.md")


I8_SHAPES = [(1536, 1536), (8960, 1536), (1536, 8960), (4096, 4096)]  # qwen2.5-1.5b's linears, and 4096²
I8_BATCHES = (1, 16, 128)
I8_REPORT = "int8_kernel"
I8_GROUP = {4: 128, 2: 64}  # the group each width ships with (e2e's uniform w4 g128, w2 g64)


def default_int8_report(bits: int) -> str:
    return I8_REPORT if bits == 4 else f"{I8_REPORT}_w{bits}"


def int8_main(report: str = I8_REPORT, bits: int = 4) -> None:
    """`bitquilt.kernels.q4_int8` on each instruction-set path the CPU runs against the exact kernel of the same
    `bits` (`cpu.Packed.matmul`) and fp32, cold weights, 1 thread, with the read-bandwidth ceiling for the same bytes
    timed in the same alternating rounds (so both see the same load)."""
    gen = single_thread()
    isas = q4_int8.supported_isas()
    meta = run_meta(isas=list(isas))
    ext = cpu.extension()
    prefetch = ext.prefetch_plan()  # how the batch-1 kernels prefetch on this CPU (csrc/common/stream_prefetch.h)

    def on(isa: str, *args):  # the path switch is one store in the extension: nothing measurable
        q4_int8.set_isa(isa)
        return ext.q4_int8_matmul(*args)

    def on_in_c(isa: str, *args) -> float:  # the same call timed in C, as the decode step makes it
        q4_int8.set_isa(isa)
        return ext.q4_int8_seconds(*args)

    self_timed = frozenset({*(f"{isa} C" for isa in isas), "read", "read_prefetch"})

    rows = []
    for n, k in I8_SHAPES:
        fmts = [random_uniform(n, k, bits, gen, I8_GROUP[bits]) for _ in range(cold_copies(n * k * bits // 8))]
        layouts = [q4_int8.layout(f) for f in fmts]
        int8_args = [(lay.codes, lay.scales, n, lay.group, lay.bits) for lay in layouts]
        exact = [cpu.packed(f) for f in fmts]
        nbytes = layouts[0].nbytes()
        # whole 128 B, in pages like the layouts' (huge pages: `kernels.huge_pages.layout_empty`)
        buffers = [layout_empty(nbytes // 128 * 32, torch.float32).normal_(generator=gen)
                   for _ in range(cold_copies(nbytes))]
        fp32 = [torch.randn(n, k, generator=gen) for _ in range(cold_copies(n * k * 4))]
        for batch in I8_BATCHES:
            x = torch.randn(batch, k, generator=gen)
            reps = REPEATS[batch]
            # each path reads its own cold copy: the same copy twice in a round would be warm in L3 the second time
            paths = len(isas)
            times = alternating_cpu_times([{**{isa: (on, isa, x, *int8_args[(2 * r * paths + j) % len(int8_args)])
                                         for j, isa in enumerate(isas)},
                                      **{f"{isa} C": (on_in_c, isa, x,
                                                      *int8_args[((2 * r + 1) * paths + j) % len(int8_args)])
                                         for j, isa in enumerate(isas)},
                                      "exact": (exact[r % len(exact)].matmul, x),
                                      "fp32": (torch.nn.functional.linear, x, fp32[r % len(fp32)]),
                                      # two copies of their own per round: a copy the other pass read the round
                                      # before would still be in L3 (1536²'s ceiling read warm until 2026-12-04)
                                      "read": (ext.read_pass_seconds, buffers[2 * r % len(buffers)], 0),
                                      "read_prefetch": (ext.read_pass_seconds, buffers[(2 * r + 1) % len(buffers)],
                                                        *prefetch)}
                                     for r in range(reps)], self_timed)
            # the ceiling, timed in C in the same rounds as the kernels: the faster pass, plain or prefetching; each
            # kernel's share of it is the median over the rounds of its round's ceiling time over its own (the host's
            # load drifts between rounds: medians taken apart would pair a slow round's kernel with a fast one's read)
            plain, prefetching = times.pop("read"), times.pop("read_prefetch")
            read = [min(a, b) for a, b in zip(plain, prefetching, strict=True)]
            ms = {name: statistics.median(t) for name, t in times.items()}
            share = {f"{isa}_share": statistics.median(c / t for c, t in zip(read, times[f"{isa} C"], strict=True))
                     for isa in isas}
            ceiling = nbytes / statistics.median(read) / 1e6
            row = dict(N=n, K=k, batch=batch, **{f"{name.replace(' C', '_c')}_cpu_ms": v for name, v in ms.items()},
                       **{f"{isa}_GBps": nbytes / ms[f"{isa} C"] / 1e6 for isa in isas}, ceiling_GBps=ceiling,
                       plain_read_GBps=nbytes / statistics.median(plain) / 1e6,
                       prefetching_read_GBps=nbytes / statistics.median(prefetching) / 1e6,
                       **share)
            print(f"{n}x{k} batch {batch:3d}: " + ", ".join(f"{isa} {ms[isa]:.3f} ms, in C {ms[isa + ' C']:.3f} ms "
                                                             f"({row[isa + '_GBps']:.1f} GB/s)" for isa in isas)
                  + f" of {ceiling:.1f}; exact {ms['exact']:.3f}, fp32 {ms['fp32']:.2f} ms (CPU time)", flush=True)
            rows.append(row)
    q4_int8.set_isa()
    meta["loadavg_end"] = loadavg()
    best = isas[-1]
    flags = report_flags("--int8" + ("" if bits == 4 else f" --int8-bits {bits}"), report, default_int8_report(bits))
    lines = [f"# {bits}-bit weights × int8 activations vs the exact {bits}-bit kernel vs fp32 (cold weights, 1 thread)",
             "", f"Generated by `python bench/kernel_speed.py {flags}`. {meta['cpu']}; torch {meta['torch']}; "
             "load average "
             f"{meta['loadavg_start']} at the start, {meta['loadavg_end']} at the end. Random {bits}-bit codes, group "
             f"{I8_GROUP[bits]}; "
             "median CPU time of the calling thread over alternating calls, each reading another copy of the "
             "weights. *avx2*, *avx512*: `bitquilt.kernels.q4_int8` on each path this CPU runs (activations rounded "
             "to int8 per 32; vpmaddubsw, or AVX-512 VNNI vpdpbusd: 512-bit, or 256-bit for one 4-bit token), *ms* "
             "through its Python call "
             "(binding, checks, the output's allocation), *C ms* the same kernel timed in C around the call alone "
             "(csrc/kernels/read_rate.cpp's `q4_int8_seconds`), as the fused decode step and the standalone runtime "
             "call it; GB/s and % from the C time; *exact*: the bit-plane kernel "
             f"the {bits}-bit format runs without `--int8-activations` (lookup tables, from a width-dependent batch "
             "dequantize + sgemm). GB/s: the int8 kernel's layout bytes (codes + scales) per second; *ceiling*: one "
             "streaming read of a cold buffer of the same bytes in the same kind of pages (huge pages, as the layouts: "
             "`kernels.huge_pages.layout_empty`), timed in the same alternating rounds as the kernels "
             "(csrc/kernels/read_rate.cpp: 256-bit loads OR-ed together, 1 thread, timed in C; the faster of a plain "
             "pass and one "
             f"prefetching {prefetch} bytes ahead, as the kernels do on this CPU), the read rate a batch-1 kernel can "
             "reach; *plain*, *prefetching*: each pass's own median (a software prefetch of every line caps a "
             "stream below what the hardware prefetcher alone reaches on some CPUs, and the kernels need it: their "
             "work between loads keeps their own loads too few ahead); "
             "%: at batch 1, the median over the rounds of the round's ceiling time over the kernel's C time "
             f"({REPEATS[1]} rounds). Ratios against "
             f"*{best}*.", "",
             "| N×K | batch | ceiling GB/s | plain GB/s | prefetching GB/s | "
             + " | ".join(f"{isa} ms | {isa} C ms | {isa} GB/s | {isa} %" for isa in isas)
             + " | exact ms | fp32 ms | exact ÷ int8 | fp32 ÷ int8 |",
             "|---|---:|---:|---:|---:|" + "---:|---:|---:|---:|" * len(isas) + "---:|---:|---:|---:|"]
    for r in rows:
        cells = []
        for isa in isas:
            share = f"{100 * r[isa + '_share']:.0f}%" if r["batch"] == 1 else ""
            cells += [f"{r[isa + '_cpu_ms']:.3f}", f"{r[isa + '_c_cpu_ms']:.3f}", f"{r[isa + '_GBps']:.1f}", share]
        int8_ms = r[best + "_cpu_ms"]
        lines.append(f"| {r['N']}×{r['K']} | {r['batch']} | {r['ceiling_GBps']:.1f} | {r['plain_read_GBps']:.1f} | "
                     f"{r['prefetching_read_GBps']:.1f} | " + " | ".join(cells)
                     + f" | {r['exact_cpu_ms']:.3f} | {r['fp32_cpu_ms']:.2f} | "
                     f"{r['exact_cpu_ms'] / int8_ms:.2f}× | {r['fp32_cpu_ms'] / int8_ms:.2f}× |")
    write_report(report, meta, rows, "\n".join(lines) + "\n")
    print(f"wrote {RESULTS / report}.md")


# (rows, width): a decode token and a 512-token calibration/evaluation window, at the per-head width (64, nine
# heads of smollm2) and the down projections' inputs of smollm2-135m (1536), qwen2.5-0.5b (4864), qwen2.5-1.5b (8960)
HADAMARD_SHAPES = [(1, 1536), (1, 8960), (512 * 9, 64), (512, 576), (512, 1536), (512, 4864), (512, 8960)]


def hadamard_main() -> None:
    """`bitquilt.nn.hadamard.hadamard_transform` (the compiled kernel for fp32) against its torch butterflies."""
    gen = single_thread()
    meta = run_meta()
    rows = []
    for t, n in HADAMARD_SHAPES:
        x, signs = torch.randn(t, n, generator=gen), random_signs(n, 0)
        ms = alternating_cpu_ms([{"compiled": (hadamard_transform, x, signs), "torch": (reference_transform, x, signs)}
                                 for _ in range(15)])
        row = dict(rows=t, n=n, **{f"{name}_cpu_ms": v for name, v in ms.items()})
        print(f"{t}x{n}: compiled {ms['compiled']:.3f} ms, torch {ms['torch']:.3f} ms", flush=True)
        rows.append(row)
    meta["loadavg_end"] = loadavg()
    lines = ["# Online Hadamard transform: compiled vs torch butterflies (1 thread)", "",
             f"Generated by `python bench/kernel_speed.py --hadamard`. {meta['cpu']}; torch {meta['torch']}; "
             "load average "
             f"{meta['loadavg_start']} at the start, {meta['loadavg_end']} at the end. (x ⊙ s) M_n of fp32 rows with "
             "QuaRot's random signs; median CPU time of the calling thread over 15 alternating calls.", "",
             "| rows × n | compiled ms | torch ms | torch ÷ compiled |", "|---|---:|---:|---:|"]
    lines += [f"| {r['rows']}×{r['n']} | {r['compiled_cpu_ms']:.3f} | {r['torch_cpu_ms']:.3f} | "
              f"{r['torch_cpu_ms'] / r['compiled_cpu_ms']:.1f}× |" for r in rows]
    write_report("hadamard_kernel", meta, rows, "\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'hadamard_kernel.md'}")


# (N out, K in): qwen2.5-0.5b's gate/up and down projections, qwen2.5-1.5b's gate/up; tokens: a batch of prefill or
# a calibration window; slices: how many of the checkpoint's 2,1,1,1,1,1,1 slices (3, 4, 7 bits)
SLICE_SHAPES = [(4864, 896), (896, 4864), (8960, 1536)]
SLICE_TOKENS = [16, 512]
SLICE_COUNTS = [2, 3, 6]
ROUTED_COUNTS = (1, 4)  # a routed batch: each token 1 to 4 slices (2 to 5 bits), uniformly at random


def slices_main() -> None:
    """A prefix of MoBiQuant slices as one `cpu.matmul_parts` call against one kernel call per slice and against
    fp32 with the prefix's dense weight; then a routed batch (`composite.by_count`) against the slice-by-slice
    grouping (`composite.grouped_matmul`). Weights warm in cache: these are the many-token calls of calibration,
    evaluation and prefill, where compute, not reading the weight, sets the time."""
    gen = single_thread()
    meta = run_meta()
    rows = []
    for n, k in SLICE_SHAPES:
        w = torch.randn(n, k, generator=gen)
        parts = list(get_solver("mobislice")(w, None, LayerSpec(8, GROUP), {}).parts.values())
        by_part = [functools.partial(composite.part_matmul, p) for p in parts]  # each slice's own kernel
        for t in SLICE_TOKENS:
            x = torch.randn(t, k, generator=gen)
            for count in SLICE_COUNTS:
                dense = sum(p.dequantize() for p in parts[:count])
                ms = alternating_cpu_ms([{"one call": (cpu.matmul_parts, parts[:count], x),
                                          "part by part": (composite.grouped_matmul, x, torch.tensor(count),
                                                           by_part, n),
                                          "fp32": (torch.matmul, x, dense.t())} for _ in range(9)])
                rows.append(dict(N=n, K=k, tokens=t, slices=count, bits=sum(p.bits for p in parts[:count]),
                                 **{f"{name}_cpu_ms": v for name, v in ms.items()}))
                print(f"{n}x{k} {t} tokens {count} slices: {ms}", flush=True)
            counts = torch.randint(ROUTED_COUNTS[0], ROUTED_COUNTS[1] + 1, (t,), generator=gen)
            ms = alternating_cpu_ms([{"one call": (composite.by_count, parts, x, counts, n),
                                      "part by part": (composite.grouped_matmul, x, counts, by_part, n)}
                                     for _ in range(9)])
            rows.append(dict(N=n, K=k, tokens=t, slices="routed 1–4", bits=sum(
                sum(p.bits for p in parts[:c]) for c in counts.tolist()) / t, fp32_cpu_ms=None,
                **{f"{name}_cpu_ms": v for name, v in ms.items()}))
            print(f"{n}x{k} {t} tokens routed: {ms}", flush=True)
    meta["loadavg_end"] = loadavg()
    lines = ["# MoBiQuant slices: a prefix in one call vs one call per slice vs fp32 (1 thread)", "",
             f"Generated by `python bench/kernel_speed.py --slices`. {meta['cpu']}; torch {meta['torch']}; load "
             f"average {meta['loadavg_start']} at the start, {meta['loadavg_end']} at the end. Slices 2,1,1,1,1,1,1 "
             f"(`--method mobislice`, group {GROUP}) of a random weight; median CPU time of the calling thread over "
             "9 alternating calls, weights warm. *One call*: `cpu.matmul_parts` (lookup tables for small batches, "
             "else each chunk of rows dequantized as the sum of the slices and multiplied once); *part by part*: one "
             "kernel call per slice, summed. Routed rows: each token 1 to 4 slices at random, tokens grouped by "
             "count (`composite.by_count`) vs each slice on the tokens that use it (`composite.grouped_matmul`).", "",
             "| N × K | tokens | slices | bits | one call ms | part by part ms | fp32 ms | part by part ÷ one call "
             "| fp32 ÷ one call |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fp32 = "" if r["fp32_cpu_ms"] is None else f"{r['fp32_cpu_ms']:.2f}"
        vs_fp32 = "" if r["fp32_cpu_ms"] is None else f"{r['fp32_cpu_ms'] / r['one call_cpu_ms']:.2f}×"
        lines.append(f"| {r['N']}×{r['K']} | {r['tokens']} | {r['slices']} | {r['bits']:.2f} | "
                     f"{r['one call_cpu_ms']:.2f} | {r['part by part_cpu_ms']:.2f} | {fp32} | "
                     f"{r['part by part_cpu_ms'] / r['one call_cpu_ms']:.2f}× | {vs_fp32} |")
    write_report("slice_kernel", meta, rows, "\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'slice_kernel.md'}")


# qwen2.5-1.5b's gate/up and down projections; a decode batch of B streams; the base slice alone (2 bits) and with
# the next (3 bits): what a routed batch at low average bits runs
SLICE_INT8_SHAPES = [(8960, 1536), (1536, 8960)]
SLICE_INT8_TOKENS = [1, 4, 16, 64]
SLICE_INT8_COUNTS = [1, 2]


def slice_product(isa: str | None, parts: list, x: torch.Tensor) -> torch.Tensor:
    """`cpu.matmul_parts` exact (isa None) or on int8 activations on the int8 kernels' path `isa` (switching it is a
    store in the extension: nothing measurable)."""
    if isa is None:
        return cpu.matmul_parts(parts, x)
    q4_int8.set_isa(isa)
    with kernels.using(int8_activations=True):
        return cpu.matmul_parts(parts, x)


def slices_int8_main() -> None:
    """A prefix of MoBiQuant slices at decode batches: `cpu.matmul_parts` exact (the lookup tables) against the same
    call with int8 activations, on the VNNI path (AVX-512 VNNI + VBMI) and on the baseline path (the tables on the
    rounded activations); 1 thread, weights warm (a routed batch reads each weight once for all its rows)."""
    gen = single_thread()
    meta = run_meta()
    paths = [isa for isa in ("avx512", "avx2") if isa in q4_int8.supported_isas()]
    vnni = cpu.extension().plane_int8_vnni() if "avx512" in paths else False
    rows = []
    for n, k in SLICE_INT8_SHAPES:
        parts = list(get_solver("mobislice")(torch.randn(n, k, generator=gen), None, LayerSpec(8, GROUP),
                                             {}).parts.values())
        for t in SLICE_INT8_TOKENS:
            x = torch.randn(t, k, generator=gen)
            for count in SLICE_INT8_COUNTS:
                calls = {"exact": (slice_product, None, parts[:count], x),
                         **{f"int8 {isa}": (slice_product, isa, parts[:count], x) for isa in paths}}
                ms = alternating_cpu_ms([calls for _ in range(15)])
                rows.append(dict(N=n, K=k, tokens=t, slices=count, bits=sum(p.bits for p in parts[:count]),
                                 **{f"{name}_cpu_ms": v for name, v in ms.items()}))
                print(f"{n}x{k} {t} tokens {count} slices: {ms}", flush=True)
    q4_int8.set_isa(None)
    meta["loadavg_end"] = loadavg()
    names = ["int8 " + isa for isa in paths]
    lines = ["# MoBiQuant slices on int8 activations (1 thread)", "",
             f"Generated by `python bench/kernel_speed.py --slices-int8`. {meta['cpu']} (AVX-512 VNNI + VBMI: "
             f"{'yes' if vnni else 'no'}); torch {meta['torch']}; load average {meta['loadavg_start']} at the start, "
             f"{meta['loadavg_end']} at the end. Slices 2,1,1,1,1,1,1 (`--method mobislice`, group {GROUP}) of a "
             "random weight, the first 1 or 2 (2 or 3 bits); median CPU time of the calling thread over 15 "
             "alternating calls of `cpu.matmul_parts`, weights warm. *exact*: the lookup tables on fp32 activations; "
             "*int8 avx512*: each token rounded to int8 per 32 columns, the planes spread to bytes and multiplied "
             "by vpdpbusd (csrc/kernels/avx512/plane_int8.cpp); *int8 avx2*: the tables on the rounded "
             "activations (the path of CPUs without AVX-512 VBMI).", "",
             "| N × K | tokens | bits | exact ms | " + " | ".join(f"{n} ms" for n in names) + " | " +
             " | ".join(f"exact ÷ {n}" for n in names) + " |",
             "|---|---:|---:|---:|" + "---:|" * (2 * len(names))]
    for r in rows:
        lines.append(f"| {r['N']}×{r['K']} | {r['tokens']} | {r['bits']} | {r['exact_cpu_ms']:.3f} | " +
                     " | ".join(f"{r[n + '_cpu_ms']:.3f}" for n in names) + " | " +
                     " | ".join(f"{r['exact_cpu_ms'] / r[n + '_cpu_ms']:.2f}×" for n in names) + " |")
    write_report("slice_int8_kernel", meta, rows, "\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'slice_int8_kernel.md'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4096² batch 1, 1 thread, bits 2/3/4 only")
    ap.add_argument("--crossover", action="store_true", help="tables vs sgemm by batch size (prints only)")
    ap.add_argument("--mxint", action="store_true", help="MXINT kernel paths vs fp32 and uniform int4")
    ap.add_argument("--uniform8", action="store_true", help="8-bit uniform GEMV vs the tables and fp32, decode batches")
    ap.add_argument("--int8", action="store_true", help="4-bit x int8 activations vs the exact kernel, fp32, ceiling")
    ap.add_argument("--int8-bits", type=int, choices=q4_int8.BITS, default=4, help="--int8: code width")
    ap.add_argument("--hadamard", action="store_true", help="online Hadamard transform, compiled vs torch")
    ap.add_argument("--slices", action="store_true", help="MoBiQuant slices: one call per prefix vs per slice")
    ap.add_argument("--slices-int8", action="store_true", help="MoBiQuant slices on int8 activations vs exact")
    ap.add_argument("--report", help=f"--int8, --uniform8: name of the report under bench/results (default "
                    f"{I8_REPORT}, {U8_REPORT}; one per machine kind, e.g. {I8_REPORT}_zen3)")
    args = ap.parse_args()
    if args.report is not None and not re.fullmatch(r"[\w.-]+", args.report):
        ap.error(f"--report names a file under bench/results: letters, digits, '_', '.', '-'; got {args.report!r}")
    if cpu.extension() is None:
        raise SystemExit("the CPU extension is unavailable; nothing to benchmark")
    torch.set_grad_enabled(False)
    if args.mxint:
        mxint_main()
        return
    if args.uniform8:
        uniform8_main(args.report or U8_REPORT)
        return
    if args.int8:
        int8_main(args.report or default_int8_report(args.int8_bits), args.int8_bits)
        return
    if args.hadamard:
        hadamard_main()
        return
    if args.slices:
        slices_main()
        return
    if args.slices_int8:
        slices_int8_main()
        return
    if args.crossover:
        crossover()
        return
    if args.quick:
        shapes, batches, threads = [(4096, 4096)], [1], [1]
        formats = [("bitplane", b) for b in (2, 3, 4)] + [("uniform", b) for b in (2, 3, 4)]
    else:
        shapes, batches, threads = SHAPES, [1, 16, 128], [1, 2]
        formats = [("bitplane", b) for b in (2, 3, 4)] + [("uniform", b) for b in (2, 3, 4, 8)]
    meta = run_meta(quick=args.quick)

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
    write_report("kernels", meta, rows, markdown(rows, meta))
    print(f"wrote {RESULTS / 'kernels.json'} and {RESULTS / 'kernels.md'}")


if __name__ == "__main__":
    run(main)
