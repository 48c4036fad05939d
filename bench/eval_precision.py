"""What evaluating in bf16 costs and saves: perplexity and time of fp32 and bf16 evaluation (`--eval-dtype`).

    python bench/eval_precision.py --model qwen2.5-1.5b --threads 2

For the packaged model (*fp*) and its RTN W4 g128 quantization (*rtn w4g128*, in memory), the same perplexity
windows are scored in fp32 and in bf16 (matrix products in bf16 with fp32 sums; `bitquilt.eval.precision`),
alternating fp32 and bf16 `--rounds` times in one process; seconds are the best round's wall and CPU time.
Results: bench/results/eval_precision.{json,md}.
"""

from __future__ import annotations

import time

from common import cpu_name, doc_protocol, fmt_ppl, loadavg, parser, ppl_bench, run, sections, stamp

from bitquilt.api import load, quantize
from bitquilt.eval import perplexity
from bitquilt.isa import fast_bf16
from bitquilt.recipes import Recipe

CONFIGS = {"fp": None, "rtn w4g128": Recipe("rtn", w_bits=4, group_size=128)}
PRECISIONS = ("fp32", "bf16")
KEY = ("model", "config")


def render(records: list[dict]) -> str:
    lines = ["# Evaluation precision: fp32 against bf16 products", "", doc_protocol(__doc__), ""]
    for _model, _settings, rows, header in sections(records):
        lines += header + [
            "| config | CPU | fast bf16 | load | ppl fp32 | ppl bf16 | Δ ppl | wall s fp32 | wall s bf16 | × wall "
            "| CPU s fp32 | CPU s bf16 |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            a, b = (r["runs"][p] for p in PRECISIONS)
            lines.append(f"| {r['config']} | {r['cpu']} | {r['fast_bf16'] or 'no'} | {r['load']} | "
                         f"{fmt_ppl(a['ppl'])} | {fmt_ppl(b['ppl'])} | {b['ppl'] / a['ppl'] - 1:+.3%} | "
                         f"{a['wall_s']:.1f} | {b['wall_s']:.1f} | {a['wall_s'] / b['wall_s']:.2f} | "
                         f"{a['cpu_s']:.1f} | {b['cpu_s']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def timed(model, tokenizer, args, precision: str) -> dict:
    """One evaluation: its perplexity, wall and CPU seconds."""
    t0, c0 = time.perf_counter(), time.process_time()
    ppl = perplexity(model, tokenizer, args.ppl_data, args.seqlen, args.ppl_windows, progress=False,
                     precision=precision).ppl
    return {"ppl": ppl, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def main() -> None:
    p = parser(__doc__, model="smollm2-135m")
    p.add_argument("--rounds", type=int, default=2, help="fp32/bf16 alternations; the best round is reported")
    args, _, settings, bench = ppl_bench(p, "eval_precision", KEY, render, calib_samples=1, ppl_windows=8)
    settings.pop("calibration")  # RTN: none
    model, tokenizer = load(args.model)
    for config, recipe in CONFIGS.items():
        if recipe is not None:
            quantize(model, recipe, None, progress=False)
        record = {"model": args.model, "config": config, "settings": settings}
        if not bench.todo(record):
            continue
        before = loadavg()
        rounds = [{precision: timed(model, tokenizer, args, precision) for precision in PRECISIONS}
                  for _ in range(args.rounds)]
        runs = {precision: min((r[precision] for r in rounds), key=lambda run: run["wall_s"])
                for precision in PRECISIONS}
        record.update(runs=runs, cpu=cpu_name(), fast_bf16=fast_bf16(), load=f"{before} → {loadavg()}",
                      **stamp())
        print(f"{config:12s} " + "  ".join(f"{k} ppl {v['ppl']:.3f} {v['wall_s']:.1f} s" for k, v in runs.items()),
              flush=True)
        bench.store(record)


if __name__ == "__main__":
    run(main)
