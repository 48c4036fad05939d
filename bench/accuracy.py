"""Accuracy benchmark: FP vs RTN / GPTQ / AWQ (/ BPDQ) perplexity, size, bits/weight, time, memory.

    python bench/accuracy.py --model smollm2-135m                 # the issue's reference settings
    python bench/accuracy.py --model qwen2.5-0.5b --calib-samples 32 --ppl-windows 10
    python bench/accuracy.py --model qwen2.5-1.5b --calib-samples 128 --suites main,recon --grid 3:128 \
        --labels rtn,awq,"awq+rtn recon 50" --threads 2 --resume-dir out/bench/resume   # killed runs carry on

Results are appended to bench/results/accuracy.json (one record per model × config × settings;
a config already measured with the same settings is skipped, so an interrupted run resumes)
and bench/results/accuracy.md is regenerated from all records.
"""

from __future__ import annotations

import copy
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from common import GPTQ_ACT_ORDER_STATIC, GPTQ_PLAIN, fmt_ppl, parser, pivot, ppl_bench, run, sections, stamp

from bitquilt.api import calibration_ids, load, model_summary, quantize, save
from bitquilt.errors import UserError
from bitquilt.eval import perplexity
from bitquilt.eval.precision import EVAL_DTYPES, eval_precision
from bitquilt.eval.tasks import TASK_NAMES
from bitquilt.eval.zeroshot import average_accuracy, evaluate_tasks
from bitquilt.recipes import Recipe
from bitquilt.resources import peak_rss_mb, reset_peak_rss

KEY = ("model", "label", "w_bits", "group_size")  # + settings: what identifies a record

# (label, method, bits, group size, solver options); grid order = run order
GRID = ((4, 128), (3, 128), (2, 64))
# the "gptq" rows are the original sweep, as in the reference; GPTQ's own default is act-order + static groups
OPTIONS = {"gptq": GPTQ_PLAIN, "awq+gptq": GPTQ_PLAIN}  # per method, in the rows that name no variant
MAIN = [(m, m, b, g, OPTIONS.get(m, {})) for b, g in GRID for m in ("rtn", "gptq", "bpdq", "awq")]
REFERENCE_EXTRAS = [
    ("rtn", "rtn", 4, -1, {}), ("gptq", "gptq", 4, -1, GPTQ_PLAIN),
    ("rtn", "rtn", 3, 32, {}), ("gptq", "gptq", 3, 32, GPTQ_PLAIN),
    ("gptq act-order+static", "gptq", 3, 128, GPTQ_ACT_ORDER_STATIC),
    ("gptq act-order+static", "gptq", 2, 64, GPTQ_ACT_ORDER_STATIC),
]
IMPROVEMENTS = [
    (label, method, b, g, options) for b, g in GRID for label, method, options in (
        ("gptq act-order+static", "gptq", GPTQ_ACT_ORDER_STATIC),
        ("gptq act-order", "gptq", {**GPTQ_ACT_ORDER_STATIC, "static_groups": False}),
        ("gptq mse", "gptq", {**GPTQ_PLAIN, "mse": True}),
        ("gptq act-order+static mse", "gptq", {**GPTQ_ACT_ORDER_STATIC, "mse": True}),
        ("gptq damp 0.1", "gptq", {**GPTQ_PLAIN, "damp": 0.1}),
        ("awq+gptq", "awq+gptq", GPTQ_PLAIN),
        ("awq+gptq act-order+static", "awq+gptq", GPTQ_ACT_ORDER_STATIC),
        ("awq+gptq act-order+static mse", "awq+gptq", {**GPTQ_ACT_ORDER_STATIC, "mse": True}),
        ("bpdq damp 0.1", "bpdq", {"damp": 0.1}),
        ("gptq act-order+static mse damp 0.1", "gptq", {"damp": 0.1}),  # GPTQ's defaults, 10× the damping
        ("awq+gptq act-order+static mse damp 0.1", "awq+gptq", {"damp": 0.1}),
    )
]
# BPDQ's extra grids, with the baselines it is compared against there
BPDQ = [(m, m, b, g, OPTIONS.get(m, {})) for b, g in ((3, 64), (2, 128)) for m in ("bpdq", "rtn", "gptq", "awq")]
# block-wise reconstruction (RECON_RECIPE) and candidates that change it: for rows whose method is "recon" the last
# field overrides the recipe's fields (Recipe.reconstruction). The CLI's default is the improvements suite's
# "gptq act-order+static mse damp 0.1" row (BEST_RECIPES).
RECON = [("awq+rtn recon 50", "recon", b, g, {}) for b, g in GRID]
CANDIDATES = [
    (label, "recon", b, g, fields) for b, g in GRID for label, fields in (
        ("gptq damp 0.1 + recon lr 0.01 no clip",
         {"method": "gptq", "options": {"damp": 0.1}, "stage_options": {"recon": {"lr": 0.01, "clip": False}}}),
        ("awq+rtn recon 50 + quantized-stream targets", {"stage_options": {"fp_reference": {"stream": "quantized"}}}),
        ("awq+rtn recon 50 + last step kept", {"stage_options": {"recon": {"keep_best": False}}}),
    )
]
SUITES = {"main": MAIN, "reference": REFERENCE_EXTRAS, "improvements": IMPROVEMENTS, "bpdq": BPDQ, "recon": RECON,
          "candidates": CANDIDATES}

