"""Quantization time before and after issue 60's calibration changes, in one interleaved run.

    python bench/quant_time.py                      # smollm2-135m awq+gptq W4g128, 64 × 512 SciQ windows, 1 thread
    python bench/quant_time.py --method recon --report quant_time_default   # block-wise reconstruction (RECON_RECIPE)
    python bench/quant_time.py --method best ...    # what `bitquilt quantize` runs at 4 bits without --method

Three variants of the same recipe on the same calibration windows, each in a worker process of its own, the three of
a round at the same time (so slow and busy minutes of a shared machine fall on all of them alike):

  today  the code at commit 9d60c69 (fp32 calibration, the quantized stream through the packed kernels), from a git
         worktree at /tmp/quant-base (made here with `git worktree add --detach /tmp/quant-base 9d60c69` if missing)
  fp32   this checkout, --calib-dtype fp32
  bf16   this checkout, --calib-dtype bf16

Each worker reports wall and CPU seconds of `quantize` alone (the compiled kernels are built before the clock starts)
and the perplexity of its result (BoolQ Wikipedia passages, `--ppl-windows` windows of 512 tokens, torch reference
matmul in every variant). The parent records the CPU, the load average around each worker and the 2048² matmul rate
of one thread in fp32 and bf16 (from which the time on an AMX machine can be estimated). Results:
bench/results/quant_time.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from types import ModuleType

import torch
from common import RESULTS, add_quant_run_args, command_line, cpu_name, loadavg, machine, run, write_atomic

BASE_COMMIT = "9d60c69"
BASE_TREE = Path("/tmp/quant-base")
REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("today", "fp32", "bf16")


def matmul_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """One thread's n × n matmul rate in `dtype`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    seconds = (time.perf_counter() - t0) / repeats
    torch.set_num_threads(threads)
    return 2 * n**3 / seconds / 1e9


def named_recipes() -> dict[str, tuple[dict, str]]:
    """The W4 recipes `--method` names besides a plain method, as `Recipe` fields and the words the report uses."""
    from bitquilt.recipes import BEST_RECIPES, RECON_RECIPE

    return {"recon": ({**RECON_RECIPE, "group_size": 128}, "block-wise reconstruction"),
            "best": (BEST_RECIPES[4], "the CLI's default at 4 bits")}


def recipe_fields(method: str) -> dict:
    """The `Recipe` fields of `--method` at W4 (g128 unless the named recipe says otherwise). The parent resolves
    them once and hands them to every worker, so the baseline checkout runs the same recipe as this one."""
    fields, _ = named_recipes().get(method, ({"method": method, "group_size": 128}, ""))
    return {**fields, "w_bits": 4}


def method_label(method: str) -> str:
    """The method as the report names it: its flags, and what a named recipe is."""
    from bitquilt.recipes import as_flags

    fields, words = named_recipes().get(method, ({"method": method}, ""))
    return f"`{as_flags(fields)}`" + (f" ({words})" if words else "")


def worker(variant: str, args: argparse.Namespace) -> dict:
    from bitquilt import kernels
    from bitquilt.api import calibration_ids, load, quantize
    from bitquilt.eval.ppl import perplexity
    from bitquilt.kernels.cpu import extension
    from bitquilt.recipes import CalibConfig, Recipe

    torch.set_num_threads(args.threads)
    extension()  # built (or loaded) before the clock starts: today's stream runs through it
    model, tokenizer = load(args.model)
    ids = calibration_ids(tokenizer, CalibConfig("sciq", args.calib_samples, 512, 0))
    extra = {} if variant == "today" else {"calib_dtype": variant}
    recipe = Recipe(**json.loads(args.recipe))
    c0, t0 = time.process_time(), time.perf_counter()
    report = quantize(model, recipe, ids, progress=False, **extra)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    with reference_matmuls(kernels):  # the same torch reference matmul evaluates every variant
        ppl = perplexity(model, tokenizer, "wiki", seqlen=512, max_windows=args.ppl_windows, progress=False).ppl
    return {"variant": variant, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "ppl": ppl,
            "compute": getattr(report, "compute", None) or {"precision": "fp32", "reason": "commit " + BASE_COMMIT}}


def reference_matmuls(kernels: ModuleType) -> AbstractContextManager:
    """Where every matmul takes the torch reference: this checkout's option for a block, or the baseline checkout's
    process-wide switch (a worker process ends after its one run)."""
    if hasattr(kernels, "using"):
        return kernels.using(enabled=False)
    kernels.set_kernels_enabled(False)
    return nullcontext()


def base_tree() -> Path:
    """The worktree holding commit BASE_COMMIT, made if missing."""
    if not (BASE_TREE / "bitquilt").is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(BASE_TREE), BASE_COMMIT],
                       check=True)
    return BASE_TREE


