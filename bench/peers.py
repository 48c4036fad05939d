"""Peer benchmark: Intel's AutoRound next to bitquilt recipes, on the same calibration and perplexity windows.

Per grid (--grid, default W4g128, W3g128, W2g64; asymmetric, plain uniform integer grid): perplexity,
stored bits/weight and quantization time (wall, and CPU time of the process and its children) of
AutoRound (SignRound: signed-gradient tuning of each weight's rounding and each group's min/max range,
block by block) in the settings given by --autoround, and of the bitquilt recipes given by --bitquilt;
plus the FP model. Every model is scored by bitquilt's `perplexity` on the same windows. AutoRound gets
bitquilt's calibration windows (`calibration_ids`: --calib-samples × --calib-seqlen tokens of
--calib-data, seed 0) as token tensors, so both tune on the same token ids; it runs on the CPU in fp32
(amp=False; its default would tune in bf16 where the CPU has it). Its tuned weights are repacked into
bitquilt's uniform format, asserting that every weight is exactly fp16 scale × (b-bit code − zero) and
that no group holds more than 2^b levels, and scored as bitquilt QuantLinears.

AutoRound is an optional bench dependency, in a venv of its own (bitquilt rows need only bitquilt's):

    python3 -m venv .venv-peers
    .venv-peers/bin/pip install torch==2.13.0
    .venv-peers/bin/pip install -e . torch==2.13.0
    .venv-peers/bin/pip install auto-round==0.16.1 torch==2.13.0

Full runs (smollm2-135m, 64 × 512 SciQ calibration windows, first 40 × 512 `wiki` windows):

    OMP_NUM_THREADS=1 .venv/bin/python bench/peers.py --threads 1 --bitquilt gptq awq+gptq
    OMP_NUM_THREADS=1 .venv-peers/bin/python bench/peers.py --threads 1 --autoround light default

--autoround takes PRESET[:key=value,...]: `default` (iters=200, lr auto = 1/iters, batch size 8, its
defaults) or `light` (iters=50, lr=5e-3), with overrides of AUTOROUND_KNOBS, e.g. `default:iters=2`.
--bitquilt takes METHOD[:key=value,...]: Recipe(METHOD, w_bits, group_size, **fields) with Recipe
fields, `opt.NAME=value` solver options and `stage.STAGE.NAME=value` stage options, e.g.
`gptq:opt.damp=0.1`; gptq-solved methods start from GPTQ_PLAIN. Values are Python literals, else strings.

Results: bench/results/NAME.{json,md} (--results, default `peers`), one record per model × engine ×
label × grid × settings; a record already there is skipped, so an interrupted run resumes. At one
thread on a 2-core EPYC, AutoRound's default setting takes about 3 h per grid on smollm2-135m (~1.65 s
per iteration per block), `light` about 45 min; the bitquilt rows take minutes.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import time
from importlib.metadata import version
from typing import Any

import psutil
import torch
from common import GPTQ_PLAIN, fmt_ppl, intro, loadavg, parser, pivot, ppl_bench, run, sections, stamp
from torch import nn

from bitquilt.api import calibration_ids, load, model_summary, quantize
from bitquilt.errors import UserError
from bitquilt.eval import perplexity
from bitquilt.formats.uniform import UniformFormat, UniformGrid, expand_groups
from bitquilt.nn.online import swap_host
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import Recipe, solver_name

KEY = ("model", "engine", "label", "w_bits", "group_size")  # + settings: what identifies a record
AUTOROUND_VERSION = "0.16.1"
AUTOROUND_PRESETS = {"default": {"iters": 200, "lr": None, "batch_size": 8},
                     "light": {"iters": 50, "lr": 5e-3, "batch_size": 8}}
AUTOROUND_KNOBS = {"iters", "lr", "minmax_lr", "batch_size", "seed", "enable_minmax_tuning", "enable_quanted_input",
                   "enable_torch_compile", "gradient_accumulate_steps", "not_use_best_mse", "nblocks"}
RECIPE_FIELDS = {f.name for f in dataclasses.fields(Recipe)} - {"method", "w_bits", "group_size", "options",
                                                                 "stage_options"}


def parse_spec(spec: str, flag: str) -> tuple[str, dict[str, Any]]:
    """`NAME[:key=value,...]` -> (NAME, {key: value}); a value is a Python literal, else a string (a comma
    splits pairs only before `key=`, so tuple values keep theirs)."""
    name, _, rest = spec.partition(":")
    pairs = {}
    for item in filter(None, re.split(r",(?=\s*[\w.]+\s*=)", rest)):
        key, eq, text = (s.strip() for s in item.partition("="))
        if not eq or not key:
            raise UserError(f"{flag} {spec!r}: expected key=value, got {item!r}")
        try:
            pairs[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            pairs[key] = text
    return name.strip(), pairs


def bitquilt_recipe(spec: str, bits: int, group: int) -> Recipe:
    """The Recipe a --bitquilt spec names at this grid (see the module docstring)."""
    method, pairs = parse_spec(spec, "--bitquilt")
    fields: dict[str, Any] = {}
    options: dict[str, Any] = {}
    stage_options: dict[str, dict[str, Any]] = {}
    for key, value in pairs.items():
        stage, _, name = key.removeprefix("stage.").partition(".")
        if key.startswith("opt."):
            options[key.removeprefix("opt.")] = value
        elif key.startswith("stage.") and name:
            stage_options.setdefault(stage, {})[name] = value
        elif key in RECIPE_FIELDS:
            fields[key] = value
        else:
            given = " (w_bits and group_size come from --grid)" if key in ("w_bits", "group_size") else ""
            raise UserError(f"--bitquilt {spec!r}: Recipe has no field {key!r}{given}; fields: "
                            f"{', '.join(sorted(RECIPE_FIELDS))}; solver options: opt.NAME=value; stage "
                            "options: stage.STAGE.NAME=value")
    if solver_name(method) == "gptq":
        options = {**GPTQ_PLAIN, **options}
    try:
        return Recipe(method, w_bits=bits, group_size=group, options=options, stage_options=stage_options, **fields)
    except TypeError as e:
        raise UserError(f"--bitquilt {spec!r}: {e}") from None


def autoround_settings(spec: str) -> dict[str, Any]:
    """AutoRound's tuning arguments a --autoround spec names: a preset updated by key=value pairs."""
    preset, pairs = parse_spec(spec, "--autoround")
    if preset not in AUTOROUND_PRESETS:
        raise UserError(f"--autoround {spec!r}: unknown preset {preset!r}; presets: {', '.join(AUTOROUND_PRESETS)}")
    unknown = sorted(set(pairs) - AUTOROUND_KNOBS)
    if unknown:
        raise UserError(f"--autoround {spec!r}: unknown setting(s) {', '.join(unknown)}; settings: "
                        f"{', '.join(sorted(AUTOROUND_KNOBS))}")
    return {**AUTOROUND_PRESETS[preset], **pairs}