# The figures from the unmodified IST-DASLab GPTQ reference on smollm2-135m (same settings).
REFERENCE_PPL = {
    ("fp", None, None): 20.54,
    ("rtn", 4, 128): 26.79, ("gptq", 4, 128): 28.98,
    ("rtn", 3, 128): 103.4, ("gptq", 3, 128): 77.7,
    ("rtn", 2, 64): 442468, ("gptq", 2, 64): 13306,
    ("rtn", 4, -1): 35.5, ("gptq", 4, -1): 35.1,
    ("rtn", 3, 32): 47.7, ("gptq", 3, 32): 50.2,
    ("gptq act-order+static", 3, 128): 56.7, ("gptq act-order+static", 2, 64): 2627,
}


def saved_name(model: str, label: str, bits: int, group: int) -> str:
    """Directory name of a saved benchmark model, e.g. smollm2-135m-gptq_act-order-w3g128."""
    return f"{model}-{label.replace(' ', '_').replace('+', '_')}-w{bits}g{group}"


def grid_label(bits: int, group: int) -> str:
    return f"W{bits}" + (" per-ch" if group == -1 else f"g{group}")


def zeroshot_cell(r: dict) -> str:
    """The zero-shot average of a record, in %, with the items scored per task; blank if not measured."""
    z = r.get("zeroshot")
    return "" if not z else f"{100 * z['average']:.1f} ({z['limit']}/task)"


def grid_summary(rows: list[dict], value: Callable[[dict], str] | None = None) -> list[str]:
    """One row per method, one column per grid (widest first): `value` of each record (default: the ppl, plus the
    bits/weight where a format spends more than the uniform grid of that size, BPDQ's coefficients)."""
    quantized = [r for r in rows if r["w_bits"] is not None]
    grids = sorted({(r["w_bits"], r["group_size"]) for r in quantized}, key=lambda bg: (-bg[0], bg[1] == -1, -bg[1]))
    labels = sorted({r["label"] for r in quantized}, key=lambda label: (label != "rtn", "bpdq" in label, label))
    cell = {}
    for r in quantized:
        bits, group = r["w_bits"], r["group_size"]
        uniform_bpw = bits + (16 + 8) / group if group > 0 else bits  # asymmetric uniform grid: fp16 scale, 8-bit zero
        # (tolerance: a shorter last group, e.g. 576 = 4×128 + 64, costs a uniform grid a few hundredths)
        extra = f" ({r['bits_per_weight']:.2f} bpw)" if r["bits_per_weight"] > uniform_bpw + 0.05 else ""
        cell[r["label"], grid_label(bits, group)] = fmt_ppl(r["ppl"]) + extra if value is None else value(r)
    fp = next((r for r in rows if r["label"] == "fp"), None)
    corner = f"method (fp {fmt_ppl(fp['ppl'])})" if fp else "method"
    return pivot(corner, labels, [grid_label(*g) for g in grids], cell)


