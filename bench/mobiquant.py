"""MoBiQuant benchmark: one checkpoint evaluated at many precisions, next to static PTQ at each width.

    python bench/mobiquant.py --model smollm2-135m --threads 1

Rows, most telling first (records resume where a run stopped):
- mobiquant (`--method mobiquant`, or `awq+mobiquant` with --awq-bits; slices --slices, routers trained once at
  --target-bits): perplexity
  routed at each --avg-bits (one global threshold δ, the bits really used reported) and static
  (every token the same slices) at each width the slices reach, all from the one saved checkpoint;
- GPTQ and AWQ calibrated separately at each --widths (groups of --group-size, as the slices);
- the unquantized model on the same windows (`--parts fp`), the floor every row is read against;
- "mobislice nested" / "mobislice lloyd" (`--parts slicing`): the slices alone, uncalibrated, on each
  MoBiSlice grid, at each static width: what the grid gives before any training;
- "gptq 3→4": the 3-bit GPTQ checkpoint's weights requantized on the 4-bit grid (RTN), the static
  checkpoint asked for a precision it was not calibrated at (the paper's generalisation failure);
- batch-1 decode tokens/s of the mobiquant checkpoint at each static width and routed --avg-bits (--speed-rounds
  runs each, the precisions taken in turn);
- outlier migration: per-token KL(p_fp ‖ p_q) rank correlation across --migration-bits for the
  separately calibrated GPTQ models and for the mobiquant checkpoint (static and routed).
Results: bench/results/mobiquant.{json,md} and mobiquant_<model>.png (perplexity vs average bits).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import GPTQ_PLAIN, RESULTS, fmt_ppl, loadavg, parser, ppl_bench, run, sections, stamp, write_atomic

from bitquilt.api import calibration_ids, load, model_summary, quantize, save
from bitquilt.eval import perplexity
from bitquilt.eval.migration import slice_precisions
from bitquilt.io import is_quantized_dir
from bitquilt.nn.quant_linear import QuantLinear, set_slices
from bitquilt.nn.slice_router import realised_bits, set_precision

KEY = ("model", "kind", "label", "precision", "checkpoint")


def _float_list(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


TARGETS = re.compile(r", (quantized|mixed) targets.*$")  # checkpoint_name's suffix for the other fp_reference streams
AWQ = re.compile(r", AWQ scales \(\d bits\)")  # checkpoint_name's mark of `--awq-bits`


TARGET_NOTES = {
    "quantized": " Each block trained towards the full-precision block on the quantized model's inputs "
                 "(fp_reference.stream=quantized), not the full-precision model's outputs.",
    "mixed": " Each block trained towards a blend of the full-precision model's outputs and the full-precision "
             "block on the quantized model's inputs (fp_reference.stream=mixed, the first's share in the name).",
}


def stream_of(checkpoint: str) -> str:
    """The fp_reference stream a checkpoint name says its blocks were trained towards (fp when it says none)."""
    targets = TARGETS.search(checkpoint)
    return targets.group(1) if targets else "fp"


def targets_suffix(stream: str, mix: float) -> str:
    """How a checkpoint name says what its blocks were trained towards (nothing: fp_reference.stream=fp)."""
    return {"fp": "", "quantized": ", quantized targets", "mixed": f", mixed targets ({mix:g} fp)"}[stream]


def checkpoint_name(slices: tuple[int, ...], grid: str, target_bits: float, steps: int, mode: str,
                    stream: str = "fp", mix: float = 0.5, awq_bits: int = 0) -> str:
    """How the mobiquant rows name their checkpoint (baseline rows have none). Checkpoints named without a grid
    were cut on the lloyd grid, MoBiSlice's only one until 2026-12-02; without a stream, trained towards the
    full-precision model's own trajectory (fp_reference.stream=fp); without AWQ, sliced from the weights as
    they are."""
    return (f"slices {','.join(map(str, slices))}, {grid} grid, {target_bits:g} bits, {steps} steps, "
            f"{mode}" + (f", AWQ scales ({awq_bits} bits)" if awq_bits else "") + targets_suffix(stream, mix))


def training_mode(args) -> str:
    """The MODES key the arguments ask for."""
    if args.router_only:
        return "router-only"
    return "prefixes refit on their own streams + re-cut" if args.prefix_streams else "prefixes refit + re-cut"


MODES = {
    "router-only": "routers trained alone at the budget, the slices as MoBiSlice cut them.",
    "prefixes refit + re-cut": "routers and the slices up to one bit past the budget trained together (every "
                               "other step one random static prefix), the slices above re-cut afterwards "
                               "(mobiroute's default until per-prefix streams; now mobiroute.prefix_streams=false).",
    "prefixes refit on their own streams + re-cut": "as 'prefixes refit + re-cut', each static prefix k trained on "
                                                    "the inputs the blocks before give at their own first k slices "
                                                    "(mobiroute.prefix_streams, its default), the routed steps on "
                                                    "the routed stream.",
    "all slices refit, routed mix only": "routers and every slice trained on the routed mix alone (the first "
                                         "implementation of train_slices, since replaced).",
}


def mode_of(checkpoint: str) -> str:
    return AWQ.sub("", TARGETS.sub("", checkpoint.split("steps, ", 1)[1]))


def name_of(r: dict) -> str:
    """A row's model column: the label, and for the checkpoint's rows how it was calibrated (mode, grid, targets)."""
    c = r.get("checkpoint")
    return f"{r['label']} ({calibration_of(c)})" if c else r["label"]


def calibration_of(checkpoint: str) -> str:
    """How a checkpoint was calibrated, from its name: mode, grid, targets."""
    grid = checkpoint.split(", ")[1] if " grid, " in checkpoint else "lloyd grid"
    marks = [m.group(0) for m in (AWQ.search(checkpoint), TARGETS.search(checkpoint)) if m]
    return f"{mode_of(checkpoint)}, {grid}{''.join(marks)}"


def render(records: list[dict]) -> str:
    lines = ["# MoBiQuant benchmark", "", __doc__.split("\n\n", 2)[2].strip(), ""]
    for model, settings, rows, header in sections(records):
        lines += header
        lines += [f"- Checkpoint '{c}' (g{settings['group_size']}): {MODES[mode_of(c)]}"
                  + ("" if " grid, " in c else " Slices on the lloyd grid.")
                  + TARGET_NOTES.get(stream_of(c), "")
                  + (" Sliced from AWQ-scaled weights (--method awq+mobiquant), the scales searched at the width "
                     "in the name (awq.bits)." if AWQ.search(c) else "")
                  for c in dict.fromkeys(r["checkpoint"] for r in rows if r["checkpoint"])]
        fp = next((r for r in rows if r["kind"] == "ppl" and r["label"] == "fp"), None)
        lines += ["", f"Baselines: groups of {settings['group_size']}, calibrated on the same windows."
                  + (f" The unquantized model (fp32) on the same windows: {fmt_ppl(fp['ppl'])}." if fp else ""), ""]
        ppl_rows = sorted((r for r in rows if r["kind"] == "ppl" and r["label"] != "fp"),
                          key=lambda r: (name_of(r), r["bits"]))
        if ppl_rows:
            lines += ["| model | precision | average bits/weight used | stored bits/weight | perplexity | "
                      "quantization s (CPU s) |", "|---|---|---:|---:|---:|---|"]
            for r in ppl_rows:
                q = f"{r['quant_time_s']:.0f} ({r['quant_cpu_s']:.0f})" if r.get("quant_time_s") else ""
                lines.append(f"| {name_of(r)} | {r['precision']} | {r['bits']:.2f} | {r['bits_per_weight']:.2f} | "
                             f"{fmt_ppl(r['ppl'])} | {q} |")
            lines += ["", f"![perplexity vs bits](mobiquant_{model}.png)", ""]
        speed = [r for r in rows if r["kind"] == "speed"]
        if speed:
            lines += speed_table(speed)
        for r in (r for r in rows if r["kind"] == "migration"):
            labels = r["result"]["labels"]
            lines += [f"![outlier migration, {name_of(r)}]({migration_figure(r).name})", ""]
            lines += [f"Outlier migration, {name_of(r)}: Spearman ρ of per-token KL(p_fp ‖ p_q) over "
                      f"{r['result']['n_tokens']} tokens (and the fraction of the top-1% tokens shared; chance "
                      f"{r['result']['chance_shared']:.3f}):", "",
                      "| | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
            for i, a in enumerate(labels):
                cells = [f"{r['result']['spearman'][i][j]:.2f} ({r['result']['top_shared'][i][j]:.2f})"
                         for j in range(len(labels))]
                lines.append(f"| {a} | " + " | ".join(cells) + " |")
            lines += [""]
    return "\n".join(lines)


def migration_figure(record: dict) -> Path:
    """Where a migration record's heatmaps are drawn: bench/results/mobiquant_migration_<model>_<row>.png."""
    row = re.sub(r"[^a-z0-9]+", "-", name_of(record).lower()).strip("-")
    return RESULTS / f"mobiquant_migration_{record['model']}_{row}.png"