def require_autoround() -> None:
    """Fail early, with the install commands, if the optional AutoRound package is missing."""
    try:
        import auto_round  # noqa: F401
    except ImportError:
        raise UserError(f"--autoround needs the optional package auto-round=={AUTOROUND_VERSION}, best in a venv of "
                        "its own: python3 -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 && "
                        ".venv-peers/bin/pip install -e . torch==2.13.0 && .venv-peers/bin/pip install "
                        f"auto-round=={AUTOROUND_VERSION} torch==2.13.0; then run this script with "
                        ".venv-peers/bin/python") from None


def cpu_seconds() -> float:
    """CPU time of this process (all threads) and of its children, ended (reaped) or still running."""
    ended = os.times()
    live = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            live += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass  # ended between listing and asking
    return time.process_time() + ended.children_user + ended.children_system + live


def autoround_quantize(model: nn.Module, tokenizer: Any, ids: torch.Tensor, bits: int, group: int,
                       settings: dict[str, Any]) -> dict[str, Any]:
    """Tune `model` in place with AutoRound on exactly the windows `ids` (fp32, CPU); returns the arguments
    it ran with, as it resolved them."""
    from auto_round import AutoRound

    if tokenizer.pad_token_id is not None and bool((ids == tokenizer.pad_token_id).any()):
        raise UserError("the calibration windows contain the pad token, which AutoRound would mask out")
    compressor = AutoRound(model, tokenizer=tokenizer, bits=bits, group_size=group, sym=False, data_type="int",
                           dataset=list(ids.split(settings["batch_size"])), nsamples=len(ids), seqlen=ids.shape[1],
                           amp=False, device_map="cpu", low_cpu_mem_usage=False, **settings)
    compressor.quantize()
    config = compressor.quantize_config
    return {**settings, "lr": config.lr, "minmax_lr": config.minmax_lr, "seed": compressor.seed,
            "enable_torch_compile": compressor.enable_torch_compile, "amp": False,
            "scale_dtype": str(compressor.scale_dtype), "nsamples": len(ids), "seqlen": ids.shape[1]}


