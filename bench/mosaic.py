"""MosaicQuant benchmark: how much output distortion a sparse 4-bit residual recovers, what it does to W4A4KV4
perplexity on each backbone, what it costs in memory and in kernel time.

Parts (--parts, default all):

  recovery  on the linears of every --probe-every-th decoder block, after the QuaRot rotation and as they are
            (--rotations; calibration statistics of the full-precision model), the recovered fraction of the true output
            distortion, 1 − Σ tr(D H Dᵀ)/Σ tr(E H Eᵀ) pooled over the probed linears (E: the dense base's error, D:
            what base + residual leave), at budgets --curve-budgets, per tile ranking: Δ-score, magnitude,
            random, and the exact greedy (RTN base). Two bases: RTN (the residual fitted to its error) and GPTQ
            (the joint sweep, `bitquilt.solvers.mosaic.gptq_mosaic`, against plain GPTQ). Then the Δ-score's
            recovery per tile shape (--shapes) against the bits per weight each costs: the default shape is
            chosen from this.
  ppl       W4A4KV4 (or --precision W4A16) perplexity of each --backbones recipe (the protocol of bench/w4a4.py:
            4-bit weights g128, per-token 4-bit activations with searched clipping, 4-bit KV cache with centred
            keys; GPTQ without act-order) with a residual at each --budgets (0: the backbone alone), its
            bits/weight, the mean recovered distortion of its linears and the quantization time.
  latency   `bench/mosaic_kernels.py` on the model's linear shapes: dense base, two-kernel, fused.
  decode    whole-model batch-1 speed (`bitquilt.eval.speed`, the default engine: the fused decode step runs the base's
            tables with the residual added inside) of W4 g128 RTN weights with an 8-bit head, alone and with a
            residual at each --budgets (tiles ranked by magnitude: speed depends on how many, not which), the models
            measured in turn --repeats times; the end-to-end cost next to the paper's (< 6.2% at 10%).

    python bench/mosaic.py --model smollm2-135m --threads 1
    python bench/mosaic.py --model qwen2.5-0.5b --threads 1 --parts ppl --backbones quarot+gptq --budgets 0,0.1

Results: bench/results/mosaic.{json,md} and mosaic_<model>_<rotation>.png (recovery curves); a record already measured
with the same settings is skipped, so an interrupted run resumes.
"""

from __future__ import annotations

import statistics
import time

import torch
from common import (
    GPTQ_PLAIN,
    RESULTS,
    Bench,
    fmt_ppl,
    intro,
    load_records,
    loadavg,
    parser,
    ppl_bench,
    run,
    sections,
    stamp,
)
from matplotlib.figure import Figure
from mosaic_kernels import kernel_latency, latency_table

from bitquilt.api import calibration_ids, load, model_summary, quantize
from bitquilt.cache import write_figure
from bitquilt.calib.capture import capture_block_inputs, collect_stats, run_block
from bitquilt.calib.plan import Plan
from bitquilt.calib.stages import STAGES, ModelContext
from bitquilt.eval import perplexity
from bitquilt.eval.speed import measure_speed
from bitquilt.models.adapters import architecture_of, decoder_layers
from bitquilt.recipes import Recipe
from bitquilt.resources import peak_rss_mb, reset_peak_rss
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec, hessian_error
from bitquilt.solvers.mosaic import MosaicOptions, Residual, gptq_mosaic, ranking, tile_count

KEY = ("model", "part", "config")  # + settings
PRECISIONS = {"W4A4KV4": (4, 4), "W4A16": (16, 16)}  # (a_bits, kv_bits), bench/w4a4.py's protocol
PARTS = ("recovery", "ppl", "latency", "decode")
SCORES_RTN = ("delta", "exact", "greedy", "magnitude", "random")
SCORES_GPTQ = ("delta", "exact", "magnitude", "random")
SPEC = LayerSpec(4, 128)


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def probe_layers(model, ids, every: int, rotation: str) -> list[tuple[str, torch.Tensor, object]]:
    """(name, weight, statistics) of every linear of blocks 0, every, 2·every, ... of `model` after `rotation`
    ("quarot", in place, or "none"), statistics from the full-precision model on `ids`."""
    arch = architecture_of(model)
    if rotation == "quarot":
        stage = STAGES.get("quarot")
        stage.fn(ModelContext(model, arch, Plan({}, {}), None), stage.make_options())
    inputs, kwargs = capture_block_inputs(model, arch, ids)
    names = list(arch.linear_names())
    out = []
    with torch.no_grad():
        for i, block in enumerate(decoder_layers(model, arch)):
            if i % every == 0:
                stats = collect_stats(block, names, inputs, kwargs[i])
                out += [(f"{i}.{n}", block.get_submodule(n).weight.detach().float().clone(), stats[n]) for n in names]
            inputs = run_block(block, inputs, kwargs[i])
    return out


