"""Perplexity with `bitquilt eval` in the bitquilt runtime against the transformers model: the whole command.

    python bench/eval_runtime.py --models smollm2-135m,qwen2.5-1.5b --variants "w4 g128 head8,w4 g128 head4"

For each saved model (RTN weights, quantized once into --workdir as bench/load_memory.py does), `bitquilt eval SAVED
--ppl-data wiki --seqlen S --ppl-windows N --json --runtime R` runs as a child process with --threads torch threads,
the runtimes alternating, --repeats times. Reported per runtime: the median wall time of the whole command (Python's
start to its exit: imports, load, kernel layout builds, the windows), its CPU time (user + system), the child's peak
RSS, and the perplexity, which both runtimes must give alike. Results: bench/results/eval_runtime.{json,md}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from common import Bench, loadavg, parser, provenance, run, run_child, stamp
from load_memory import quantize

RUNTIMES = ("transformers", "bitquilt")
KEY = ("model", "variant", "runtime")


def timed_eval(saved: Path, runtime: str, seqlen: int, windows: int, threads: int) -> dict:
    """One `bitquilt eval` child: wall s, CPU s, peak RSS MB (its own, from wait4) and its perplexity."""
    argv = [sys.executable, "-m", "bitquilt.cli", "eval", str(saved), "--ppl-data", "wiki", "--seqlen", str(seqlen),
            "--ppl-windows", str(windows), "--json", "--runtime", runtime]
    done = run_child(argv, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if done.returncode:
        raise RuntimeError(f"bitquilt eval {saved} --runtime {runtime} failed (exit {done.returncode})")
    return {"wall_s": done.wall_s, "cpu_s": done.cpu_s, "peak_mb": done.peak_rss_mb,
            "ppl": json.loads(done.stdout)["ppl_wiki"]}


def render(records: list[dict]) -> str:
    lines = ["# Perplexity in the bitquilt runtime vs the transformers model (`bitquilt eval`, whole command)", "",
             __doc__.split("\n\n", 2)[2].replace("\n", " ").strip(), "",
             "| model | variant | runtime | windows × tokens | threads | ppl | wall s | CPU s | peak MB "
             "| wall ÷ transformers | peak ÷ transformers | load avg |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    by_key = {(r["model"], r["variant"], r["runtime"]): r for r in records}
    for r in records:
        base = by_key.get((r["model"], r["variant"], "transformers"), r)
        lines.append(f"| {r['model']} | {r['variant']} | {r['runtime']} | {r['windows']} × {r['seqlen']} | "
                     f"{r['threads']} | {r['ppl']:.4f} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['peak_mb']:.0f} | "
                     f"{r['wall_s'] / base['wall_s']:.2f} | {r['peak_mb'] / base['peak_mb']:.2f} | {r['loadavg']} |")
    return "\n".join(lines + provenance(records))


def main() -> None:
    p = parser(__doc__, models="smollm2-135m,qwen2.5-1.5b", threads=2, workdir="/tmp/bitquilt-load-memory")
    p.add_argument("--variants", default="w4 g128 head8,w4 g128 head4")
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--ppl-windows", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    bench = Bench("eval_runtime", KEY, render)
    for model in args.models.split(","):
        for variant in args.variants.split(","):
            saved = Path(args.workdir) / model / variant.replace(" ", "-")
            quantize(model, variant, saved)
            start = loadavg()
            runs: dict[str, list[dict]] = {r: [] for r in RUNTIMES}
            for i in range(args.repeats):  # alternating, the first runtime changing every round
                for runtime in RUNTIMES[::-1] if i % 2 else RUNTIMES:
                    runs[runtime].append(timed_eval(saved, runtime, args.seqlen, args.ppl_windows, args.threads))
            ppl = {r: {x["ppl"] for x in v} for r, v in runs.items()}
            print(f"{model} {variant}: ppl {ppl}", flush=True)
            for runtime, results in runs.items():
                record = {"model": model, "variant": variant, "runtime": runtime, "settings": {},
                          "seqlen": args.seqlen, "windows": args.ppl_windows, "threads": args.threads,
                          "repeats": args.repeats, "ppl": results[0]["ppl"],
                          **{k: statistics.median(x[k] for x in results) for k in ("wall_s", "cpu_s", "peak_mb")},
                          "loadavg": f"{start} → {loadavg()}", **stamp()}
                print(f"  {runtime}: {record['wall_s']:.1f} s wall, {record['cpu_s']:.1f} s CPU, "
                      f"{record['peak_mb']:.0f} MB", flush=True)
                bench.store(record)


if __name__ == "__main__":
    run(main)