def run_round(args: argparse.Namespace, number: int) -> list[dict]:
    """One worker per variant, all at once; their rows, with the load average before and after the round."""
    before = loadavg()
    procs = []
    for variant in args.variants:
        tree = base_tree() if variant == "today" else REPO
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", variant, "--model", args.model,
             "--recipe", json.dumps(recipe_fields(args.method)),
             "--calib-samples", str(args.calib_samples), "--threads", str(args.threads),
             "--ppl-windows", str(args.ppl_windows)],
            env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, stdout=subprocess.PIPE, text=True))
    outputs = [proc.communicate()[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise SystemExit("a worker failed")
    after = loadavg()
    return [{**json.loads(out.strip().splitlines()[-1]), "loadavg": [before, after], "round": number}
            for out in outputs]


def render(meta: dict, rows: list[dict]) -> str:
    by = {v: [r for r in rows if r["variant"] == v] for v in VARIANTS}
    mean = {v: {k: sum(r[k] for r in rs) / len(rs) for k in ("wall_s", "cpu_s", "ppl")} for v, rs in by.items() if rs}
    lines = ["# Quantization time: calibration in bf16, the quantized stream on dense copies", "",
             f"Generated by `{meta['command']}`: {meta['model']} {method_label(meta['method'])} W4g128, "
             f"{meta['calib_samples']} × "
             f"512 SciQ calibration windows, {meta['threads']} thread(s) per worker, the "
             f"workers of a round ({', '.join(meta['variants'])}) at the same time "
             f"({meta['repeats']} round(s)). CPU: {meta['cpu']}. Perplexity: "
             f"BoolQ Wikipedia passages, first {meta['ppl_windows']} windows × 512 tokens. *today* is commit "
             f"{BASE_COMMIT}.", "",
             f"One thread's 2048² matmul: fp32 {meta['gflops']['fp32']:.0f} GFLOPS, bf16 "
             f"{meta['gflops']['bf16']:.0f} GFLOPS ({meta['gflops']['bf16'] / meta['gflops']['fp32']:.2f}×), measured "
             "before the first worker.", "",
             "| round | variant | wall s | CPU s | CPU ÷ today's | perplexity | Δ ppl vs fp32 | load (round) |",
             "|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        today = next((t for t in rows if t["round"] == r["round"] and t["variant"] == "today"), None)
        fp32 = next((t for t in rows if t["round"] == r["round"] and t["variant"] == "fp32"), None)
        ratio = f"{r['cpu_s'] / today['cpu_s']:.2f}" if today else "–"
        delta = f"{100 * (r['ppl'] / fp32['ppl'] - 1):+.2f}%" if fp32 else "–"
        lines.append(f"| {r['round']} | {r['variant']} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {ratio} | "
                     f"{r['ppl']:.3f} | {delta} | {r['loadavg'][0]} → {r['loadavg'][1]} |")
    if "today" in mean:
        lines += ["", "Mean over rounds, speed-up over today (CPU time; wall time): " + ", ".join(
            f"{v} {mean['today']['cpu_s'] / m['cpu_s']:.2f}× ({mean['today']['wall_s'] / m['wall_s']:.2f}×)"
            for v, m in mean.items() if v != "today") + "."]
    if "fp32" in mean and "bf16" in mean:
        fp32, bf16 = mean["fp32"], mean["bf16"]
        change = 100 * (bf16["ppl"] / fp32["ppl"] - 1)
        lines += ["", f"Mean over rounds, bf16 against fp32: {fp32['cpu_s'] / bf16['cpu_s']:.2f}× less CPU time "
                  f"({fp32['wall_s'] / bf16['wall_s']:.2f}× wall), perplexity {change:+.2f}%."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quant_run_args(p)
    p.add_argument("--ppl-windows", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="rounds of the three variants")
    p.add_argument("--report", default="quant_time", help="results name under bench/results/")
    p.add_argument("--variants", type=lambda v: v.split(","), default=list(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--recipe", help=argparse.SUPPRESS)  # a worker's Recipe fields, as JSON
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    gflops = {"fp32": matmul_gflops(torch.float32), "bf16": matmul_gflops(torch.bfloat16)}
    rows = []
    for number in range(1, args.repeats + 1):
        for row in run_round(args, number):
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"model": args.model, "method": args.method, "calib_samples": args.calib_samples, "threads": args.threads,
            "ppl_windows": args.ppl_windows, "repeats": args.repeats, "variants": args.variants, "cpu": cpu_name(),
            "gflops": gflops, "machine": machine(), "command": command_line()}
    write_atomic(RESULTS / f"{args.report}.json", json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
    write_atomic(RESULTS / f"{args.report}.md", render(meta, rows))
    print(f"wrote {RESULTS / args.report}.md")


if __name__ == "__main__":
    run(main)
