"""The function-preservation check of transforms (`bitquilt.calib.preserve`): what it measures, and what it costs.

    python bench/preservation.py --models smollm2-135m --recipes quarot+rtn,awq,smoothquant+rtn-a8,mxsens
    python bench/preservation.py --models /path/to/gemma-3-270m --recipes quarot+rtn --unrefused

Per model, recipe and calibration precision (fp32, bf16), the worst relative error the check measured for each
transform stage, against `TOLERANCE`; and the run's wall seconds with the check and, with --overhead, without it (the
check functions replaced by the bare stage calls). `--unrefused` lets a transform run on a family it is refused on
(`bitquilt.calib.stages.Stage.refuses`), to measure what the check sees there. Results:
bench/results/preservation.{json,md}.
"""

from __future__ import annotations

import json
import time

import torch
from common import RESULTS, finish, parser, run, run_facts, run_header, write_atomic

RECIPES = {
    "quarot+rtn": dict(method="quarot+rtn", w_bits=8),
    "quarot+gptq-w4a4kv4": dict(method="quarot+gptq", w_bits=4, a_bits=4, kv_bits=4),
    "awq": dict(method="awq", w_bits=4),
    "smoothquant+rtn-a8": dict(method="smoothquant+rtn", w_bits=8, a_bits=8),
    "mxsens": dict(method="mxsens", stage_options={"mx_sens": {"target_bits": 4.5}}),
}


def worst_errors(report) -> dict[str, float]:
    """{transform stage: the worst preservation error it recorded}."""
    worst = {}
    for name, record in report.stages.items():
        values = [record["preservation_error"]] if "preservation_error" in record else [
            r["preservation_error"] for r in record.values() if isinstance(r, dict) and "preservation_error" in r]
        if values:
            worst[name] = max(values)
    return worst


def unchecked(engine) -> None:
    """Replace the engine's checked stage calls by the bare ones (the run without the check)."""
    engine.checked_model_stage = lambda stage, ctx, options: stage.fn(ctx, options)
    engine.checked_block_stage = lambda stage, ctx, options, *_window: stage.fn(ctx, options)


def one_run(model_name: str, recipe_name: str, precision: str, samples: int, seqlen: int, check: bool) -> dict:
    import bitquilt.calib.preserve as preserve
    import bitquilt.pipeline.engine as engine
    from bitquilt.api import calibration_ids, load, quantize
    from bitquilt.recipes import CalibConfig, Recipe

    saved = engine.checked_model_stage, engine.checked_block_stage
    if not check:
        unchecked(engine)
    try:
        model, tokenizer = load(model_name)
        recipe = Recipe(**RECIPES[recipe_name])
        ids = calibration_ids(tokenizer, CalibConfig(n_samples=samples, seqlen=seqlen)) if recipe.needs_calibration \
            else None
        t0 = time.perf_counter()
        report = quantize(model, recipe, ids, progress=False, calib_dtype=precision)
        seconds = time.perf_counter() - t0
    finally:
        engine.checked_model_stage, engine.checked_block_stage = saved
    return {"model": model_name, "recipe": recipe_name, "precision": precision, "check": check,
            "seconds": round(seconds, 2), "errors": worst_errors(report), "tolerance": preserve.TOLERANCE}


def main() -> None:
    p = parser(__doc__, models="smollm2-135m", threads=1)
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {', '.join(RECIPES)}")
    p.add_argument("--precisions", default="fp32,bf16", help="calibration precisions (--calib-dtype)")
    p.add_argument("--samples", type=int, default=16, help="calibration windows")
    p.add_argument("--seqlen", type=int, default=512, help="calibration window length")
    p.add_argument("--overhead", action="store_true", help="also run each recipe without the check (fp32)")
    p.add_argument("--unrefused", action="store_true", help="run transforms refused on the family anyway")
    p.add_argument("--out", default="preservation", help="results file stem under bench/results")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.unrefused:
        from bitquilt.recipes import Recipe

        for name in args.recipes.split(","):
            for stage, _options in Recipe(**RECIPES[name]).stages():
                object.__setattr__(stage, "refuses", None)  # a frozen Stage: this run only
    facts, rows = run_facts(), []
    for model_name in args.models.split(","):
        for recipe_name in args.recipes.split(","):
            for precision in args.precisions.split(","):
                rows.append(one_run(model_name, recipe_name, precision, args.samples, args.seqlen, True))
                print(json.dumps(rows[-1]), flush=True)
            if args.overhead:
                rows.append(one_run(model_name, recipe_name, "fp32", args.samples, args.seqlen, False))
                print(json.dumps(rows[-1]), flush=True)
    facts = finish(facts)
    write_atomic(RESULTS / f"{args.out}.json", json.dumps({**facts, "rows": rows}, indent=2) + "\n")
    lines = ["# Function-preservation check", "", run_header(facts), "",
             "| model | recipe | calibration | check | seconds | worst relative error per transform |",
             "|---|---|---|---|---:|---|"]
    for r in rows:
        errors = ", ".join(f"{k} {v:.2e}" for k, v in r["errors"].items()) or "(not checked)"
        lines.append(f"| {r['model']} | {r['recipe']} | {r['precision']} | {'on' if r['check'] else 'off'} | "
                     f"{r['seconds']} | {errors} |")
    write_atomic(RESULTS / f"{args.out}.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    run(main)
