"""Comparison reports: a markdown table, the raw rows as JSON, and Pareto plots, written atomically."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from bitquilt.cache import atomic_file
from bitquilt.eval.zeroshot import average_accuracy, primary_metric
from bitquilt.tables import cell, markdown_table


# ---------------------------------------------------------------- row normalisation
def _ppl(row: dict[str, Any]) -> dict[str, float]:
    """Perplexity per text set: ``ppl`` (a float, or a {set: value} dict) and ``ppl_<set>`` keys."""
    out = dict(row["ppl"]) if isinstance(row.get("ppl"), dict) else {}
    if isinstance(row.get("ppl"), (int, float)):
        out["ppl"] = float(row["ppl"])
    out.update({k[4:]: v for k, v in row.items() if k.startswith("ppl_") and isinstance(v, (int, float))})
    return out


def _tasks(row: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Zero-shot metrics from ``"<task>/<metric>"`` keys, as ``{task: {metric: value}}``."""
    out: dict[str, dict[str, float]] = {}
    for k, v in row.items():
        if "/" in k and isinstance(v, (int, float)):
            task, metric = k.rsplit("/", 1)
            out.setdefault(task, {})[metric] = v
    return {t: m for t, m in out.items() if "acc" in m}


def _avg(row: dict[str, Any]) -> float | None:
    tasks = _tasks(row)
    return row.get("avg", average_accuracy(tasks) if tasks else None)


def _is_reference(row: dict[str, Any]) -> bool:
    """Unquantized rows: drawn as horizontal lines, not points."""
    return row.get("method") == "fp" or (row.get("bits_per_weight") or 0) >= 16


def _label(row: dict[str, Any]) -> str:
    if row.get("label"):
        return str(row["label"])
    if _is_reference(row):
        return str(row.get("method", "fp"))
    group = row.get("group_size")
    return f"{row.get('method', '?')} w{row.get('w_bits')}" + (f" g{group}" if group and group > 0 else "")


# ---------------------------------------------------------------- markdown
def _display_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, str]], dict[str, str]]:
    """Formatted cells per row, and the {key: header} columns that have at least one value."""
    columns = {"label": "Model"}
    ppl_sets = list(dict.fromkeys(s for r in rows for s in _ppl(r)))
    task_names = list(dict.fromkeys(t for r in rows for t in _tasks(r)))
    out = []
    for r in rows:
        tasks = _tasks(r)
        d = {"label": _label(r), "w_bits": "" if _is_reference(r) else cell(r.get("w_bits")),
             "group_size": "" if _is_reference(r) else cell(r.get("group_size"))}
        d.update({f"ppl:{s}": f"{v:.2f}" for s, v in _ppl(r).items()})
        for t, m in tasks.items():
            d[f"task:{t}"] = f"{100 * primary_metric(m):.1f}"
            if "perplexity" in m:
                d[f"taskppl:{t}"] = f"{m['perplexity']:.2f}"
        avg = _avg(r)
        d["avg"] = f"{100 * avg:.1f}" if avg is not None else ""
        for key, fmt in (("size_mb", ".1f"), ("bits_per_weight", ".2f"), ("quant_time_s", ".1f")):
            d[key] = format(r[key], fmt) if isinstance(r.get(key), (int, float)) else ""
        out.append(d)
    columns |= {"w_bits": "W bits", "group_size": "Group"}
    columns |= {f"ppl:{s}": f"PPL {s}" for s in ppl_sets}
    for t in task_names:
        metric = "acc_norm" if any("acc_norm" in _tasks(r).get(t, {}) for r in rows) else "acc"
        columns[f"task:{t}"] = f"{t} {metric}"
        columns[f"taskppl:{t}"] = f"{t} ppl"
    columns |= {"avg": "Avg acc", "size_mb": "Size MB", "bits_per_weight": "Bits/w", "quant_time_s": "Quant s"}
    return out, {k: h for k, h in columns.items() if any(d.get(k) for d in out)}


def _markdown(rows: list[dict[str, Any]], title: str, settings: dict[str, Any], plots: list[Path]) -> str:
    display, columns = _display_rows(rows)
    parts = [f"# {title}\n", markdown_table(display, columns),
             "Accuracies are percentages: acc_norm where lm-eval reports it (piqa, arc, hellaswag), else acc; "
             "Avg acc is their mean. PPL: perplexity, lower is better. Bits/w: stored bits per quantized weight.\n"]
    parts += [f"![{p.stem}]({p.name})\n" for p in plots]
    parts += ["## Settings\n", markdown_table([{"k": k, "v": json.dumps(v, default=str) if isinstance(v, (dict, list))
                                                else v} for k, v in settings.items()], {"k": "Setting", "v": "Value"})]
    return "\n".join(parts)


