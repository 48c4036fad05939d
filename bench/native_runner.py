"""The native runner (`bitquilt-native`, no Python) against `bitquilt-run` (Python + the same C library) on the same
standalone export, prompt and settings, alternated in one run.

    python bench/native_runner.py --exports /tmp/bitquilt-load-memory/smollm2-135m/w4-g128-head8-standalone,... \
        --threads 1,2 --repeats 3

Each measurement is one process generating 32 greedy tokens (`--ignore-eos`) after a prompt of the first 128 tokens
of a Wikipedia passage, as `bench/load_memory.py`'s *bitquilt-native* rows; the two programs alternate, `repeats`
times each. Reported, medians over the repeats: prefill and decode tokens/s as each program reports them (wall
clock), the whole process's wall seconds (start to exit, what a user waits) and CPU seconds (user + system, from the
kernel's accounting of the finished child), its peak RSS and load seconds, and the native ÷ Python ratios of one
run. Results: bench/results/native_runner.{json,md}.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

PROGRAMS = ("bitquilt-run", "bitquilt-native")
KEY = ("export", "threads", "program")


def prompt_of(export: Path) -> str:
    """The first 128 tokens of a Wikipedia passage, as text, in the export's tokenizer (load_memory's prompt too)."""
    from bitquilt.data.corpora import load_documents
    from bitquilt.runtime.tokenizer import FastTokenizer

    tokenizer = FastTokenizer(export)
    return tokenizer.decode(tokenizer.encode(load_documents("wiki")[0])[:128])


def measure(command: list[str]) -> dict:
    """One run of `command` (its --json result), the CPU seconds it used and its wall seconds, start to exit."""
    from common import run_child

    done = run_child(command)
    if done.returncode:
        raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
    return {**json.loads(done.stdout), "cpu_s": done.cpu_s, "wall_s": done.wall_s}


def render(records: list[dict]) -> str:
    from common import doc_protocol, provenance

    lines = ["# Native runner against bitquilt-run", "", doc_protocol(__doc__), "",
             "| export | threads | program | prompt tokens | prefill tok/s | decode tok/s | wall s | CPU s "
             "| peak RSS MB | load s | decode × bitquilt-run | prefill × bitquilt-run | wall × bitquilt-run "
             "| load avg |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    python = {(r["export"], r["threads"]): r for r in records if r["program"] == "bitquilt-run"}
    for r in sorted(records, key=lambda r: (r["export"], r["threads"], r["program"])):
        base = python.get((r["export"], r["threads"]))
        ratios = (f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.3f} | "
                  f"{r['prefill_tokens_per_s'] / base['prefill_tokens_per_s']:.3f} | "
                  f"{r['wall_s'] / base['wall_s']:.3f}") if base else "– | – | –"
        lines.append(f"| {Path(r['export']).parent.name}/{Path(r['export']).name} | {r['threads']} | {r['program']} | "
                     f"{r['prompt_tokens']} | {r['prefill_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | "
                     f"{r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['peak_rss_mb']:.0f} | {r['load_seconds']:.3f} | "
                     f"{ratios} | {r['loadavg']} |")
    return "\n".join(lines + provenance(records))


def main() -> None:
    from common import Bench, loadavg, parser, stamp

    from bitquilt.runtime.standalone.library import library, runner_path

    p = parser(__doc__)
    p.add_argument("--exports", required=True, help="standalone export directories, comma-separated")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    library()  # both programs built before any timing
    commands = {"bitquilt-run": [sys.executable, "-m", "bitquilt.runtime.standalone.cli"],
                "bitquilt-native": [str(runner_path())]}
    bench = Bench("native_runner", KEY, render)
    for export in map(Path, args.exports.split(",")):
        prompt = prompt_of(export)
        for threads in map(int, args.threads.split(",")):
            runs: dict[str, list[dict]] = {name: [] for name in PROGRAMS}
            for _ in range(args.repeats):
                for name in PROGRAMS:  # alternated: the two see the same load
                    runs[name].append(measure([*commands[name], str(export), "--prompt", prompt, "--max-new-tokens",
                                               "32", "--ignore-eos", "--threads", str(threads), "--json"]))
            for name, results in runs.items():
                record = {"export": str(export), "threads": threads, "program": name, "settings": {},
                          "prompt_tokens": results[0]["prompt_tokens"], "repeats": args.repeats,
                          **{k: statistics.median(r[k] for r in results) for k in
                             ("prefill_tokens_per_s", "decode_tokens_per_s", "wall_s", "cpu_s", "peak_rss_mb",
                              "load_seconds")},
                          "loadavg": loadavg(), **stamp()}
                print(f"{export.name} {threads}t {name}: decode {record['decode_tokens_per_s']:.1f} tok/s, prefill "
                      f"{record['prefill_tokens_per_s']:.1f}, peak {record['peak_rss_mb']:.0f} MB", flush=True)
                bench.store(record)


if __name__ == "__main__":
    from common import run

    run(main)