def plot_migrations(records: list[dict], model: str) -> None:
    """The heatmaps (ρ and top-token sharing) of every migration record of `model`."""
    from bitquilt.eval.migration import MigrationResult, plot_migration

    for r in records:
        if r["model"] == model and r["kind"] == "migration":
            plot_migration(MigrationResult.from_dict(r["result"]), migration_figure(r), f"{model}, {name_of(r)}")


PLOT_TOP = 300  # perplexity: the collapsed 2-bit points would flatten every usable one


def plot(records: list[dict], model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r["model"] == model and r["kind"] == "ppl"]
    fig, ax = plt.subplots(figsize=(9, 7))
    checkpoints = list(dict.fromkeys(r["checkpoint"] for r in rows if r["checkpoint"]))
    kinds = (("routed", "o-"), ("static", "s--"))
    palette = plt.get_cmap("tab20").colors
    lines = [(f"{kind}: {calibration_of(c)}",
              lambda r, c=c, kind=kind: r["checkpoint"] == c and r["precision"].startswith(kind), style,
              palette[(2 * i + j) % len(palette)])
             for i, c in enumerate(checkpoints) for j, (kind, style) in enumerate(kinds)]
    lines += [(label, lambda r, label=label: r["label"] == label, style, color)
              for label, style, color in (("gptq", "^:", "black"), ("awq", "v:", "dimgray"), ("gptq 3→4", "X", "red"),
                                          ("mobislice nested", "d-.", "olive"), ("mobislice lloyd", "d:", "tan"))]
    for name, selected, style, color in lines:
        pts = sorted((r["bits"], r["ppl"]) for r in rows if selected(r))
        if pts:
            ax.plot(*zip(*pts), style, color=color, label=name, markersize=6)
    for r in (r for r in rows if r["label"] == "fp"):
        ax.axhline(r["ppl"], color="green", linestyle=(0, (1, 3)), label=f"unquantized (fp32): {r['ppl']:.2f}")
    ax.set_yscale("log")
    ax.set_ylim(top=min(ax.get_ylim()[1], PLOT_TOP))
    ax.set_xlabel("average bits per weight used (element bits)")
    ax.set_ylabel(f"perplexity (wiki; above {PLOT_TOP} off the chart)")
    ax.set_title(f"{model}: one MoBiQuant checkpoint vs static PTQ per width")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    RESULTS.mkdir(exist_ok=True)
    tmp = RESULTS / f"mobiquant_{model}.tmp.png"
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    tmp.replace(RESULTS / f"mobiquant_{model}.png")
    plt.close(fig)