def pooled(before: list[float], after: list[float]) -> float:
    return 1.0 - sum(after) / sum(before)


def rtn_curves(layers, budgets: list[float], block=(1, 32), scores=SCORES_RTN) -> dict[str, list[float]]:
    """Pooled recovered fraction per score and budget, the residual fitted to RTN's error."""
    rtn = get_solver("rtn")
    before, after = [], {s: [[] for _ in budgets] for s in scores}
    for _, w, stats in layers:
        res = Residual.of(w, rtn(w, None, SPEC).dequantize(), block)
        before.append(hessian_error(res.error, None, stats.hessian))
        for s in scores:
            order = ranking(res, s, stats, tile_count(max(budgets), res.n_tiles))
            for k, rho in enumerate(budgets):
                after[s][k].append(hessian_error(res.error, res.dense(order[:tile_count(rho, res.n_tiles)]),
                                                 stats.hessian))
    return {s: [pooled(before, a) for a in after[s]] for s in scores}


def gptq_curves(layers, budgets: list[float], block=(1, 32), scores=SCORES_GPTQ) -> dict[str, list[float]]:
    """Pooled recovered fraction per score and budget of the joint GPTQ + residual sweep, against plain GPTQ."""
    gptq = get_solver("gptq")
    opts = gptq.make_options(GPTQ_PLAIN)
    before, after = [], {s: [[] for _ in budgets] for s in scores}
    for _, w, stats in layers:
        before.append(hessian_error(w, gptq(w, stats, SPEC, opts).dequantize(), stats.hessian))
        for s in scores:
            for k, rho in enumerate(budgets):
                fmt = gptq_mosaic(w, stats, SPEC, opts, MosaicOptions(budget=rho, block=block, score=s))
                after[s][k].append(hessian_error(w, fmt.dequantize(), stats.hessian))
    return {s: [pooled(before, a) for a in after[s]] for s in scores}


def overhead_bits(block: tuple[int, int], budget: float) -> float:
    """Bits per weight a residual of `budget` of the tiles adds: 4-bit codes, int32 id and fp16 scale per tile."""
    return budget * (4 + 48 / (block[0] * block[1]))


def recovery_part(args, calib, rotation: str) -> list[dict]:
    model, tokenizer = load(args.model)
    ids = calibration_ids(tokenizer, calib)
    t0 = time.perf_counter()
    layers = probe_layers(model, ids, args.probe_every, rotation)
    del model
    budgets = args.curve_budgets
    records = []
    for base, fn in (("rtn", rtn_curves), ("gptq", gptq_curves)):
        t = time.perf_counter()
        curves = fn(layers, budgets)
        records.append({"part": "recovery", "config": f"scores {base} {rotation}", "base": base, "budgets": budgets,
                        "curves": curves, "seconds": time.perf_counter() - t})
        print(f"recovery {base}: " + "; ".join(f"{s} {[round(v, 3) for v in c]}" for s, c in curves.items()),
              flush=True)
    for base, fn in (("rtn", rtn_curves), ("gptq", gptq_curves)):
        shapes = {}
        for shape in args.shapes:
            shapes["x".join(map(str, shape))] = fn(layers, budgets, shape, ("delta",))["delta"]
        records.append({"part": "recovery", "config": f"shapes {base} {rotation}", "base": base, "budgets": budgets,
                        "shapes": shapes,
                        "overhead_bits": {k: [overhead_bits(s, b) for b in budgets] for k, s in
                                          zip(shapes, args.shapes)}})
        print(f"shapes {base}: {shapes}", flush=True)
    probed = sorted({name.split(".")[0] for name, _, _ in layers}, key=int)
    for r in records:
        r.update(rotation=rotation, probed_blocks=probed, probed_linears=len(layers),
                 probe_seconds=time.perf_counter() - t0)
    return records


