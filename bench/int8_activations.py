"""What int8 activations cost in perplexity: 4- and 2-bit models with exact kernels vs `--int8-activations`.

    python bench/int8_activations.py --model smollm2-135m --threads 1

Each configuration is quantized once and evaluated twice on the same windows: with the exact kernels
(activations to 2^-21) and with `bitquilt.kernels.using(int8_activations=True)`, where every 4- or 2-bit uniform
linear rounds its input to int8 per block of 32 columns (scale max|x| / 127) before the vpmaddubsw kernel
(llama.cpp's Q8 activations). The LM head and embeddings follow their own format (fp32, or 4-bit in *head4*,
which then runs on int8 activations too). Results: bench/results/int8_activations.{json,md}.
"""

from __future__ import annotations

import time

from common import GPTQ_PLAIN, doc_protocol, fmt_ppl, parser, ppl_bench, run, sections, stamp

from bitquilt import kernels
from bitquilt.api import calibration_ids, load, model_summary, quantize
from bitquilt.eval import perplexity
from bitquilt.recipes import Recipe

CONFIGS = {"rtn w4 g128": Recipe("rtn", w_bits=4, group_size=128),
           "rtn w4 g128 head4": Recipe("rtn", w_bits=4, group_size=128, head_bits=4),
           "gptq w4 g128": Recipe("gptq", w_bits=4, group_size=128, options=GPTQ_PLAIN),
           "gptq w2 g64": Recipe("gptq", w_bits=2, group_size=64, options=GPTQ_PLAIN),
           "best w2 g64": Recipe.best(2)}  # the CLI's default at 2 bits: awq+rtn with block-wise reconstruction
KEY = ("model", "config", "activations")


def render(records: list[dict]) -> str:
    lines = ["# Int8 activations: perplexity cost", "", doc_protocol(__doc__), ""]
    for _model, _settings, rows, header in sections(records):
        lines += header
        lines += ["| configuration | bits/weight | exact kernels | int8 activations | change |",
                  "|---|---:|---:|---:|---:|"]
        for config in dict.fromkeys(r["config"] for r in rows):
            exact = next((r for r in rows if r["config"] == config and r["activations"] == "exact"), None)
            int8 = next((r for r in rows if r["config"] == config and r["activations"] == "int8"), None)
            change = f"{100 * (int8['ppl'] / exact['ppl'] - 1):+.2f}%" if exact and int8 else ""
            bits = (exact or int8)["bits_per_weight"]
            lines.append(f"| {config} | {bits:.3f} | {fmt_ppl(exact and exact['ppl'])} | "
                         f"{fmt_ppl(int8 and int8['ppl'])} | {change} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, model="smollm2-135m")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    args, calib, settings, bench = ppl_bench(p, "int8_activations", KEY, render, calib_samples=32, ppl_windows=40)
    for config in args.configs.split(","):
        wanted = {"model": args.model, "config": config, "settings": settings}
        todo = [a for a in ("exact", "int8") if bench.todo({**wanted, "activations": a})]
        if not todo:
            continue
        model, tokenizer = load(args.model)
        t0 = time.perf_counter()
        quantize(model, CONFIGS[config], calibration_ids(tokenizer, calib), progress=False)
        quant_time = time.perf_counter() - t0
        for activations in todo:
            t0 = time.perf_counter()
            with kernels.using(int8_activations=activations == "int8"):
                ppl = perplexity(model, tokenizer, args.ppl_data, args.seqlen, args.ppl_windows, progress=False).ppl
            record = {"model": args.model, "config": config, "activations": activations, "settings": settings,
                      "ppl": ppl, "eval_s": time.perf_counter() - t0, "quant_time_s": quant_time,
                      **model_summary(model), **stamp()}
            print(f"{config:20s} {activations:5s} ppl {ppl:.3f}", flush=True)
            bench.store(record)


if __name__ == "__main__":
    run(main)
