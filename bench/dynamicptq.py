"""DynamicPTQ benchmark: W4A4KV4 backbones alone and with 8-bit activations in K chosen layers.

    python bench/dynamicptq.py --model smollm2-135m --threads 1

Per backbone (quarot+rtn, quarot+gptq, smoothquant+rtn): alone, and with K = 2, 4, 6 layers chosen by
the Jump Ratio (the default policy); at K = 4 also chosen by the historical SNR, at random, and as
"ends" (the first three layers + the last, the paper's hand-picked pattern). Perplexity and, with
--tasks, zero-shot accuracy (a fixed subset of --limit items per task). The cost of the A8 layers is
the extra activation bytes per token their linears read (8 instead of 4 bits). Results:
bench/results/dynamicptq.{json,md} and the phase plot of each model.
"""

from __future__ import annotations

import time

from common import GPTQ_PLAIN, RESULTS, doc_protocol, fmt_ppl, parser, pivot, ppl_bench, run, sections, stamp

from bitquilt.api import calibration_ids, load, model_summary, quantize
from bitquilt.eval import perplexity
from bitquilt.eval.zeroshot import average_accuracy, evaluate_tasks
from bitquilt.recipes import Recipe

BACKBONES = ("quarot+rtn", "quarot+gptq", "smoothquant+rtn")
KEY = ("model", "backbone", "layers", "select")