def render(records: list[dict]) -> str:
    lines = ["# Accuracy benchmark", "",
             "Generated by `bench/accuracy.py` (see the command per table). Perplexity is token-level on "
             "non-overlapping windows (no BOS) of the evaluation text; calibration and evaluation texts never "
             "overlap. *ref* is the issue's figure from the unmodified IST-DASLab GPTQ reference with the same "
             "settings (smollm2-135m only).", "",
             "**Caveat:** the packaged models were already quantized upstream (llama.cpp 4-bit grids); the FP "
             "reference is the dequantized GGUF, so mild re-quantization (4-bit, small groups) looks better "
             "than it would on a true FP16 checkpoint. 2–3-bit results and the ordering of methods are the "
             "meaningful part.", ""]
    for model, _settings, rows, header in sections(records):
        lines += header + [
            "| method | bits | group | ppl | ref | zero-shot avg % | size MB | bits/weight | quant time s "
            "| peak RSS MB |",
            "|---|---|---|---|---|---|---|---|---|---|"]
        order = {"fp": 0, "rtn": 1, "awq": 2, "gptq": 3, "bpdq": 9}
        for r in sorted(rows, key=lambda r: (r["w_bits"] is not None, -(r["w_bits"] or 0),
                                             -(r["group_size"] or 0) % 10**6, order.get(r["label"], 5), r["label"])):
            g = "" if r["group_size"] is None else ("per-ch" if r["group_size"] == -1 else r["group_size"])
            ref = REFERENCE_PPL.get((r["label"], r["w_bits"], r["group_size"])) if model == "smollm2-135m" else None
            qt = "" if r["quant_time_s"] is None else f"{r['quant_time_s']:.0f}"
            lines.append(f"| {r['label']} | {r['w_bits'] or 'fp32'} | {g} | {fmt_ppl(r['ppl'])} | {fmt_ppl(ref)} | "
                         f"{zeroshot_cell(r)} | {r['size_mb']:.1f} | {r['bits_per_weight']:.3f} | {qt} | "
                         f"{r['peak_rss_mb']:.0f} |")
        lines += ["", "Perplexity by method and grid (the same records):", ""] + grid_summary(rows) + [""]
        if any(r.get("zeroshot") for r in rows):
            lines += ["Zero-shot average accuracy (%) by method and grid, items per task as in the long table:", "",
                      *grid_summary(rows, zeroshot_cell), ""]
    return "\n".join(lines)


def select_configs(suites: str, labels: str | None, grid: str | None) -> list[tuple]:
    """FP, then the configs of the comma-separated suites, narrowed to `labels` and to the `grid`'s
    bits:group pairs (run in that order); a name or pair that selects nothing is a UserError."""
    unknown = [s for s in suites.split(",") if s not in SUITES]
    if unknown:
        raise UserError(f"unknown suite(s) {', '.join(unknown)}; known: {', '.join(SUITES)}")
    configs = [c for s in suites.split(",") for c in SUITES[s]]
    if labels:
        missing = sorted(set(labels.split(",")) - {c[0] for c in configs} - {"fp"})
        if missing:
            raise UserError(f"label(s) {', '.join(missing)} not in suites {suites}; they have: "
                            f"{', '.join(dict.fromkeys(c[0] for c in configs))}")
        configs = [c for c in configs if c[0] in labels.split(",")]
    if grid:
        try:
            order = [tuple(int(v) for v in pair.split(":")) for pair in grid.split(",")]
        except ValueError:
            raise UserError(f"--grid takes bits:group pairs such as 3:128,2:64, got {grid!r}") from None
        offered = {(c[2], c[3]) for c in configs}
        if any(len(pair) != 2 or pair not in offered for pair in order):
            raise UserError(f"--grid {grid} asks for pairs these configs do not have; they have: "
                            f"{', '.join(f'{b}:{g}' for b, g in sorted(offered, reverse=True))}")
        configs = sorted((c for c in configs if (c[2], c[3]) in order), key=lambda c: order.index((c[2], c[3])))
    return [("fp", "fp", None, None, {}), *configs]