def speed_rounds(mobi, todo: list[tuple[str, float]], apply: Callable[[str, float], None],
                 rounds: int) -> list[tuple[str, float, float, list]]:
    """Batch-1 decode of each (kind, bits) of `todo`, one run each per round, the precisions taken in turn
    so that every one sees the same machine load; (kind, bits, bits used, runs) per precision."""
    from bitquilt.eval.speed import measure_speed
    from bitquilt.runtime.engines import decode

    probe = torch.randint(0, mobi.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    used = {}
    for kind, bits in todo:
        apply(kind, bits)
        with realised_bits(mobi) as u:  # bits on a short decode apart: the hook would be timed too
            decode(mobi, probe, 16)
        used[kind, bits] = u["avg_bits"]
    runs: dict[tuple[str, float], list] = {p: [] for p in todo}
    for r in range(rounds):
        for kind, bits in todo:
            apply(kind, bits)
            runs[kind, bits].append(measure_speed(mobi, mobi.config.vocab_size, repeats=1))
        print(f"speed round {r + 1}/{rounds}: " + ", ".join(
            f"{k} {b:g} {runs[k, b][-1].decode_tokens_per_s:.1f}" for k, b in todo), flush=True)
    return [(kind, bits, used[kind, bits], runs[kind, bits]) for kind, bits in todo]


def static_rate_at(speed: list[dict], checkpoint: str, bits: float) -> float | None:
    """Decode rate of the checkpoint's static prefixes interpolated linearly at `bits` (None outside their span)."""
    points = sorted((r["bits"], r["decode_tps"]) for r in speed
                    if r["checkpoint"] == checkpoint and r["precision"].startswith("static"))
    for (b0, v0), (b1, v1) in zip(points, points[1:]):
        if b0 <= bits <= b1:
            return v0 + (v1 - v0) * (bits - b0) / (b1 - b0)
    return None


def speed_table(speed: list[dict]) -> list[str]:
    lines = ["Batch-1 decode of the mobiquant checkpoint (prompt 128, 32 new tokens; routed rows include the "
             "routers). *n*: runs whose median is shown, taken in turn with the checkpoint's other precisions "
             "(\"3 in a row\": the first records, three runs back to back). *routed ÷ static*: the routed decode "
             "rate over the static prefixes' rate interpolated at the same bits, measured in the same rounds "
             "(< 1: the router's cost).", "",
             "| checkpoint | precision | bits used | decode tok/s | prefill tok/s | routed ÷ static | n |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in sorted(speed, key=lambda r: (r["checkpoint"], r["precision"][0], r["bits"])):
        static = static_rate_at(speed, r["checkpoint"], r["bits"]) if r["precision"].startswith("routed") else None
        ratio = f"{r['decode_tps'] / static:.2f}" if static else ""
        n = r.get("rounds", "3 in a row")
        lines.append(f"| {r['checkpoint']} | {r['precision']} | {r['bits']:.2f} | {r['decode_tps']:.1f} | "
                     f"{r['prefill_tps']:.0f} | {ratio} | {n} |")
    return lines + [""]


def requantize(model: torch.nn.Module, bits: int, group_size: int) -> None:
    """Put every QuantLinear's dequantized weight back as a plain linear, then RTN it at `bits`."""
    from bitquilt.nn.online import swap_host

    for name, m in list(model.named_modules()):
        if isinstance(m, QuantLinear):
            linear = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(m.dequantized())
                if m.bias is not None:
                    linear.bias.copy_(m.bias)
            swap_host(model, name, linear)
    quantize(model, "rtn", None, progress=False, w_bits=bits, group_size=group_size)


def main() -> None:
    p = parser(__doc__, model="smollm2-135m")
    p.add_argument("--slices", default="2,1,1,1,1,1,1")
    p.add_argument("--grid", default="nested", choices=("nested", "lloyd"), help="MoBiSlice's grid for the checkpoint")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--target-bits", type=float, default=3.0)
    p.add_argument("--route-steps", type=int, default=30)
    p.add_argument("--router-only", action="store_true",
                   help="train the routers alone, the slices as MoBiSlice cut them (mobiroute.train_slices=false)")
    p.add_argument("--prefix-streams", action="store_true",
                   help="train each static prefix on the inputs the blocks before give at that prefix "
                   "(mobiroute.prefix_streams, the library's default; without the flag the bench sets it off, as its "
                   "earlier checkpoints were trained)")
    p.add_argument("--reference-stream", default="fp", choices=("fp", "quantized", "mixed"),
                   help="targets of the block training (fp_reference.stream): the full-precision model's own "
                   "outputs (fp: each block also corrects the error of the quantized blocks before it, at the "
                   "routed precision it was calibrated at) or the full-precision block on the quantized inputs "
                   "(quantized: each block repairs only its own error), or a blend of both targets (mixed)")
    p.add_argument("--reference-mix", type=float, default=0.5,
                   help="--reference-stream mixed: the fp target's share of the blend (fp_reference.mix)")
    p.add_argument("--awq-bits", type=int, default=0,
                   help="slice AWQ-scaled weights (--method awq+mobiquant), the scales searched at this width "
                   "(awq.bits; 0: no AWQ)")
    p.add_argument("--avg-bits", default="2.5,3,3.5,4,4.5,5,6")
    p.add_argument("--static-bits", default="2,3,4,5,6")
    p.add_argument("--widths", default="2,3,4", help="widths of the separately calibrated GPTQ/AWQ rows")
    p.add_argument("--baselines", default="gptq,awq")
    p.add_argument("--parts", default="fp,ppl,slicing,generalise,speed,migration,baselines")
    p.add_argument("--speed-rounds", type=int, default=5,
                   help="speed: runs per precision, the precisions taken in turn each round")
    p.add_argument("--migration-bits", default="2,3,4")
    p.add_argument("--migration-windows", type=int, default=4)
    p.add_argument("--save-dir", default=str(Path.home() / ".cache/bitquilt/bench-models"))
    args, calib, settings, bench = ppl_bench(p, "mobiquant", KEY, render, calib_samples=64, ppl_windows=40)
    if not 0 < args.reference_mix < 1:
        p.error(f"--reference-mix is the fp target's share of the blend, strictly between 0 and 1; got "
                f"{args.reference_mix}")
    slices = tuple(int(b) for b in args.slices.split(","))
    parts = args.parts.split(",")
    settings = {**settings, "group_size": args.group_size}
    checkpoint = checkpoint_name(slices, args.grid, args.target_bits, args.route_steps, training_mode(args),
                                 args.reference_stream, args.reference_mix, args.awq_bits)
    base = {"model": args.model, "settings": settings, "checkpoint": ""}
    ids = None

    def keep(record: dict) -> None:
        ours = checkpoint if record["label"].startswith("mobiquant") else ""
        bench.store({**base, **record, "checkpoint": ours, **stamp(), "load": loadavg()})
        records = bench.records()
        plot(records, args.model)
        if record["kind"] == "migration":
            plot_migrations(records, args.model)

    def wanted(kind: str, label: str, precision: str) -> bool:
        ours = checkpoint if label.startswith("mobiquant") else ""
        record = {**base, "kind": kind, "label": label, "precision": precision, "checkpoint": ours}
        return bench.todo(record)  # re-read: this run adds

    def ppl(model, tok) -> float:
        return perplexity(model, tok, args.ppl_data, args.seqlen, args.ppl_windows, progress=False).ppl

    if "slicing" in parts:
        slicing_part(args, slices, ppl, keep, wanted)
        if parts == ["slicing"]:
            return
    # the mobiquant checkpoint, quantized once and kept, when a part measures it
    mobi, tokenizer, quant = (mobiquant_checkpoint(args, slices, calib) if {"ppl", "speed", "migration"} & set(parts)
                              else (None, None, {}))
    summary = model_summary(mobi) if mobi is not None else {}
    precisions = [("static", b) for b in _float_list(args.static_bits)] + \
                 [("routed", b) for b in _float_list(args.avg_bits)]
    static_k = slice_precisions(mobi) if mobi is not None else {}  # {bits: k}

    def apply(kind: str, bits: float) -> None:
        if kind == "static":
            set_slices(mobi, static_k[bits])
        else:
            set_precision(mobi, bits)

    if "ppl" in parts:
        for kind, bits in precisions:
            if wanted("ppl", "mobiquant", f"{kind} {bits:g}"):
                apply(kind, bits)
                with realised_bits(mobi) as used:
                    value = ppl(mobi, tokenizer)
                print(f"mobiquant {kind} {bits:g}: {used['avg_bits']:.2f} bits, ppl {value:.2f}", flush=True)
                keep({"kind": "ppl", "label": "mobiquant", "precision": f"{kind} {bits:g}", "bits": used["avg_bits"],
                      "ppl": value, **summary, **quant})
    if "fp" in parts and wanted("ppl", "fp", "fp32"):
        model, tok = load(args.model)
        value = ppl(model, tok)
        print(f"fp32: ppl {value:.2f}", flush=True)
        keep({"kind": "ppl", "label": "fp", "precision": "fp32", "bits": 32.0, "ppl": value})
        del model
    baselines = [b for b in args.baselines.split(",") if b]
    for label, width in [("gptq", 3)] * ("generalise" in parts) + \
                        [(b, w) for b in baselines for w in map(int, args.widths.split(","))] * ("baselines" in parts):
        todo = wanted("ppl", label, f"static {width}")
        todo_gen = label == "gptq" and width == 3 and "generalise" in parts and wanted("ppl", "gptq 3→4", "static 4")
        if not (todo or todo_gen):
            continue
        model, tok = load(args.model)
        ids = calibration_ids(tok, calib) if ids is None else ids
        c0, t0 = time.process_time(), time.perf_counter()
        quantize(model, label, ids, progress=False, w_bits=width, group_size=args.group_size,
                 options=GPTQ_PLAIN if label == "gptq" else {})
        times = {"quant_time_s": time.perf_counter() - t0, "quant_cpu_s": time.process_time() - c0}
        if todo:
            value = ppl(model, tok)
            print(f"{label} w{width}: ppl {value:.2f}", flush=True)
            keep({"kind": "ppl", "label": label, "precision": f"static {width}", "bits": float(width), "ppl": value,
                  **model_summary(model), **times})
        if todo_gen:
            requantize(model, 4, args.group_size)
            value = ppl(model, tok)
            print(f"gptq 3→4: ppl {value:.2f}", flush=True)
            keep({"kind": "ppl", "label": "gptq 3→4", "precision": "static 4", "bits": 4.0, "ppl": value,
                  **model_summary(model), **times})
        del model
    if "speed" in parts:
        todo = [(kind, bits) for kind, bits in precisions if wanted("speed", "mobiquant", f"{kind} {bits:g}")]
        for kind, bits, used, runs in speed_rounds(mobi, todo, apply, args.speed_rounds):
            keep({"kind": "speed", "label": "mobiquant", "precision": f"{kind} {bits:g}", "bits": used,
                  "decode_tps": statistics.median(r.decode_tokens_per_s for r in runs),
                  "prefill_tps": statistics.median(r.prefill_tokens_per_s for r in runs), "rounds": len(runs)})
    if "migration" in parts:
        migration_part(args, mobi, calib, keep, wanted)


def mobiquant_checkpoint(args, slices: tuple[int, ...], calib) -> tuple[torch.nn.Module, object, dict]:
    """The mobiquant checkpoint the arguments name (model, tokenizer, quantization times): loaded when saved
    before, else quantized and saved first (the slow part: ~45 min on smollm2-135m)."""
    trained = {"router-only": "-routeronly", "prefixes refit + re-cut": "-recut",
               "prefixes refit on their own streams + re-cut": "-recut-streams"}[training_mode(args)]
    saved = Path(args.save_dir) / (f"{args.model}-mobiquant-{'-'.join(map(str, slices))}-{args.grid}-"
                                   f"g{args.group_size}-t{args.target_bits:g}-s{args.route_steps}{trained}-c{calib.n_samples}x{calib.seqlen}"
                                   + {"fp": "", "quantized": "-qtargets",
                                      "mixed": f"-mtargets{args.reference_mix:g}"}[args.reference_stream]
                                   + (f"-awq{args.awq_bits}" if args.awq_bits else ""))
    quant = {}
    if not is_quantized_dir(saved):
        model, tokenizer = load(args.model)
        ids = calibration_ids(tokenizer, calib)
        c0, t0 = time.process_time(), time.perf_counter()
        awq = {"awq": {"bits": args.awq_bits}} if args.awq_bits else {}
        partial = saved.with_name(saved.name + ".partial")  # the state after each block: an interrupted run resumes
        report = quantize(model, "awq+mobiquant" if awq else "mobiquant", ids, progress=True, resume_dir=partial,
                          w_bits=sum(slices),
                          group_size=args.group_size, options={"slices": slices, "grid": args.grid},
                          stage_options={**awq,
                                         "mobiroute": {"target_bits": args.target_bits, "steps": args.route_steps,
                                                       "train_slices": not args.router_only,
                                                       "prefix_streams": args.prefix_streams},
                                         "fp_reference": {"stream": args.reference_stream,
                                                          "mix": args.reference_mix}})
        blocks = report.stages["mobiroute"].values()
        earlier = report.resumed_at  # the blocks an interrupted run quantized, timed by that run
        quant = {"quant_time_s": time.perf_counter() - t0 + sum(report.block_seconds[:earlier]),
                 "quant_cpu_s": time.process_time() - c0 + sum(report.block_cpu_seconds[:earlier]),
                 "resumed_at_block": report.resumed_at,
                 "route_seconds": sum(b["seconds"] for b in blocks),
                 "route_error_ratio": sum(b["loss_after"] / b["loss_before"] for b in blocks) / len(blocks),
                 "avg_bits_at_half": sum(b["avg_bits_at_half"] for b in blocks) / len(blocks)}
        print(f"mobiquant quantized: {quant}", flush=True)
        save(model, saved, tokenizer)
        write_atomic(saved / "bench_quant.json", json.dumps(quant))
        shutil.rmtree(partial)
    else:
        quant = json.loads((saved / "bench_quant.json").read_text())
    return (*load(saved), quant)


def slicing_part(args, slices: tuple[int, ...], ppl, keep, wanted) -> None:
    """The slices alone on each grid, uncalibrated (`--method mobislice`), at each static width."""
    for grid in ("nested", "lloyd"):
        label = f"mobislice {grid}"
        todo = [b for b in _float_list(args.static_bits) if wanted("ppl", label, f"static {b:g}")]
        if not todo:
            continue
        model, tok = load(args.model)
        c0, t0 = time.process_time(), time.perf_counter()
        quantize(model, "mobislice", None, progress=False, w_bits=sum(slices), group_size=args.group_size,
                 options={"slices": slices, "grid": grid})
        times = {"quant_time_s": time.perf_counter() - t0, "quant_cpu_s": time.process_time() - c0}
        static_k = slice_precisions(model)
        for b in todo:
            set_slices(model, static_k[b])
            value = ppl(model, tok)
            print(f"{label} static {b:g}: ppl {value:.2f}", flush=True)
            keep({"kind": "ppl", "label": label, "precision": f"static {b:g}", "bits": b, "ppl": value,
                  **model_summary(model), **times})
        del model


def migration_part(args, mobi, calib, keep, wanted) -> None:
    """Per-token error rank correlation across widths: separately calibrated GPTQ models, then the checkpoint."""
    from bitquilt.api import outlier_migration
    from bitquilt.data.windows import eval_windows
    from bitquilt.eval.migration import migration, token_errors

    bits = _float_list(args.migration_bits)
    fp, tok = load(args.model)
    windows = eval_windows(tok, args.ppl_data, args.seqlen, args.migration_windows)
    if wanted("migration", "gptq (one model per width)", "-"):
        errors = {}
        ids = calibration_ids(tok, calib)
        for b in bits:
            model, _ = load(args.model)
            quantize(model, "gptq", ids, progress=False, w_bits=int(b), group_size=args.group_size, options=GPTQ_PLAIN)
            errors.update(token_errors(fp, model, windows, {f"gptq {b:g}": lambda m: None}))
        keep({"kind": "migration", "label": "gptq (one model per width)", "precision": "-",
              "result": migration(errors).to_dict()})
    if wanted("migration", "mobiquant (one checkpoint)", "-"):
        result = outlier_migration(mobi, fp, windows, bits)
        keep({"kind": "migration", "label": "mobiquant (one checkpoint)", "precision": "-", "result": result.to_dict()})


if __name__ == "__main__":
    run(main)
