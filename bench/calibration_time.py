"""Calibration time with and without reusing the solved attention's output (`bitquilt.calib.capture.attention_reused`).

    python bench/calibration_time.py --model smollm2-135m --recipes gptq,quarot+rtn

True-sequential calibration runs each block once per group of linears; once the attention's linears are solved
the engine keeps its output per window for the MLP groups' passes and the block's final pass. Per recipe, two
worker processes quantize the same model on the same calibration windows at the same time (so both see the same
machine load), one with the reuse and one without; each reports its CPU seconds and a SHA-256 of the quantized
state dict, which must agree (the reuse redoes nothing differently, it skips recomputation). Results:
bench/results/calibration_time.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import subprocess
import sys
import time

import torch
from common import GPTQ_PLAIN, RESULTS, finish, loadavg, parser, run, run_facts, run_header, write_atomic

RECIPES = {  # the protocols of bench/mobiquant.py's GPTQ rows and bench/dynamicptq.py's quarot+rtn backbone
    "gptq": dict(method="gptq", w_bits=4, group_size=128, options=GPTQ_PLAIN),
    "quarot+gptq": dict(method="quarot+gptq", w_bits=4, group_size=128, a_bits=4, kv_bits=4, a_clip=None,
                        options=GPTQ_PLAIN),
    "quarot+rtn": dict(method="quarot+rtn", w_bits=4, group_size=128, a_bits=4, kv_bits=4, a_clip=None),
}


def worker(model_name: str, recipe_name: str, samples: int, reuse: bool) -> dict:
    import bitquilt.pipeline.engine as engine
    from bitquilt.api import calibration_ids, load, quantize
    from bitquilt.recipes import CalibConfig, Recipe

    torch.set_num_threads(1)
    if not reuse:
        engine.attention_reused = lambda *_: contextlib.nullcontext()
    model, tokenizer = load(model_name)
    ids = calibration_ids(tokenizer, CalibConfig("sciq", samples, 512, 0))
    c0, t0 = time.process_time(), time.perf_counter()
    quantize(model, Recipe(**RECIPES[recipe_name]), ids, progress=False)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    digest = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return {"cpu_s": cpu, "wall_s": wall, "state_sha256": digest.hexdigest()}


def main() -> None:
    p = parser(__doc__, model="smollm2-135m")
    p.add_argument("--recipes", default="gptq,quarot+rtn")
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--worker", nargs=2, metavar=("RECIPE", "REUSE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.worker[0], args.calib_samples, args.worker[1] == "on")))
        return
    rows, facts = [], run_facts()
    for recipe in args.recipes.split(","):
        if recipe not in RECIPES:
            raise SystemExit(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
        load_start = loadavg()
        procs = {reuse: subprocess.Popen([sys.executable, __file__, "--model", args.model, "--calib-samples",
                                          str(args.calib_samples), "--worker", recipe, reuse],
                                         stdout=subprocess.PIPE, text=True) for reuse in ("on", "off")}
        out = {reuse: json.loads(proc.communicate()[0].strip().splitlines()[-1]) for reuse, proc in procs.items()}
        if any(proc.returncode for proc in procs.values()):
            raise SystemExit(f"a worker failed for {recipe}")
        row = {"recipe": recipe, "reuse": out["on"], "no_reuse": out["off"], "loadavg": [load_start, loadavg()],
               "identical": out["on"]["state_sha256"] == out["off"]["state_sha256"]}
        print(f"{recipe}: {out['off']['cpu_s']:.1f} -> {out['on']['cpu_s']:.1f} CPU-s, identical {row['identical']}",
              flush=True)
        rows.append(row)
    meta = {"model": args.model, "calib_samples": args.calib_samples, **finish(facts)}
    write_atomic(RESULTS / "calibration_time.json", json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
    lines = ["# Calibration time: reusing the solved attention's output", "",
             run_header(meta), "",
             f"{args.model}, {args.calib_samples} × 512 SciQ windows, 1 thread per worker, both workers at once.", "",
             "| recipe | CPU s without | CPU s with | with ÷ without | quantized model identical | load average |",
             "|---|---:|---:|---:|---|---|"]
    lines += [f"| {r['recipe']} | {r['no_reuse']['cpu_s']:.1f} | {r['reuse']['cpu_s']:.1f} | "
              f"{r['reuse']['cpu_s'] / r['no_reuse']['cpu_s']:.2f} | {'yes' if r['identical'] else '**no**'} | "
              f"{r['loadavg'][0]} → {r['loadavg'][1]} |" for r in rows]
    write_atomic(RESULTS / "calibration_time.md", "\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'calibration_time.md'}")


if __name__ == "__main__":
    run(main)
