"""Ad hoc: `bitquilt bench` on one saved model for two or more checkouts of bitquilt, alternating.

Each measurement is a fresh process running one checkout's command line (PYTHONPATH=<tree>, its own cache so their
compiled kernels do not overwrite each other): `python -m bitquilt.cli bench MODEL --json` with the flags given,
every checkout once per round in a rotating order, so a change that only moves code can be shown to keep the speed.

    python bench/prototypes/speed_ab.py /tmp/q15-w4h4 old=/tmp/wt_old:/tmp/old_cache new=.:~/.cache/bitquilt \
        --rounds 5 --flags "--threads 1 --int8-activations --prompt-tokens 128 --new-tokens 32 --repeats 3"

Writes bench/results/<--report>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import checkout_args, finish, run, run_child, run_facts, run_header, write_report  # noqa: E402

RATES = ("prefill_tokens_per_s", "decode_tokens_per_s")


def measure(model: str, tree: str, cache: str, flags: list[str]) -> dict:
    """One `bitquilt bench` of `model` by the checkout at `tree`: its rates, and the child's wall and CPU seconds."""
    env = {**os.environ, "PYTHONPATH": str(Path(tree).expanduser().resolve()),
           "BITQUILT_CACHE": str(Path(cache).expanduser())}
    child = run_child([sys.executable, "-m", "bitquilt.cli", "bench", model, "--json", *flags], env)
    if child.returncode:
        raise RuntimeError(f"{tree}: bitquilt bench exited {child.returncode}:\n{child.stderr[-2000:]}")
    result = json.loads(child.stdout)[0]
    return {**{k: result[k] for k in RATES}, "wall_s": child.wall_s, "cpu_s": child.cpu_s}


def render(record: dict) -> str:
    lines = ["# `bitquilt bench` by checkout, alternating", "", run_header(record), "",
             f"Saved model `{record['model']}`, flags `{record['flags']}`; {record['rounds']} rounds, the checkouts "
             "in a rotating order, a fresh process each; medians over the rounds. *wall s*, *CPU s*: the whole "
             "child process (load, warm-up, the timed runs).", "",
             "| checkout | prefill tok/s | decode tok/s | decode ÷ first checkout's | wall s | CPU s |",
             "|---|---:|---:|---:|---:|---:|"]
    first = next(iter(record["medians"].values()))["decode_tokens_per_s"]
    for name, m in record["medians"].items():
        lines.append(f"| {name} | {m['prefill_tokens_per_s']:.1f} | {m['decode_tokens_per_s']:.2f} | "
                     f"{m['decode_tokens_per_s'] / first:.3f} | {m['wall_s']:.1f} | {m['cpu_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    checkout_args(p, "speed_ab", rounds=5)
    p.add_argument("--flags", default="--threads 1 --prompt-tokens 128 --new-tokens 32 --repeats 3",
                   help="the flags of `bitquilt bench`, as one string")
    args = p.parse_args()
    builds = dict(b.split("=", 1) for b in args.builds)
    names = list(builds)
    facts = run_facts()
    samples: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # the first of a round runs slower
            tree, cache = builds[name].split(":", 1)
            s = measure(str(Path(args.model).resolve()), tree, cache, shlex.split(args.flags))
            samples[name].append(s)
            print(f"[{r + 1}/{args.rounds}] {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()), flush=True)
    medians = {n: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for n, runs in samples.items()}
    record = {**finish(facts), "model": args.model, "flags": args.flags, "rounds": args.rounds,
              "medians": medians, "samples": samples}
    write_report(args.report, record, render)


if __name__ == "__main__":
    run(main)
