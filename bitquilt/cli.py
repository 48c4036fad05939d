"""The `bitquilt` command line: models, fetch, quantize, eval, compare, analyze, inspect, export (`bitquilt.commands`),
generate, bench and serve (here).

generate, bench and serve run a saved model: they parse with a parser of their own and never import `bitquilt.commands`,
so the process that answers a prompt holds no calibration or quantization code (nor transformers, in the bitquilt
runtime)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from bitquilt.cli_common import (
    MODEL_HELP,
    add_int8_activations,
    add_runtime,
    add_threads,
    chosen_runtime,
    print_json,
    print_table,
    set_threads,
)
from bitquilt.errors import UserError, run_command
from bitquilt.flag_checks import check_flags, in_routed_range
from bitquilt.io import model_summary
from bitquilt.runtime.engines import ENGINES
from bitquilt.runtime.loop import stats_line

RUN_COMMANDS = ("generate", "bench", "serve")
LOOPBACK = ("127.0.0.1", "localhost", "::1")

def _runtime(args) -> str:
    """The runtime `--runtime` and `--engine` load a saved model into (the transformers engine needs the transformers
    model)."""
    return chosen_runtime(args, "--engine transformers runs the transformers model; drop --runtime bitquilt or pick "
                          "another engine (auto, fused, lean)" if args.engine == "transformers" else None)


def cmd_generate(args) -> int:
    if not args.prompt:
        raise UserError("--prompt is empty; give the text to continue")
    if _is_standalone_export(args.model):
        return _generate_standalone(args)
    import torch

    from bitquilt.io import load
    from bitquilt.runtime.engines import decode
    from bitquilt.runtime.loop import generation_stats
    from bitquilt.runtime.module_tree import ModuleTreeLM

    set_threads(args.threads)
    model, tokenizer = load(args.model, _runtime(args))
    if tokenizer is None:
        raise UserError(f"{args.model} has no tokenizer files; cannot generate text")
    _set_avg_bits(model, args.avg_bits)
    ids = torch.tensor([tokenizer(args.prompt)["input_ids"]])
    run = decode(model, ids, args.max_new_tokens, args.temperature, args.seed,
                 stop_ids=None if args.ignore_eos or tokenizer.eos_token_id is None else {tokenizer.eos_token_id},
                 engine=args.engine)
    text = tokenizer.decode(run.new_ids, skip_special_tokens=True)
    runtime = "bitquilt" if isinstance(model, ModuleTreeLM) else "transformers"
    _print_generation(args, text, {"runtime": runtime, "engine": run.engine, **generation_stats(ids.shape[1], run)})
    return 0


def _set_avg_bits(model, avg_bits: float | None) -> None:
    """Route a MoBiQuant model's tokens to `avg_bits` bits per weight on average (--avg-bits; None: its saved
    thresholds); UserError for a model without routers or a value outside its range."""
    if avg_bits is None:
        return
    from bitquilt.nn.slice_router import has_routers, precision_range, set_precision

    if not has_routers(model):
        raise UserError("--avg-bits needs a MoBiQuant model (per-token slice routers); this model has none")
    low, high = precision_range(model)
    if not in_routed_range(avg_bits, low, high):
        raise UserError(f"--avg-bits {avg_bits:g} is outside this checkpoint's routed range [{low:.2f}, {high:.2f}]")
    set_precision(model, avg_bits)


def _elastic(routed_range: tuple[float, float] | None, target: float | None, avg_bits: float | None):
    """serve's elastic controller for --elastic TARGET (None without it) within the model's routed range, starting at
    --avg-bits or the checkpoint's highest routed bits, its ceiling; UserError for a model without routers."""
    if target is None:
        return None
    from bitquilt.serve.elastic import ElasticController

    if routed_range is None:
        raise UserError("--elastic needs a MoBiQuant model (per-token slice routers); this model has none")
    low, high = routed_range
    return ElasticController(target, low, high if avg_bits is None else avg_bits)


def _is_standalone_export(model: str) -> bool:
    from bitquilt.runtime.standalone.model import FILE

    return (Path(model) / FILE).is_file()


def _standalone(args, model: str):
    """A standalone export (`bitquilt export --to standalone`) for `generate`, `bench` or `serve`, in the standalone
    runtime (int8 activations; no engine or runtime to choose) on --threads (default: every core)."""
    if args.engine != "auto" or args.runtime != "auto":
        raise UserError(f"{model} is a standalone export, which runs in the standalone runtime only; drop "
                        "--engine and --runtime")
    from bitquilt.runtime.standalone.model import StandaloneModel
    from bitquilt.runtime.standalone.model import set_threads as set_standalone_threads

    set_standalone_threads(args.threads or os.cpu_count() or 1)
    return StandaloneModel(model)


def _generate_standalone(args) -> int:
    """`generate` of a standalone export: the standalone runtime's, as `bitquilt-run`."""
    from bitquilt.runtime.standalone.generate import generate

    model = _standalone(args, args.model)
    model.set_avg_bits(args.avg_bits)
    result = generate(model, args.prompt, args.max_new_tokens, args.temperature, args.seed, args.ignore_eos)
    _print_generation(args, result.text, {"runtime": "standalone", **result.stats()})
    return 0