def ppl_part(args, calib, settings, bench: Bench) -> None:
    precision = args.precision
    a_bits, kv_bits = PRECISIONS[precision]
    for backbone in args.backbones:
        for budget in args.budgets:
            config = f"{backbone} +{budget:g}" if precision == "W4A4KV4" else f"{backbone} {precision} +{budget:g}"
            wanted = {"model": args.model, "part": "ppl", "config": config, "settings": settings}
            if not bench.todo(wanted):
                continue
            if budget == 0 and (stored := backbone_record(args.model, backbone, precision, settings)) is not None:
                bench.store({**wanted, "backbone": backbone, "budget": 0.0, "precision": precision, **stored})
                continue
            model, tokenizer = load(args.model)
            ids = calibration_ids(tokenizer, calib)
            residual = {"residual": "mosaic", "residual_options": {"budget": budget}} if budget > 0 else {}
            recipe = Recipe(backbone, w_bits=4, group_size=128, options=GPTQ_PLAIN if backbone.endswith("gptq") else {},
                            a_bits=a_bits, kv_bits=kv_bits, a_clip=None if a_bits < 16 else 1.0, **residual)
            reset_peak_rss()
            t0, c0 = time.perf_counter(), time.process_time()
            report = quantize(model, recipe, ids, progress=False)
            quant = (time.perf_counter() - t0, time.process_time() - c0)
            ppl = perplexity(model, tokenizer, args.ppl_data, args.seqlen, args.ppl_windows, progress=False)
            rec = [1 - r.rel_error / r.base_rel_error for r in report.linears if r.base_rel_error]
            weights = sum(8 * r.nbytes / r.bits_per_weight for r in report.linears)
            record = {**wanted, "backbone": backbone, "budget": budget, "precision": precision,
                      "recipe": recipe.to_dict(), "ppl": ppl.ppl,
                      "linear_bits_per_weight": 8 * sum(r.nbytes for r in report.linears) / weights,
                      "mean_recovered": sum(rec) / len(rec) if rec else None, **model_summary(model),
                      "quant_time_s": quant[0], "quant_cpu_s": quant[1], "peak_rss_mb": peak_rss_mb(),
                      "load": loadavg(), **stamp()}
            print(f"{config:28s} ppl {ppl.ppl:9.2f}  bits {record['linear_bits_per_weight']:.3f}  quant "
                  f"{quant[0]:5.0f} s", flush=True)
            bench.store(record)
            del model