def main() -> None:
    p = parser(__doc__, model="smollm2-135m")
    p.add_argument("--suites", default="main,reference,improvements", help=f"comma-separated: {', '.join(SUITES)}")
    p.add_argument("--labels", default=None, help="only these config labels, e.g. rtn,gptq")
    p.add_argument("--grid", default=None, help="only these bits:group pairs, in this order, e.g. 3:128,2:64")
    p.add_argument("--save-dir", type=Path, default=None,
                   help="also save each quantized model under SAVE_DIR (see saved_name) for other benches")
    p.add_argument("--render-only", action="store_true", help="only rewrite accuracy.md from accuracy.json")
    p.add_argument("--calib-dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="precision of calibration's matrix products (bitquilt quantize --calib-dtype)")
    p.add_argument("--zeroshot-limit", type=int, default=0,
                   help="also score the zero-shot tasks on this many items each (bitquilt.eval.zeroshot; 0: off)")
    p.add_argument("--eval-dtype", default="fp32", choices=EVAL_DTYPES,
                   help="precision of evaluation's matrix products (bitquilt eval --eval-dtype); records measured in "
                   "bf16 are kept apart from fp32 ones")
    p.add_argument("--resume-dir", type=Path, default=None,
                   help="keep each run's state after every block under RESUME_DIR, so a killed run carries on")
    args, calib, settings, bench = ppl_bench(p, "accuracy", KEY, render, calib_samples=64, ppl_windows=40)
    if args.render_only:
        bench.rerender()
        return
    precision = eval_precision(args.eval_dtype)
    if precision != "fp32":
        settings["eval_precision"] = precision

    ids = None
    for label, method, bits, group, options in select_configs(args.suites, args.labels, args.grid):
        wanted = {"model": args.model, "label": label, "w_bits": bits, "group_size": group, "settings": settings}
        stored = bench.stored(wanted)
        lacks_zeroshot = args.zeroshot_limit and stored is not None and not stored.get("zeroshot")
        if not bench.todo(wanted) and not lacks_zeroshot:
            continue  # measure what is missing, or (--recheck) again what is stored
        model, tokenizer = load(args.model)  # one model in memory at a time: two 1.5B jobs must fit in RAM
        quant_time = quant_cpu = compute = resume = None
        reset_peak_rss()
        if method != "fp":
            recipe = (Recipe.reconstruction(bits, group, **copy.deepcopy(options)) if method == "recon"
                      else Recipe(method, w_bits=bits, group_size=group, options=options))
            if ids is None and recipe.needs_calibration:
                ids = calibration_ids(tokenizer, calib)
            resume = args.resume_dir / saved_name(args.model, label, bits, group) if args.resume_dir else None
            t0, c0 = time.perf_counter(), time.process_time()
            report = quantize(model, recipe, ids if recipe.needs_calibration else None, progress=True,
                              calib_dtype=args.calib_dtype, resume_dir=resume)
            quant_time, quant_cpu = time.perf_counter() - t0, time.process_time() - c0
            compute = report.compute
        ppl = perplexity(model, tokenizer, args.ppl_data, args.seqlen, args.ppl_windows, progress=False,
                         precision=precision)
        zeroshot = None
        if args.zeroshot_limit:
            scores = evaluate_tasks(model, tokenizer, list(TASK_NAMES), limit=args.zeroshot_limit, progress=False,
                                    precision=precision)
            zeroshot = {"limit": args.zeroshot_limit, "tasks": scores, "average": average_accuracy(scores)}
        record = {"model": args.model, "label": label, "method": method, "w_bits": bits, "group_size": group,
                  "options": options, "ppl": ppl.ppl, "ppl_seconds": ppl.seconds, **model_summary(model),
                  "quant_time_s": quant_time, "quant_cpu_s": quant_cpu, "compute": compute, "zeroshot": zeroshot,
                  "peak_rss_mb": peak_rss_mb(),
                  "settings": settings, **stamp()}
        print(f"{label:24s} w{bits} g{group}: ppl {ppl.ppl:.2f}  {record['size_mb']:.1f} MB  "
              f"{record['bits_per_weight']:.3f} bpw  {quant_time or 0:.0f} s", flush=True)
        if args.save_dir and method != "fp":
            save(model, args.save_dir / saved_name(args.model, label, bits, group), tokenizer, overwrite=True)
        bench.store(record)
        if resume is not None:
            shutil.rmtree(resume, ignore_errors=True)
        del model


if __name__ == "__main__":
    run(main)
