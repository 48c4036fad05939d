"""Aggregate decode speed of a continuous batch (`bitquilt.runtime.batch.Batch`) by batch size, fused vs lean.

    bitquilt quantize smollm2-135m --method rtn --w-bits 4 --group-size 128 -o out/smollm2-w4
    python bench/batch_decode.py out/smollm2-w4 --batches 1,2,4,8,16 --threads 1,2 --activations exact,int8

B sequences (distinct prompts of `--prompt` tokens) join one batch and read their prompts; once all are decoding,
`--steps` steps are timed, each giving every sequence one token (greedy): aggregate tok/s = B × steps / wall seconds,
and the process's CPU seconds per token beside it. Engines: *fused* (every decoder layer in one compiled call for all
B rows, csrc/runtime/decode_step.cpp, the final norm and LM head in it too) and *lean* (module by module, each linear
once for all rows, the head a torch matmul). Activations: *exact* (the lookup-table kernels) or *int8*
(`kernels.using(int8_activations=True)`, CLI `--int8-activations`: 4-bit linears on the int8 kernel). Each
(activations, threads, B) runs fused and lean back to back, their order alternating from round to round, so that both
see the same load; a cell is the median over `--rounds`, and the ratio columns compare cells of the same run. The
load average (1 minute) is taken before each timing. Results: bench/results/batch_decode.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from common import RESULTS, command_line, machine, run, write_atomic

from bitquilt import kernels
from bitquilt.io import load
from bitquilt.runtime.batch import Batch
from bitquilt.runtime.engines import sampler

ENGINES = ("fused", "lean")


def timed(model: torch.nn.Module, engine: str, prompts: list[list[int]], steps: int) -> dict:
    """One measurement: the batch of `prompts` brought to decoding, then `steps` steps timed."""
    batch = Batch(model, max(map(len, prompts)) + len(prompts) + steps + 2, engine)
    if engine == "fused" and batch.fused is None:
        raise SystemExit("the fused layers do not run this model")
    seqs = [batch.add(p, batch.layers.max_len, sampler(0.0)) for p in prompts]
    while not all(s.new_ids for s in seqs):
        batch.step()
    load_1m = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        batch.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = len(prompts) * steps
    return {"tok_s": tokens / wall, "cpu_ms_per_token": 1000 * cpu / tokens, "wall_s": wall, "load": load_1m}


def render(records: list[dict], meta: dict) -> str:
    lines = ["# Batched decode: aggregate tok/s by batch size, fused vs lean", "",
             __doc__.split("\n\n", 2)[2].strip(), "",
             f"Model: `{meta['model']}`; {meta['steps']} timed steps, {meta['rounds']} rounds, prompts of "
             f"{meta['prompt']} tokens. Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores; load "
             f"average (1 min) during the run {min(r['load'] for r in records):.1f}–"
             f"{max(r['load'] for r in records):.1f}.", "",
             "| activations | threads | B | fused tok/s | lean tok/s | fused / lean | fused vs its B = 1 | "
             "fused CPU ms/token | lean CPU ms/token | load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    cell = {}
    for key in dict.fromkeys((r["activations"], r["threads"], r["batch"], r["engine"]) for r in records):
        rows = [r for r in records if (r["activations"], r["threads"], r["batch"], r["engine"]) == key]
        cell[key] = {f: statistics.median(r[f] for r in rows) for f in ("tok_s", "cpu_ms_per_token", "load")}
    for act, threads, b in dict.fromkeys(k[:3] for k in cell):
        f, le, one = cell[act, threads, b, "fused"], cell[act, threads, b, "lean"], cell.get((act, threads, 1, "fused"))
        scale = f"{f['tok_s'] / one['tok_s']:.2f}×" if one else ""
        lines.append(f"| {act} | {threads} | {b} | {f['tok_s']:.1f} | {le['tok_s']:.1f} | "
                     f"{f['tok_s'] / le['tok_s']:.2f}× | {scale} | {f['cpu_ms_per_token']:.1f} | "
                     f"{le['cpu_ms_per_token']:.1f} | {(f['load'] + le['load']) / 2:.1f} |")
    lines += ["", f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a saved model directory (or a model name)")
    p.add_argument("--batches", default="1,2,4,8,16", help="batch sizes, comma-separated")
    p.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per measurement")
    p.add_argument("--rounds", type=int, default=3, help="measurements per cell (the median is reported)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    p.add_argument("--activations", default="exact,int8", help="exact and/or int8, comma-separated")
    args = p.parse_args()
    model, _ = load(args.model)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [torch.randint(0, vocab, (args.prompt,), generator=generator).tolist() for _ in range(max(batches))]
    records = []
    for r in range(args.rounds):
        for act in args.activations.split(","):
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                for b in batches:
                    for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                        with kernels.using(int8_activations=act == "int8"):
                            record = timed(model, engine, prompts[:b], args.steps)
                        records.append({"round": r, "activations": act, "threads": threads, "batch": b,
                                        "engine": engine, **record})
                        print(json.dumps(records[-1]), flush=True)
    meta = {"model": args.model, "steps": args.steps, "rounds": args.rounds, "prompt": args.prompt,
            "machine": machine(), "command": command_line()}
    write_atomic(RESULTS / "batch_decode.json", json.dumps({**meta, "records": records}, indent=1) + "\n")
    write_atomic(RESULTS / "batch_decode.md", render(records, meta))


if __name__ == "__main__":
    run(main)