# ---------------------------------------------------------------- plots
def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points no other point beats on both bits/weight and perplexity."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def _plot(ax, rows: list[dict[str, Any]], value, log_y: bool) -> bool:
    """Draw ``value(row)`` vs bits/weight per method, references as dashed lines; False if nothing to draw."""
    drawn = False
    methods = list(dict.fromkeys(r.get("method", "?") for r in rows if not _is_reference(r)))
    for method in methods:
        pts = sorted((r["bits_per_weight"], value(r), r) for r in rows if r.get("method", "?") == method
                     and not _is_reference(r) and r.get("bits_per_weight") and _finite(value(r)))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            for x, y, r in pts:
                ax.annotate(_label(r).removeprefix(f"{method} "), (x, y), fontsize=7,
                            textcoords="offset points", xytext=(4, 4))
            drawn = True
    for r in rows:
        if _is_reference(r) and _finite(value(r)):
            ax.axhline(value(r), linestyle="--", color="grey", label=_label(r))
            drawn = True
    if log_y:
        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.margins(x=0.15)
    ax.set_xlabel("bits per weight")
    ax.grid(True, alpha=0.3)
    return drawn


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def _ppl_figure(rows: list[dict[str, Any]]) -> Figure | None:
    sets = list(dict.fromkeys(s for r in rows for s in _ppl(r)))
    if not sets:
        return None
    fig = Figure(figsize=(5.5 * len(sets), 4.5), layout="constrained")
    for ax, s in zip(fig.subplots(1, len(sets), squeeze=False)[0], sets):
        if not _plot(ax, rows, lambda r, s=s: _ppl(r).get(s), log_y=True):
            return None
        pts = [(r["bits_per_weight"], _ppl(r)[s]) for r in rows
               if not _is_reference(r) and r.get("bits_per_weight") and _finite(_ppl(r).get(s))]
        if len(pts) > 1:
            front = _pareto(pts)
            ax.plot([p[0] for p in front], [p[1] for p in front], ":", color="black", alpha=0.6, label="Pareto front")
        ax.set_title(f"perplexity ({s})")
        ax.set_ylabel("perplexity (log)")
        ax.legend(fontsize=8)
    return fig


def _acc_figure(rows: list[dict[str, Any]]) -> Figure | None:
    fig = Figure(figsize=(5.5, 4.5), layout="constrained")
    ax = fig.subplots()
    if not _plot(ax, rows, lambda r: None if _avg(r) is None else 100 * _avg(r), log_y=False):
        return None
    ax.set_title("zero-shot accuracy")
    ax.set_ylabel("average accuracy (%)")
    ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------- entry point
def write_report(rows: list[dict[str, Any]], out_dir: Path, title: str, settings: dict[str, Any]) -> list[Path]:
    """Write report.md, report.json and PNG plots into ``out_dir``; return their paths.

    One row per model (method × configuration), with any of: ``method``, ``w_bits``, ``group_size``,
    ``label`` (default "method wB gG"; ``method == "fp"`` or ``bits_per_weight >= 16`` marks an
    unquantized reference, drawn as a dashed line), ``ppl`` (float or {text set: value}) and/or
    ``ppl_<set>`` floats, zero-shot metrics as ``"<task>/<metric>"`` floats (the flattened output of
    ``evaluate_tasks``), ``avg`` (default: mean primary accuracy), ``size_mb``, ``bits_per_weight``,
    ``quant_time_s``. Plots: ppl_vs_bpw.png (log perplexity vs bits/weight per method, with the
    Pareto front) and acc_vs_bpw.png (average accuracy vs bits/weight), each only if it has data.
    Every file is written to a temporary name and renamed into place.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    for name, fig in (("ppl_vs_bpw.png", _ppl_figure(rows)), ("acc_vs_bpw.png", _acc_figure(rows))):
        if fig is not None:
            with atomic_file(out_dir / name) as tmp:
                fig.savefig(tmp, format="png", dpi=120)
            plots.append(out_dir / name)
    md, js = out_dir / "report.md", out_dir / "report.json"
    with atomic_file(md) as tmp:
        tmp.write_text(_markdown(rows, title, settings, plots), encoding="utf-8")
    with atomic_file(js) as tmp:
        tmp.write_text(json.dumps({"title": title, "settings": settings, "rows": rows}, indent=2, default=str))
    return [md, js, *plots]