def a8_bytes_per_token(model, layers: list[int]) -> int:
    """Extra activation bytes per token the linears of `layers` read at 8 instead of 4 bits (one input
    per shared input: q/k/v, o, gate/up and down each read one vector)."""
    from bitquilt.models.adapters import architecture_of, decoder_layers

    arch = architecture_of(model)
    blocks = decoder_layers(model, arch)
    return sum(blocks[i].get_submodule(g.linears[0]).in_features // 2 for i in layers for g in arch.shared_inputs)


def column(r: dict) -> str:
    if not r["layers"]:
        return "alone"
    return f"K={r['layers']} {r['select']}"


def render(records: list[dict]) -> str:
    lines = ["# DynamicPTQ benchmark", "", doc_protocol(__doc__), "",
             "W4A4KV4: 4-bit weights (groups of 128, asymmetric; GPTQ without act-order), per-token asymmetric "
             "4-bit activations with searched clipping, 4-bit keys (centred) and values per head.", ""]
    for model, _settings, rows, header in sections(records):
        lines += header
        cols = list(dict.fromkeys(column(r) for r in sorted(rows, key=lambda r: (r["layers"], r["select"] != "jr"))))
        backbones = list(dict.fromkeys(r["backbone"] for r in rows))
        ppl = {(r["backbone"], column(r)): fmt_ppl(r["ppl"]) for r in rows}
        lines += ["Perplexity:", ""] + pivot("backbone", backbones, cols, ppl) + [""]
        scored = [r for r in rows if r.get("zeroshot_avg")]
        acc = {(r["backbone"], column(r)): f"{100 * r['zeroshot_avg']:.1f}" for r in scored}
        if acc:
            lines += [f"Zero-shot average accuracy (%, {scored[0]['tasks']}, {scored[0]['limit']} items per task):",
                      ""]
            lines += pivot("backbone", backbones, cols, acc) + [""]
        lines += ["Layers given 8-bit activations (the policy measures after the backbone's model transform):", ""]
        for c in dict.fromkeys(column(r) for r in rows if r["layers"]):
            picks = [f"`{r['backbone']}` {r['chosen']}" for r in rows if column(r) == c]
            lines.append(f"- {c}: " + ", ".join(picks))
        cost = {column(r): r["a8_bytes_per_token"] for r in rows if r["layers"]}
        lines += ["", "Extra activation bytes per token: " + ", ".join(f"{c}: {b:,}" for c, b in cost.items()) + ".",
                  "", f"![phases](dynamicptq_{model}.png)", ""]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, model="smollm2-135m")
    p.add_argument("--backbones", default=",".join(BACKBONES))
    p.add_argument("--ks", default="2,4,6", help="layer counts chosen by the Jump Ratio (rows by the Jump Ratio "
                   "at --compare-k run only when it is listed here)")
    p.add_argument("--compare-k", type=int, default=4, help="K at which the other --selects are compared too")
    p.add_argument("--selects", default="snr,random,ends",
                   help="selections compared with the Jump Ratio at --compare-k")
    p.add_argument("--tasks", default="", help="zero-shot tasks, e.g. piqa,arc_easy,hellaswag (default: none); a row "
                   "measured without them is measured again with them")
    p.add_argument("--limit", type=int, default=200, help="zero-shot items per task")
    p.add_argument("--tasks-rows", choices=("all", "headline"), default="all",
                   help="rows scored on --tasks: every row, or only each backbone alone and at --compare-k by the "
                   "Jump Ratio (zero-shot costs more than the quantization on the larger models)")
    args, calib, settings, bench = ppl_bench(p, "dynamicptq", KEY, render, calib_samples=32, ppl_windows=20)
    backbones = args.backbones.split(",")
    ks = [int(k) for k in args.ks.split(",") if k]
    # most telling first (the run resumes where it stopped): each backbone alone and at --compare-k, the
    # selections on the first backbone, then the other K, then the selections on the other backbones
    configs = [(b, k, "jr") for b in backbones for k in (0, args.compare_k) if k == 0 or k in ks]
    selects = [s for s in args.selects.split(",") if s]
    configs += [(backbones[0], args.compare_k, s) for s in selects]
    configs += [(b, k, "jr") for b in backbones for k in ks if k != args.compare_k]
    configs += [(b, args.compare_k, s) for b in backbones[1:] for s in selects]
    ids = None
    for backbone, k, select in configs:
        wanted = {"model": args.model, "backbone": backbone, "layers": k, "select": select, "settings": settings}
        stored = bench.stored(wanted)
        tasks = args.tasks if args.tasks_rows == "all" or (k in (0, args.compare_k) and select == "jr") else ""
        done = stored is not None and (not tasks or (stored.get("tasks"), stored.get("limit")) == (tasks, args.limit))
        if done != args.recheck:
            continue
        model, tokenizer = load(args.model)
        ids = calibration_ids(tokenizer, calib) if ids is None else ids
        recipe = Recipe(backbone, w_bits=4, group_size=128, a_bits=4, kv_bits=4, a_clip=None, a8_layers=k,
                        options=GPTQ_PLAIN if backbone.endswith("gptq") else {},
                        stage_options={"dynamic_a8": {"select": select}} if k else {})
        t0 = time.perf_counter()
        report = quantize(model, recipe, ids, progress=False)
        quant_time = time.perf_counter() - t0
        decision = report.plan["decisions"].get("dynamic_a8", {})
        if decision and not (RESULTS / f"dynamicptq_{args.model}.png").exists():
            from bitquilt.calib.residual import LayerPhase
            from bitquilt.eval.phases import plot_phases

            phases = [LayerPhase(**{**d, "snr_db": {int(b): v for b, v in d["snr_db"].items()}})
                      for d in decision["phases"]]
            plot_phases(phases, RESULTS / f"dynamicptq_{args.model}.png", f"{args.model} after {backbone}'s "
                        "transform")
        ppl = perplexity(model, tokenizer, args.ppl_data, args.seqlen, args.ppl_windows, progress=False)
        record = {**wanted, "tasks": tasks, "limit": args.limit if tasks else None, "ppl": ppl.ppl,
                  "chosen": decision.get("layers", []),
                  "a8_bytes_per_token": a8_bytes_per_token(model, decision.get("layers", [])),
                  **model_summary(model), "quant_time_s": quant_time, **stamp()}
        if tasks:
            scores = evaluate_tasks(model, tokenizer, tasks.split(","), limit=args.limit, progress=False,
                                    cache_key=f"dynamicptq|{backbone}|{k}|{select}|{calib}")
            record["zeroshot"], record["zeroshot_avg"] = scores, average_accuracy(scores)
        print(f"{backbone:16s} K={k} {select:6s} {record['chosen']} ppl {ppl.ppl:9.2f} quant {quant_time:5.0f} s",
              flush=True)
        bench.store(record)
        del model


if __name__ == "__main__":
    run(main)
