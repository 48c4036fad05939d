"""MXSens benchmark: perplexity against average bits for MXINT weights mixed by sensitivity, and W4A4KV4.

    python bench/mxsens.py --model smollm2-135m --threads 1

Section "weights" (activations in full precision): uniform MXINT4/6/8, and at each --targets value
MXSens (layer + column sensitivity), the 4/8-only split (middle class at 8 bits), random allocation
(random column order), uniform layers (layer sensitivity ignored) and MXSens with GPTQ error
feedback. Section "w4a4kv4": MXINT activations and KV cache with uniform MXINT4 and MXSens weights at
the smallest reachable average and at 4.27 bits, next to quarot+rtn and quarot+gptq (integer grids,
clipping searched) on the same calibration and evaluation data. Bits are element bits per weight
(the paper's accounting: the shared 8-bit exponent per 32 values, +0.25, is the same for all MXINT
rows); the stored size is reported too. Results: bench/results/mxsens.{json,md} and one plot per model.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from common import RESULTS, fmt_ppl, parser, pivot, ppl_bench, run, sections, stamp

from bitquilt.api import calibration_ids, load, model_summary, quantize
from bitquilt.eval import perplexity
from bitquilt.formats.mxint import MXIntFormat
from bitquilt.models.adapters import architecture_of
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.pipeline.engine import initial_plan
from bitquilt.policies.mx_sens import MXSensOptions, bits_range, model_shapes
from bitquilt.recipes import Recipe

KEY = ("model", "section", "config", "target_bits")
# allocation variants of the MXSens sweep: label -> mx_sens options (solver options after "|")
VARIANTS = {"mxsens": {}, "split 4/8": {"middle_bits": 8}, "random columns": {"columns": "random"},
            "uniform layers": {"layers": "uniform"}, "mxsens + error feedback": {"|error_feedback": True}}
W4A4_CONFIGS = ("mxint4", "mxsens min", "mxsens 4.27", "quarot+rtn", "quarot+gptq")


def element_bits(model: torch.nn.Module) -> float | None:
    """Mean element bits over the model's MXINT linears, weighted by their size (None: no MXINT linear)."""
    fmts = [m.fmt for m in model.modules() if isinstance(m, QuantLinear) and isinstance(m.fmt, MXIntFormat)]
    total = sum(f.out_features * f.in_features for f in fmts)
    return sum(f.element_bits() * f.out_features * f.in_features for f in fmts) / total if total else None


def recipe_for(section: str, config: str, target: float | None, sens_samples: int | None = None) -> Recipe | None:
    act = {"a_bits": 4, "kv_bits": 4} if section == "w4a4kv4" else {}
    if config == "fp":
        return None
    if config.startswith("mxint"):
        return Recipe("mxint", w_bits=int(config[5:]), **act)
    if config.startswith("quarot"):
        return Recipe(config, w_bits=4, group_size=128, a_clip=None, **act)
    variant = VARIANTS.get(config, {})
    stage = {k: v for k, v in variant.items() if not k.startswith("|")}
    solver = {k[1:]: v for k, v in variant.items() if k.startswith("|")}
    if sens_samples:
        stage["samples"] = sens_samples
    return Recipe("mxsens", options=solver, stage_options={"mx_sens": {"target_bits": target, **stage}}, **act)


def min_target(model: torch.nn.Module) -> float:
    """The smallest MXSens average of `model` (only the top 32 columns of each linear at 8 bits), rounded up."""
    arch = architecture_of(model)
    names = initial_plan(model, arch, Recipe("mxsens")).quantized()
    return float(f"{bits_range(model_shapes(model, names, 4))[0] + 5e-4:.3f}")


def render(records: list[dict]) -> str:
    lines = ["# MXSens benchmark", "", __doc__.split("\n\n", 2)[2].replace("\n", " ").strip(), "",
             "**Caveat:** the packaged FP models are dequantized 4-bit GGUFs (see docs/benchmarks.md): re-quantizing "
             "them to 4 bits is flattered where the grids happen to align.", ""]
    for model, _settings, rows, header in sections(records):
        lines += header
        fp = next((r for r in rows if r["config"] == "fp"), None)
        if fp:
            lines += [f"FP perplexity: {fmt_ppl(fp['ppl'])}.", ""]
        for section, title in (("weights", "Weights only (activations and KV cache in full precision)"),
                               ("w4a4kv4", "W4A4KV4 (MXINT rows: MXINT4 activations and KV cache)")):
            sec = sorted((r for r in rows if r["section"] == section and r["config"] != "fp"),
                         key=lambda r: (r["config"], r["element_bits"] or 0))
            if not sec:
                continue
            lines += [f"### {title}", "", "| configuration | target bits | element bits | stored bits/weight | "
                      "size MB | perplexity | quantize s |", "|---|---:|---:|---:|---:|---:|---:|"]
            for r in sec:
                target = "" if r["target_bits"] is None else f"{r['target_bits']:g}"
                bits = "" if r["element_bits"] is None else f"{r['element_bits']:.3f}"
                lines.append(f"| {r['config']} | {target} | {bits} | {r['bits_per_weight']:.3f} | "
                             f"{r['size_mb']:.1f} | {fmt_ppl(r['ppl'])} | {r['quant_time_s']:.0f} |")
            lines.append("")
        lines += sensitivity_table(rows)
        figure = plot(model, rows)
        lines += [f"![perplexity against bits]({figure.name})", ""] if figure else []
    return "\n".join(lines)