def max_levels(w: torch.Tensor, group: int) -> int:
    """The most distinct values in any group of `group` consecutive weights of a row of `w`."""
    most = 0
    for chunk in w.split(group, dim=1):
        ordered = chunk.sort(dim=1).values
        most = max(most, int((ordered.diff(dim=1) != 0).sum(dim=1).max()) + 1)
    return most


def repack_autoround(model: nn.Module, bits: int, group: int) -> dict[str, Any]:
    """Swap each linear AutoRound quantized for a bitquilt QuantLinear in the uniform format holding exactly
    its weights, asserting the grid; returns AutoRound's own storage cost (b-bit codes, an fp16 scale and a
    b-bit zero per group: b + (16 + b)/g bits/weight) and the most levels found in a group."""
    grid = UniformGrid(bits)
    stored = weights = levels = 0
    for name, lin in list(model.named_modules()):
        if not isinstance(lin, nn.Linear) or getattr(lin, "zp", None) is None:
            continue  # not quantized by AutoRound (the lm_head)
        assert (lin.bits, lin.group_size, lin.sym, lin.data_type) == (bits, group, False, "int"), name
        w = lin.weight.detach()
        out_features, in_features = w.shape
        n_groups = -(-in_features // group)
        scale, zero = lin.scale.float(), lin.zp.float()
        assert scale.shape == zero.shape == (out_features, n_groups), name
        q = torch.round(w / expand_groups(scale, group, in_features)) + expand_groups(zero, group, in_features)
        assert 0 <= q.min() and q.max() <= grid.maxq, name
        fmt = UniformFormat.from_codes(q, scale, zero, grid, group)
        assert torch.equal(fmt.dequantize(), w), f"{name}: weights are not fp16 scale × (code − zero)"
        levels = max(levels, max_levels(w, group))
        assert levels <= 2**bits, f"{name}: {levels} levels in a group of {group}, more than 2^{bits}"
        swap_host(model, name, QuantLinear(fmt, lin.bias))
        stored += out_features * (in_features * bits + n_groups * (16 + bits))
        weights += out_features * in_features
    assert weights, "AutoRound quantized no linear"
    return {"bits_per_weight": stored / weights, "max_levels_per_group": levels}


def grid_label(bits: int, group: int) -> str:
    return f"W{bits}g{group}"


ABOUT = """\
Generated by `bench/peers.py` (see the command per table). Each cell: perplexity (bitquilt's `perplexity`,
token-level, non-overlapping windows) · stored bits/weight · quantization time, wall (and CPU: the process's threads
and children). AutoRound tunes on bitquilt's calibration windows (the same token ids) in fp32 on the CPU, asymmetric
plain integer grid; its weights are repacked into bitquilt's uniform format (checked exact, ≤ 2^b levels per group)
and scored as bitquilt QuantLinears. Its bits/weight count its own export: b-bit codes, fp16 scale and b-bit zero per
group (b + (16 + b)/g); bitquilt's uniform format stores 8-bit zeros (b + 24/g). AutoRound otherwise keeps its
defaults: it also tunes each group's min/max range (a learned clipping), keeps the iteration of least mini-batch loss,
matches the FP model's block outputs from the quantized model's block inputs, masks the last token of each window, and
torch.compiles from 10 iterations on.
"""


def render(records: list[dict]) -> str:
    lines = intro("Peer benchmark: AutoRound and bitquilt", ABOUT)
    for _model, _settings, rows, header in sections(records):
        quantized = [r for r in rows if r["engine"] != "fp"]
        grids = list(dict.fromkeys(grid_label(r["w_bits"], r["group_size"])
                                   for r in sorted(quantized, key=lambda r: (-r["w_bits"], -r["group_size"]))))
        labels = list(dict.fromkeys(f"{r['engine']} {r['label']}" for r in quantized))
        cell = {(f"{r['engine']} {r['label']}", grid_label(r["w_bits"], r["group_size"])):
                f"{fmt_ppl(r['ppl'])} · {r['bits_per_weight']:.3f} bpw · {r['quant_wall_s']:.0f} s "
                f"(cpu {r['quant_cpu_s']:.0f} s)" for r in quantized}
        fp = next((r for r in rows if r["engine"] == "fp"), None)
        corner = f"engine, setting (fp {fmt_ppl(fp['ppl'])})" if fp else "engine, setting"
        lines += header
        lines += pivot(corner, labels, grids, cell) if quantized else [f"FP perplexity {fmt_ppl(fp['ppl'])}."]
        lines.append("")
        for r in (r for r in quantized if r["engine"] == "autoround"):
            c = r["config"]
            lines.append(f"- autoround {r['label']} {grid_label(r['w_bits'], r['group_size'])}: iters {c['iters']}, "
                         f"lr {c['lr']:g}, batch {c['batch_size']}, torch.compile {c['enable_torch_compile']}; in "
                         f"bitquilt's format {r['bitquilt_bits_per_weight']:.3f} bits/weight, at most "
                         f"{r['max_levels_per_group']} levels per group")
        versions = ", ".join(sorted({r["auto_round"] for r in quantized if r["engine"] == "autoround"}))
        loads = [float(r["loadavg"].split()[0]) for r in quantized]
        if loads:
            lines += ["", f"Load average (1 min) when each quantization started: {min(loads):.1f}–{max(loads):.1f}."
                      + (f" auto-round {versions}." if versions else ""), ""]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, model="smollm2-135m")
    p.add_argument("--grid", default="4:128,3:128,2:64", help="bits:group pairs, in run order")
    p.add_argument("--autoround", nargs="*", default=[], metavar="PRESET[:k=v,...]",
                   help=f"AutoRound settings: {', '.join(AUTOROUND_PRESETS)} (needs auto-round=={AUTOROUND_VERSION})")
    p.add_argument("--bitquilt", nargs="*", default=[], metavar="METHOD[:k=v,...]", help="bitquilt recipes")
    p.add_argument("--results", default="peers", help="results name: bench/results/NAME.{json,md}")
    args, calib, settings, bench = ppl_bench(p, "peers", KEY, render, calib_samples=64, ppl_windows=40)
    bench.name = args.results  # --results names the file
    try:
        grid = [tuple(int(v) for v in pair.split(":")) for pair in args.grid.split(",")]
    except ValueError:
        raise UserError(f"--grid takes bits:group pairs such as 4:128,2:64, got {args.grid!r}") from None
    if any(len(pair) != 2 for pair in grid):
        raise UserError(f"--grid takes bits:group pairs such as 4:128,2:64, got {args.grid!r}")
    configs: list[tuple[str, str, Any, int | None, int | None]] = [("fp", "fp", None, None, None)]
    for bits, group in grid:
        configs += [("bitquilt", spec, bitquilt_recipe(spec, bits, group), bits, group) for spec in args.bitquilt]
        configs += [("autoround", spec, autoround_settings(spec), bits, group) for spec in args.autoround]
    if args.autoround:
        require_autoround()
    host = stamp()

    ids = None
    for engine, label, config, bits, group in configs:
        wanted = {"model": args.model, "engine": engine, "label": label, "w_bits": bits, "group_size": group,
                  "settings": settings}
        if not bench.todo(wanted):
            continue  # measure what is missing, or (--recheck) again what is stored
        model, tokenizer = load(args.model)
        if ids is None and engine != "fp":
            ids = calibration_ids(tokenizer, calib)
        load_at_start, wall, cpu, extra = loadavg(), time.perf_counter(), cpu_seconds(), {}
        if engine == "bitquilt":
            quantize(model, config, ids if config.needs_calibration else None, calib_config=calib, progress=False)
            config = config.record()
        elif engine == "autoround":
            config = autoround_quantize(model, tokenizer, ids, bits, group, config)
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        if engine == "autoround":
            extra = {**repack_autoround(model, bits, group), "auto_round": version("auto-round")}
        summary = model_summary(model)
        ppl = perplexity(model, tokenizer, args.ppl_data, args.seqlen, args.ppl_windows, progress=False)
        record = {**wanted, "config": config, "ppl": ppl.ppl, "ppl_seconds": ppl.seconds,
                  "size_mb": summary["size_mb"], "bits_per_weight": summary["bits_per_weight"],
                  "bitquilt_bits_per_weight": summary["bits_per_weight"], **extra,
                  "quant_wall_s": wall if engine != "fp" else None, "quant_cpu_s": cpu if engine != "fp" else None,
                  "loadavg": load_at_start, **host}
        print(f"{engine} {label} {grid_label(bits, group) if bits else ''}: ppl {ppl.ppl:.2f}  "
              f"{record['bits_per_weight']:.3f} bpw  {wall:.0f} s wall  {cpu:.0f} s cpu", flush=True)
        bench.store(record)
        del model


if __name__ == "__main__":
    run(main)