def decode_part(args, settings, bench: Bench) -> None:
    """Batch-1 prefill and decode speed of W4 + 8-bit head, alone (budget 0) and with a residual at each budget."""
    budgets = sorted(set(args.budgets) | {0.0})
    models = {}
    for budget in budgets:
        model, _ = load(args.model)
        options = {"budget": budget, "score": "magnitude"}
        residual = {"residual": "mosaic", "residual_options": options} if budget else {}
        quantize(model, Recipe("rtn", w_bits=4, group_size=128, head_bits=8, **residual), None, progress=False)
        models[budget] = model
    runs: dict[float, list] = {b: [] for b in budgets}
    for _ in range(args.repeats):  # in turn, so every model sees the same load
        for budget, model in models.items():
            runs[budget].append(measure_speed(model, model.config.vocab_size, repeats=1))
    rows = []
    for budget, model in models.items():
        summary = model_summary(model)
        rows.append({"budget": budget, "bits_per_weight": summary["bits_per_weight"],
                     "layout_mb": runs[budget][0].kernel_layout_mb,
                     "prefill_tokens_per_s": statistics.median(r.prefill_tokens_per_s for r in runs[budget]),
                     "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in runs[budget])})
    for r in rows:
        r["decode_over_dense"] = rows[0]["decode_tokens_per_s"] / r["decode_tokens_per_s"]
        print(f"budget {r['budget']:g}: decode {r['decode_tokens_per_s']:.2f} tok/s ({r['decode_over_dense']:.3f}x "
              f"the dense step's time), prefill {r['prefill_tokens_per_s']:.1f} tok/s", flush=True)
    bench.store({"model": args.model, "part": "decode", "config": f"threads {torch.get_num_threads()}",
                 "rows": rows, "threads": torch.get_num_threads(), "repeats": args.repeats, "load": loadavg(),
                 "settings": settings, **stamp()})


def decode_table(r: dict) -> list[str]:
    lines = ["### Whole-model decode: W4 + 8-bit head, alone and with the residual", "",
             f"{r['threads']} thread(s), load average {r['load']} at the end; batch 1, 128-token random prompt, 32 new "
             f"tokens, the default engine (fused decode step); medians of {r['repeats']} runs taken in turn. "
             "*step time × dense*: the dense model's decode rate over this one's.", "",
             "| residual budget | bits/weight | kernel layouts MB | prefill tok/s | decode tok/s | step time × dense |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        budget = f"{100 * row['budget']:g}%" if row["budget"] else "none"
        lines.append(f"| {budget} | {row['bits_per_weight']:.3f} | {row['layout_mb']:.1f} | "
                     f"{row['prefill_tokens_per_s']:.1f} | {row['decode_tokens_per_s']:.2f} | "
                     f"{row['decode_over_dense']:.3f} |")
    return lines + [""]


def backbone_record(model: str, backbone: str, precision: str, settings: dict) -> dict | None:
    """The measurement of `backbone` alone at `precision` that bench/w4a4.py stored with the same settings and recipe
    (the residual-free row of this benchmark; perplexity is deterministic, so it is not measured twice)."""
    for r in load_records("w4a4"):
        if (r["model"], r["precision"], r["method"], r["kv_center"] or False, r["settings"]) == (
                model, precision, backbone, kv_bits_of(precision) < 16, settings):
            return {"recipe": r["recipe"], "ppl": r["ppl"], "linear_bits_per_weight": r["bits_per_weight"],
                    "mean_recovered": None, "quant_time_s": r["quant_time_s"], "quant_cpu_s": None,
                    "machine": r["machine"], "command": r["command"], "load": None, "from": "bench/w4a4.py"}
    return None


def kv_bits_of(precision: str) -> int:
    return PRECISIONS[precision][1]


def linear_shapes(model_name: str) -> list[tuple[int, int]]:
    model, _ = load(model_name)
    arch = architecture_of(model)
    block = decoder_layers(model, arch)[0]
    return list(dict.fromkeys((block.get_submodule(n).out_features, block.get_submodule(n).in_features)
                              for n in arch.linear_names()))


def plot(records: list[dict], model: str, rotation: str) -> None:
    records = [r for r in records if r.get("rotation") == rotation]
    scores = {r["base"]: r for r in records if r["config"].startswith("scores")}
    shapes = {r["base"]: r for r in records if r["config"].startswith("shapes")}
    if not scores:
        return
    fig = Figure(figsize=(12, 3.8))
    axes = fig.subplots(1, 3)
    for ax, base, title in zip(axes, ("rtn", "gptq"), ("RTN base (residual fitted to its error)",
                                                     "GPTQ base (joint sweep, vs plain GPTQ)")):
        if base not in scores:
            continue
        r = scores[base]
        for s, c in r["curves"].items():
            ax.plot([100 * b for b in r["budgets"]], c, "o-", label=s)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("residual budget ρ (% of 1×32 tiles)")
        ax.set_ylabel("recovered fraction of ‖(W − B)X‖²")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    for base, style in (("rtn", "-"), ("gptq", "--")):
        if base in shapes:
            r = shapes[base]
            for name, c in r["shapes"].items():
                ax.plot(r["overhead_bits"][name], c, "o" + style, label=f"{name} ({base})")
    ax.set_title("Δ-score per tile shape", fontsize=9)
    ax.set_xlabel("residual bits per weight")
    ax.set_ylabel("recovered fraction")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"MosaicQuant residual recovery, {model} ({'QuaRot-rotated' if rotation == 'quarot' else 'unrotated'} "
                 "linears)", fontsize=10)
    fig.tight_layout()
    write_figure(fig, RESULTS / f"mosaic_{model}_{rotation}.png")


def ppl_table(ppl: list[dict], precision: str) -> list[str]:
    """Markdown: per backbone, its perplexity alone and with the residual at each budget."""
    if not ppl:
        return []
    lines: list[str] = []
    budgets = sorted({r["budget"] for r in ppl})
    lines += [f"### {precision} perplexity with the residual", "",
              "Each cell: perplexity · bits/weight of the linears · mean recovered distortion of the linears "
              "· quantization time (wall).", "",
              "| backbone | " + " | ".join("backbone alone" if b == 0 else f"+ Mosaic {100 * b:g}%"
                                            for b in budgets) + " |",
              "|---|" + "---|" * len(budgets)]
    for backbone in dict.fromkeys(r["backbone"] for r in ppl):
        cells = []
        for b in budgets:
            r = next((x for x in ppl if x["backbone"] == backbone and x["budget"] == b), None)
            cells.append("" if r is None else
                         f"{fmt_ppl(r['ppl'])} · {r['linear_bits_per_weight']:.3f} b"
                         + (f" · {r['mean_recovered']:.2f}" if r["mean_recovered"] is not None else "")
                         + f" · {r['quant_time_s']:.0f} s")
        lines.append(f"| {backbone} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


ABOUT = """\
Generated by `bench/mosaic.py`. A MosaicQuant linear is a dense 4-bit base (g128, asymmetric) plus a sparse residual
of 4-bit tiles (one fp16 scale and an int32 id per tile) chosen by the Hessian Δ-score; `bitquilt/solvers/mosaic.py`
states the method. Recovered fraction: 1 − tr(D H Dᵀ)/tr(E H Eᵀ) on calibration inputs, E the base's error, D what
base + residual leave (pooled over the probed linears: sums of each).
"""


def render(records: list[dict]) -> str:
    lines = intro("MosaicQuant benchmark", ABOUT)
    for _model, _settings, rows, header in sections(records):
        lines += header
        rec = [r for r in rows if r["part"] == "recovery"]
        for r in rec:
            header = f"| {'ranking' if 'curves' in r else 'tile shape'} | " + " | ".join(
                f"{100 * b:g}%" for b in r["budgets"]) + " |"
            what = ("Δ-score per tile shape" if "shapes" in r else "per ranking")
            base = ("RTN base, residual fitted to its error" if r["base"] == "rtn"
                    else "GPTQ base, joint sweep, against plain GPTQ")
            rotated = "QuaRot-rotated" if r.get("rotation", "quarot") == "quarot" else "unrotated"
            lines += [f"### Recovered distortion {what}: {base}; {rotated} linears (blocks "
                      f"{', '.join(r['probed_blocks'])}: {r['probed_linears']} linears)", "", header,
                      "|---|" + "---:|" * len(r["budgets"])]
            table = r.get("curves") or r["shapes"]
            for name, c in table.items():
                extra = (" (+" + ", ".join(f"{b:.2f}" for b in r["overhead_bits"][name]) + " bits/weight)"
                         if "overhead_bits" in r else "")
                lines.append(f"| {name}{extra} | " + " | ".join(f"{v:.3f}" for v in c) + " |")
            lines.append("")
        for precision in PRECISIONS:
            lines += ppl_table([r for r in rows if r["part"] == "ppl" and r.get("precision", "W4A4KV4") == precision],
                               precision)

        for r in [r for r in rows if r["part"] == "latency"]:
            lines += ["### Kernel latency: dense base vs base + residual, fused and two-kernel", "",
                      f"{r['threads']} thread(s), load average {r['load']}; random W4g128 layers of the model's "
                      "shapes plus 1×32 tiles at random; median wall time per call, weights cache-resident "
                      "(`bench/mosaic_kernels.py`). Cells: dense ms; fused / dense and two-kernel / dense.", ""]
            lines += latency_table(r["rows"]) + [""]
        for r in [r for r in rows if r["part"] == "decode"]:
            lines += decode_table(r)
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, model="smollm2-135m")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--backbones", default="quarot+gptq,quarot+rtn,smoothquant+rtn", type=lambda s: s.split(","))
    p.add_argument("--budgets", default="0,0.05,0.1,0.2", type=floats)
    p.add_argument("--precision", choices=list(PRECISIONS), default="W4A4KV4",
                   help="ppl: W4A4KV4 (4-bit activations and KV cache) or W4A16 (weights only)")
    p.add_argument("--curve-budgets", default="0.01,0.05,0.1,0.2", type=floats)
    p.add_argument("--shapes", default="1x32,2x32,4x32,16x32",
                   type=lambda s: [tuple(int(v) for v in x.split("x")) for x in s.split(",")])
    p.add_argument("--probe-every", type=int, default=6, help="probe the linears of every N-th block (recovery)")
    p.add_argument("--rotations", default="quarot,none", type=lambda s: s.split(","),
                   help="recovery: probe the linears after a QuaRot rotation (quarot) and/or as they are (none)")
    p.add_argument("--repeats", type=int, default=3, help="decode: runs per model, taken in turn")
    args, calib, settings, _ = ppl_bench(p, "mosaic", KEY, render, calib_samples=32, ppl_windows=20)
    bench = Bench("mosaic", KEY, render)  # every record kept: --recheck is not honoured here
    parts = args.parts.split(",")
    for rotation in args.rotations if "recovery" in parts else ():
        wanted = {"model": args.model, "part": "recovery", "config": f"scores rtn {rotation}", "settings": settings}
        if bench.todo(wanted):
            for r in recovery_part(args, calib, rotation):
                bench.store({"model": args.model, **r, "settings": settings, **stamp()})
    if "ppl" in parts:
        ppl_part(args, calib, settings, bench)
    if "latency" in parts:
        threads = torch.get_num_threads()
        rows = kernel_latency(linear_shapes(args.model), densities=(0.05, 0.1, 0.2), batches=(1, 8, 64))
        bench.store({"model": args.model, "part": "latency", "config": f"threads {threads}", "rows": rows,
                     "threads": threads, "load": loadavg(), "settings": settings, **stamp()})
    if "decode" in parts:
        decode_part(args, settings, bench)
    for rotation in args.rotations:
        plot([r for r in bench.records() if r["model"] == args.model and r["part"] == "recovery"
              and r["settings"] == settings], args.model, rotation)


if __name__ == "__main__":
    run(main)
