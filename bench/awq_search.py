"""AWQ's α search, every output row against a stratified row sample: what it costs and what it chooses.

    python bench/awq_search.py [--model smollm2-135m] [--rows 512] [--widths 4,3] [--threads 2]

Part 1 times the search on Llama-3-8B shapes (32/8 heads of 128, hidden 4,096, MLP 14,336): each shared input's
linears (q/k/v, o, gate/up, down) with random weights whose rows include a few 15× heavier ones, and a Hessian
from 2,048 random tokens with outlier channels; 20 α values, products in the calibration precision `auto`
picks on this machine; every row at every α (`awq.rows=0`) against `awq.rows=ROWS`. Part 2 quantizes the real
model with `awq+rtn` at each of --widths (g128) twice, `awq.rows=0` and `awq.rows=ROWS`: in the sampled run every search
is also done exhaustively, giving how often the same α is chosen and the regret (the chosen α's exact loss over
the best one's, minus 1); both models are scored on the reference perplexity windows.
"""

from __future__ import annotations

import time

import torch
from common import finish, intro, parser, run, run_facts, run_header, write_report

import bitquilt.transforms.awq as awq_module
from bitquilt.api import load, quantize
from bitquilt.calib.compute import choose_compute
from bitquilt.eval.ppl import perplexity
from bitquilt.recipes import CalibConfig, Recipe
from bitquilt.solvers.base import LayerSpec

LLAMA3_8B = {"q/k/v": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate/up": (4096, [14336, 14336]),
             "down": (14336, [4096])}
SPEC = LayerSpec(4, 128)


def timed(fn, *args, **kwargs):
    c, w = time.process_time(), time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - w, time.process_time() - c


def shapes_part(rows: int, products: torch.dtype) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for name, (width, outs) in LLAMA3_8B.items():
        x = torch.randn(2048, width, generator=g) * (1 + 20 * (torch.rand(width, generator=g) > 0.99))
        hessian, absmean = x.T @ x / x.shape[0], x.abs().mean(0)
        weights = []
        for n in outs:
            w = torch.randn(n, width, generator=g) * 0.02
            w[torch.randperm(n, generator=g)[: n // 32]] *= 15
            weights.append(w)
        specs = [SPEC] * len(weights)
        row = {"linears": name, "inputs": width, "rows": "+".join(map(str, outs))}
        for label, r in (("all", 0), ("sampled", rows)):
            (_, best, _), wall, cpu = timed(awq_module.search_scales, weights, specs, hessian, absmean, 20,
                                            products, r)
            row[label] = {"wall_s": wall, "cpu_s": cpu, "alpha": best / 20}
        out.append(row)
        print(row, flush=True)
    return out


def compared_with_exhaustive(exhaustive, searches: list):
    """search_scales that also runs the exhaustive search whenever it samples, recording (chosen α, best α, regret)."""
    def search(weights, specs, hessian, absmean, grid, products=torch.float32, rows=0):
        chosen = exhaustive(weights, specs, hessian, absmean, grid, products, rows)
        if rows:
            every = exhaustive(weights, specs, hessian, absmean, grid, products, 0)
            searches.append((chosen[1], every[1], every[2] / chosen[2] - 1))
        return chosen
    return search


def model_part(model_name: str, rows: int, calib: CalibConfig, widths: list[int], done) -> list[dict]:
    """The model rows, `done(rows so far)` called after each (the report is rewritten as they come)."""
    exhaustive = awq_module.search_scales
    out = []
    for bits in widths:
        for r in (0, rows):
            searches = []
            awq_module.search_scales = compared_with_exhaustive(exhaustive, searches)
            try:
                model, tok = load(model_name)
                recipe = Recipe("awq+rtn", w_bits=bits, group_size=128, stage_options={"awq": {"rows": r}})
                quantize(model, recipe, calib=calib, tokenizer=tok, progress=False)
            finally:
                awq_module.search_scales = exhaustive
            ppl = perplexity(model, tok, "wiki", 512, 16, progress=False).ppl
            row = {"width": f"W{bits}g128", "rows": r or "all", "ppl": ppl}
            if searches:
                row.update(searches=len(searches), same=sum(a == b for a, b, _ in searches),
                           regret_mean=sum(x for *_, x in searches) / len(searches),
                           regret_max=max(x for *_, x in searches))
            out.append(row)
            print(row, flush=True)
            done(out)
    return out


def render(rec: dict) -> str:
    lines = intro("AWQ's α search: every row against a row sample", __doc__.split("\n\n", 2)[2])
    lines += [run_header(rec["facts"]) + f" Products: {rec['products']}.", "",
              f"## Llama-3-8B shapes (20 α, rows={rec['rows']})", "",
              "| linears | inputs | output rows | every row: CPU s | wall s | sampled: CPU s | wall s | "
              "CPU ratio | α every / sampled |", "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    total = {"all": 0.0, "sampled": 0.0}
    for r in rec["shapes"]:
        a, s = r["all"], r["sampled"]
        total["all"] += a["cpu_s"]
        total["sampled"] += s["cpu_s"]
        lines.append(f"| {r['linears']} | {r['inputs']:,} | {r['rows']} | {a['cpu_s']:.0f} | {a['wall_s']:.0f} | "
                     f"{s['cpu_s']:.0f} | {s['wall_s']:.0f} | {a['cpu_s'] / s['cpu_s']:.1f}× | "
                     f"{a['alpha']:.2f} / {s['alpha']:.2f} |")
    lines += [f"| one block | | | {total['all']:.0f} | | {total['sampled']:.0f} | | "
              f"{total['all'] / total['sampled']:.1f}× | |", "",
              f"## {rec['model']}, awq+rtn ({rec['calibration']}; perplexity: wiki, 16 × 512)", "",
              "| width | awq.rows | perplexity | searches | same α | regret mean | regret max |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in rec["model_rows"]:
        extra = (f"{r['searches']} | {r['same']} | {r['regret_mean']:.1e} | {r['regret_max']:.1e}"
                 if "searches" in r else " | | | ")
        lines.append(f"| {r['width']} | {r['rows']} | {r['ppl']:.2f} | {extra} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = parser(__doc__, model="smollm2-135m", threads=2)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--widths", default="4,3", help="comma-separated weight widths of part 2 (none: part 1 only)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    facts = run_facts()
    compute = choose_compute("auto", "cpu")
    calib = CalibConfig("sciq", args.calib_samples, 512, 0)
    shapes = shapes_part(args.rows, compute.dtype)
    record = {"facts": facts, "products": compute.precision, "rows": args.rows, "model": args.model,
              "calibration": f"sciq {args.calib_samples} × 512", "shapes": shapes, "model_rows": []}

    def done(rows: list[dict]) -> None:
        write_report("awq_search", {**record, "facts": finish(facts), "model_rows": rows}, render)

    done([])
    model_part(args.model, args.rows, calib, [int(w) for w in args.widths.split(",") if w], done)


if __name__ == "__main__":
    run(main)