def sensitivity_table(rows: list[dict]) -> list[str]:
    """Measured layer sensitivity ŝ (normalised to mean 1) by linear and by depth (thirds of the blocks)."""
    sens = next((r["sensitivity"] for r in rows if r.get("sensitivity")), None)
    if not sens:
        return []
    mean = sum(sens.values()) / len(sens)
    depth = {n: int(n.split(".")[2]) for n in sens}
    n_blocks = max(depth.values()) + 1
    kinds = list(dict.fromkeys(n.split(".", 3)[3] for n in sens))
    thirds = ("first third", "middle third", "last third")
    cell = {}
    for kind in kinds:
        for t, label in enumerate(thirds):
            vals = [v / mean for n, v in sens.items() if n.endswith(kind) and depth[n] * 3 // n_blocks == t]
            cell[kind, label] = f"{sum(vals) / len(vals):.2f}" if vals else ""
    top = sorted(sens, key=sens.get, reverse=True)[:5]
    return (["### Layer sensitivity", "", "ŝ = ‖Y_l − Y‖² / ‖Y‖² with linear l alone at MXINT4 (final normed hidden "
             f"state, {rows[0]['settings'].get('sensitivity_samples', MXSensOptions().samples)} calibration windows), "
             "normalised to mean 1; mean by linear and depth:", ""]
            + pivot("linear", kinds, list(thirds), cell)
            + ["", "Most sensitive: " + ", ".join(f"`{n}` ({sens[n] / mean:.1f})" for n in top) + ".", ""])


def plot(model: str, rows: list[dict]) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = RESULTS / f"mxsens_{model}.png"
    weights = [r for r in rows if r["section"] == "weights"]
    if not weights:  # only W4A4KV4 rows (e.g. the big models' headline): nothing to plot
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for config in VARIANTS:
        pts = sorted((r["element_bits"], r["ppl"]) for r in weights if r["config"] == config)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=config)
    uniform = sorted((r["element_bits"], r["ppl"]) for r in weights if r["config"].startswith("mxint"))
    if uniform:
        ax.plot(*zip(*uniform), "ks--", label="uniform MXINT4/6/8")
    fp = next((r["ppl"] for r in rows if r["config"] == "fp"), None)
    if fp:
        ax.axhline(fp, color="grey", lw=0.8, label="FP")
    ax.set_xlabel("element bits per weight (+0.25 for the shared exponents)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{model}: MXINT weights, activations in full precision")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def main() -> None:
    p = parser(__doc__, model="smollm2-135m")
    p.add_argument("--targets", default="4.25,4.5,4.75,5,5.5,5.75", help="MXSens average element bits")
    p.add_argument("--variants", default=",".join(VARIANTS), help="allocation variants swept over --targets")
    p.add_argument("--sections", default="weights,w4a4kv4")
    p.add_argument("--w4a4-configs", default=",".join(W4A4_CONFIGS))
    p.add_argument("--sens-samples", type=int, default=None,
                   help="calibration windows of the layer-sensitivity pass (default: the policy's; fewer for "
                   "big models)")
    args, calib, settings, bench = ppl_bench(p, "mxsens", KEY, render, calib_samples=64, ppl_windows=40)
    if args.sens_samples:
        settings["sensitivity_samples"] = args.sens_samples
    targets = [float(t) for t in args.targets.split(",") if t]
    sections = args.sections.split(",")
    configs = [("weights", "fp", None)] if "weights" in sections else []
    if "weights" in sections:
        configs += [("weights", f"mxint{b}", None) for b in (4, 6, 8)]
        configs += [("weights", v, t) for t in targets for v in args.variants.split(",")]
    if "w4a4kv4" in sections:
        configs += [("w4a4kv4", c, None) for c in args.w4a4_configs.split(",")]
    ids, minimum = None, None
    for section, config, target in configs:
        if config == "mxsens min" or config == "mxsens 4.27":
            if minimum is None:
                minimum = min_target(load(args.model)[0])
            target = minimum if config == "mxsens min" else 4.27
        wanted = {"model": args.model, "section": section, "config": config, "target_bits": target,
                  "settings": settings}
        if not bench.todo(wanted):
            continue
        model, tokenizer = load(args.model)
        recipe = recipe_for(section, config.split(" ")[0] if section == "w4a4kv4" else config, target,
                            args.sens_samples)
        if recipe is not None and recipe.needs_calibration and ids is None:
            ids = calibration_ids(tokenizer, calib)
        t0 = time.perf_counter()
        decisions = {}
        if recipe is not None:
            try:
                report = quantize(model, recipe, ids if recipe.needs_calibration else None, progress=False)
            except ValueError as e:  # a target out of this model's reach: say so and go on
                print(f"{section} {config} {target}: skipped ({e})", flush=True)
                continue
            decisions = report.plan["decisions"].get("mx_sens", {})
        quant_time = time.perf_counter() - t0
        ppl = perplexity(model, tokenizer, args.ppl_data, args.seqlen, args.ppl_windows, progress=False)
        record = {**wanted, "recipe": recipe.to_dict() if recipe else None, "ppl": ppl.ppl,
                  "element_bits": element_bits(model), **model_summary(model), "quant_time_s": quant_time,
                  "sensitivity": decisions.get("sensitivity") or None,
                  **stamp()}
        print(f"{section:8s} {config:24s} {target or '':>6} bits {record['element_bits']} ppl {ppl.ppl:9.2f} "
              f"quant {quant_time:5.0f} s", flush=True)
        bench.store(record)
        del model


if __name__ == "__main__":
    run(main)
