"""`bitquilt-run`: generate text with a standalone export, without torch.

    bitquilt-run OUT_DIR --prompt "The capital of France is" --max-new-tokens 32 --threads 2

prints the prompt and its continuation as it is generated, then (stderr) what ran (runtime, engine with its kernel
path), the prompt and new token counts, prefill and decode tokens/s, the average bits per weight a MoBiQuant
export's tokens used (`--avg-bits B` routes them to B), the seconds from start to loaded, and the
process's peak resident memory (`--json`: all of it at the end, as JSON). Errors are one line and exit 2
(`bitquilt.errors.run_command`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bitquilt.errors import run_command
from bitquilt.flag_checks import check_flags
from bitquilt.isa import INT8_ISAS
from bitquilt.resources import peak_rss_mb
from bitquilt.runtime.loop import stats_line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bitquilt-run", description="generate text with a standalone export "
                                "(`bitquilt export SAVED -o OUT --to standalone`), without torch")
    p.add_argument("model", help="directory written by `bitquilt export --to standalone`")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above: sampled")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--avg-bits", type=float, metavar="B", help="a MoBiQuant export: route tokens to B bits per "
                   "weight on average (default: the checkpoint's saved thresholds)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (default: every core)")
    p.add_argument("--isa", choices=INT8_ISAS, help="kernel path (default: $BITQUILT_ISA, else the widest)")
    p.add_argument("--json", action="store_true", help="print the completion and figures as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = parser().parse_args(argv)

    def work() -> int:
        from bitquilt.runtime.standalone.generate import generate
        from bitquilt.runtime.standalone.model import StandaloneModel, set_isa, set_threads

        check_flags(args)
        set_threads(args.threads)
        model = StandaloneModel(args.model)
        model.set_avg_bits(args.avg_bits)
        if args.isa:
            set_isa(args.isa)
        loaded = time.perf_counter() - start
        shown = []  # the prompt, then the completion's pieces as they come (nothing before the first token)

        def show(piece: str) -> None:
            print(("" if shown else args.prompt) + piece, end="", flush=True)
            shown.append(piece)

        result = generate(model, args.prompt, args.max_new_tokens, args.temperature, args.seed, args.ignore_eos,
                          None if args.json else show)
        stats = {"runtime": "standalone", **result.stats(), "load_seconds": loaded, "peak_rss_mb": peak_rss_mb()}
        if args.json:
            print(json.dumps({"prompt": args.prompt, "completion": result.text, **stats}, indent=2), flush=True)
        else:
            print("" if shown else args.prompt, flush=True)  # the completion streamed above, then the figures
            print(stats_line(stats), file=sys.stderr)
        return 0

    return run_command("bitquilt-run", work)


if __name__ == "__main__":
    sys.exit(main())