def _print_generation(args, text: str, stats: dict) -> None:
    if args.json:
        print_json({"prompt": args.prompt, "completion": text, **stats})
    else:
        print(args.prompt + text, flush=True)
        print(stats_line(stats), file=sys.stderr)


def cmd_bench(args) -> int:
    from bitquilt.eval.speed import measure_speed
    from bitquilt.io import load
    from bitquilt.resources import reset_peak_rss
    from bitquilt.runtime.loop import check_speed_settings

    check_speed_settings(args.prompt_tokens, args.new_tokens, args.repeats)
    set_threads(args.threads)
    rows = []
    for spec in args.models:
        reset_peak_rss()
        if _is_standalone_export(spec):  # the standalone runtime's measurement, same protocol and fields
            from bitquilt.runtime.standalone.generate import measure_speed as measure_standalone

            model = _standalone(args, spec)
            row = {"model": spec, "size_mb": model.size_mb(), "bits_per_weight": model.bits_per_weight(),
                   **measure_standalone(model, args.prompt_tokens, args.new_tokens, args.repeats)}
        else:
            model, _ = load(spec, _runtime(args))
            result = measure_speed(model, model.config.vocab_size, args.prompt_tokens, args.new_tokens, args.repeats,
                                   engine=args.engine)
            row = {"model": spec, **model_summary(model), **result.to_dict()}
        if rows:
            row["decode_speedup"] = row["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
            row["prefill_speedup"] = row["prefill_tokens_per_s"] / rows[0]["prefill_tokens_per_s"]
        rows.append(row)
        del model
    if args.json:
        print_json(rows)
    else:
        print_table(rows, ["model", "bits_per_weight", "weights_mb", "kernel_layout_mb", "peak_rss_mb",
                            "prefill_tokens_per_s", "decode_tokens_per_s", "prefill_speedup", "decode_speedup"])
        print(f"{args.prompt_tokens}-token random prompt, {args.new_tokens} decode steps, batch 1, "
              f"median of {args.repeats}, {rows[0]['threads']} threads; speedups relative to the first model")
    return 0


def cmd_serve(args) -> int:
    """Serve a model over HTTP, OpenAI's API (`bitquilt.serve`), until Ctrl-C: a saved model in its runtime's batch
    (`bitquilt.runtime.batch`), a standalone export in the standalone runtime's (`runtime.standalone.batch`)."""
    try:
        from bitquilt.serve.app import Server, bind, run
        from bitquilt.serve.caller_thread import CallerThreadExecutor
    except ImportError as e:
        raise UserError(f"bitquilt serve needs the serve extra ({e.name} is missing): pip install "
                        "'bitquilt[serve]'") from None
    from bitquilt.serve.chat import ChatTemplate
    from bitquilt.serve.protocol import Limits
    from bitquilt.serve.worker import Worker

    api_key = args.api_key if args.api_key is not None else os.environ.get("BITQUILT_API_KEY")
    if api_key == "":
        raise UserError("--api-key is empty; give the key clients must send, or leave it out")
    sock = bind(args.host, args.port)
    longest = args.max_prompt_tokens + args.max_tokens  # a sequence's positions: prompt and new tokens
    served = _served_standalone if _is_standalone_export(args.model) else _served_saved
    batch, tokenizer, positions, directory, name = served(args, longest)
    if tokenizer is None:
        raise UserError(f"{args.model} has no tokenizer files; cannot serve text")
    elastic = _elastic(batch.routed_range, args.elastic, args.avg_bits)
    limits = Limits(args.max_prompt_tokens, args.max_tokens, args.max_body_bytes)
    chat = ChatTemplate(directory, getattr(tokenizer, "bos_token", None), tokenizer.eos_token)
    steps = CallerThreadExecutor()  # the batch steps on this thread, which loaded the model (`run`)
    worker = Worker(batch, tokenizer, args.max_queue, args.max_batch, elastic, steps)
    server = Server(worker, chat, name, limits, positions, api_key)
    if args.host not in LOOPBACK and api_key is None:
        print(f"bitquilt serve: warning: {args.host} is reachable from other machines and no --api-key is set",
              file=sys.stderr)
    print(f"bitquilt serve: {name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    run(server, sock, steps)
    return 0


def _served_saved(args, longest: int):
    """serve's batch of a saved or packaged model (sequences of up to `longest` positions, within the model's), its
    tokenizer, positions, directory and name."""
    from bitquilt.io import load
    from bitquilt.models.loading import resolve_path
    from bitquilt.models.registry import MODELS
    from bitquilt.runtime.batch import Batch
    from bitquilt.runtime.engines import stepper

    set_threads(args.threads)
    model, tokenizer = load(args.model, _runtime(args))
    _set_avg_bits(model, args.avg_bits)
    stepper(model, 2, args.engine)  # an engine that cannot run the model says so now, not at the first request
    positions = getattr(model.config, "max_position_embeddings", None)
    batch = Batch(model, longest if positions is None else min(positions, longest), args.engine)
    name = args.model if args.model in MODELS else Path(args.model).name
    return batch, tokenizer, positions, resolve_path(args.model), name


def _served_standalone(args, longest: int):
    """serve's batch of a standalone export in the standalone runtime, as `_served_saved`."""
    from bitquilt.runtime.standalone.batch import StandaloneBatch

    model = _standalone(args, args.model)
    model.set_avg_bits(args.avg_bits)
    return StandaloneBatch(model), model.tokenizer, model.max_positions, model.directory, Path(args.model).name


def _add_engine(s: argparse.ArgumentParser) -> None:
    """--engine of the decoding commands (generate, bench, serve)."""
    s.add_argument("--engine", choices=ENGINES, default="auto",
                   help="decode loop: lean (static KV cache, the model's modules without transformers' per-layer "
                   "glue; llama/mistral/qwen2/qwen3), fused (lean, with every decoder layer of a one-token step in "
                   "one compiled call: weight-only models), transformers, or auto (the first of fused, lean, "
                   "transformers that runs the model; default)")
    add_runtime(s, "bitquilt where it covers the model; default; transformers with --engine transformers")


def _add_avg_bits(s: argparse.ArgumentParser, what: str) -> None:
    """--avg-bits of generate and serve."""
    s.add_argument("--avg-bits", type=float, metavar="B", help=f"a MoBiQuant model: route {what} to B bits per weight "
                   "on average (default: the checkpoint's saved thresholds)")


def _add_run_commands(sub: argparse._SubParsersAction) -> None:
    """Register generate, bench and serve on `sub`."""
    model_help = MODEL_HELP

    s = sub.add_parser("generate", help="continue a prompt with a model (greedy by default) and report tokens/s")
    s.add_argument("model", help=model_help)
    s.add_argument("--prompt", required=True, help="text to continue")
    s.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    s.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    _add_avg_bits(s, "its tokens")
    _add_engine(s)
    add_int8_activations(s)
    add_threads(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("bench", help="prefill and batch-1 decode tokens/s and memory of one or more models")
    s.add_argument("models", nargs="+", metavar="model",
                   help=model_help + ", or a standalone export (`export --to standalone`: run in the standalone "
                   "runtime); speedups are relative to the first, e.g. `bench smollm2-135m out/q4 out/q4-run`")
    s.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for prefill (default 128)")
    s.add_argument("--new-tokens", type=int, default=32, help="decode steps per run (default 32)")
    s.add_argument("--repeats", type=int, default=3, help="runs per model; the median is reported (default 3)")
    _add_engine(s)
    add_int8_activations(s)
    add_threads(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("serve", help="serve a model over HTTP with OpenAI's API (needs the serve extra; docs/serve.md)")
    s.add_argument("model", help=model_help + ", or a standalone export (run in the standalone runtime)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--api-key", default=None, help="the key clients must send as `Authorization: Bearer KEY` "
                   "(default: $BITQUILT_API_KEY if set, else none)")
    s.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait for the model; more are refused with 503 at once (default 16)")
    s.add_argument("--max-batch", type=int, default=8,
                   help="requests decoded at once, a token each per step, one kernel call per linear for all of "
                   "them; waiting ones join as others end (default 8)")
    s.add_argument("--max-prompt-tokens", type=int, default=4096, help="longest prompt in tokens (default 4096)")
    s.add_argument("--max-tokens", type=int, default=1024, help="most new tokens a request may ask (default 1024)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    _add_avg_bits(s, "requests without their own avg_bits")
    s.add_argument("--elastic", type=float, metavar="TOK_S",
                   help="a MoBiQuant model: lower the bits of requests without their own avg_bits while each stream "
                   "decodes under TOK_S tokens/s, raise them again as load drops, up to --avg-bits (default: the "
                   "checkpoint's highest); docs/serve.md")
    _add_engine(s)
    add_int8_activations(s)
    add_threads(s)
    s.set_defaults(fn=cmd_serve)


def build_parser(full: bool = True) -> argparse.ArgumentParser:
    """The command line's parser: every command, or (full=False) only generate, bench and serve."""
    p = argparse.ArgumentParser(prog="bitquilt", description="Post-training quantization of LLMs.")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    if full:
        from bitquilt.commands import add_commands

        add_commands(sub)
    _add_run_commands(sub)
    return p


def _command(argv: list[str]) -> str | None:
    """The command word of `argv` (its first argument that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(full=_command(argv) not in RUN_COMMANDS).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def work() -> int:
        check_flags(args)  # before anything is loaded (recipe flags: when the recipe is built)
        if not getattr(args, "int8_activations", False):
            return args.fn(args)
        from bitquilt import kernels

        with kernels.using(int8_activations=True):
            return args.fn(args)

    return run_command(f"bitquilt {args.command}", work, args.debug)


if __name__ == "__main__":
    sys.exit(main())
