"""Where a quantization run's time goes: cProfile of one `bitquilt.quantize` call, summed by what the time is spent on.

    python bench/quant_profile.py --method awq+gptq --threads 1 --out /tmp/profile.json [--calib-dtype fp32|bf16]

Imports whichever bitquilt `PYTHONPATH` names, so the same script profiles an older checkout (e.g. a
`git worktree add /tmp/quant-base 9d60c69`). Prints the functions with the most own time and writes them, with wall
and CPU seconds and the load average, as JSON (`--out`); docs/quantization-speed.md holds the tables.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import os
import pstats
import time

import torch
from common import add_quant_run_args


def own_times(profile: cProfile.Profile, top: int) -> list[dict]:
    """The `top` functions by own (exclusive) time: name, calls, seconds."""
    stats = pstats.Stats(profile).stats
    rows = [{"function": f"{os.path.basename(path)}:{name}" if path != "~" else name, "calls": calls,
             "own_s": round(own, 2), "cumulative_s": round(cum, 2)}
            for (path, _line, name), (_, calls, own, cum, _callers) in stats.items()]
    return sorted(rows, key=lambda r: -r["own_s"])[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quant_run_args(p)
    p.add_argument("--calib-dtype", default=None, help="passed to quantize when the checkout has the option")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from bitquilt.api import calibration_ids, load, quantize
    from bitquilt.recipes import CalibConfig, Recipe

    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    ids = calibration_ids(tokenizer, CalibConfig("sciq", args.calib_samples, 512, 0))
    extra = {}
    if args.calib_dtype is not None and "calib_dtype" in inspect.signature(quantize).parameters:
        extra["calib_dtype"] = args.calib_dtype
    profile = cProfile.Profile()
    t0, c0 = time.perf_counter(), time.process_time()
    profile.enable()
    quantize(model, Recipe(args.method, w_bits=4, group_size=128), ids, progress=False, **extra)
    profile.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rows = own_times(profile, args.top)
    for r in rows:
        print(f"{r['own_s']:8.1f} s {r['calls']:>9} {r['function']}")
    print(f"wall {wall:.1f} s, cpu {cpu:.1f} s, load {os.getloadavg()}")
    with open(args.out, "w") as f:
        json.dump({"method": args.method, "threads": args.threads, "calib_samples": args.calib_samples,
                   "calib_dtype": extra.get("calib_dtype", "fp32"), "wall_s": round(wall, 1),
                   "cpu_s": round(cpu, 1), "loadavg": os.getloadavg(), "top": rows}, f, indent=1)


if __name__ == "__main__":
    main()
