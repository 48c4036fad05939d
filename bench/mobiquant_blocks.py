"""MoBiQuant's joint calibration, one block at a time: router-only vs refitting the slices.

    python bench/mobiquant_blocks.py --model smollm2-135m --blocks 0,10

For each chosen decoder block, `--method mobiquant` quantizes that block alone (the others kept in
full precision) on --train windows of calibration text, once with `mobiroute.train_slices=false`
(the routers alone) and once with the default (the slices up to one bit past the budget refitted
on every static prefix, the slices above re-cut). Then on --held windows the block never saw, the
block's mean squared output error against the full-precision block, relative to the mean square of
that output: at every static prefix (k slices) and routed at each --avg-bits (the bits really used
reported). Results: bench/results/mobiquant_blocks.{json,md}.
"""

from __future__ import annotations

import copy
import time

import torch
from common import Bench, command_line, doc_protocol, loadavg, machine, parser, run

from bitquilt.api import load, quantize
from bitquilt.calib.capture import capture_block_inputs, run_block
from bitquilt.calib.reconstruct import block_error
from bitquilt.data.windows import calibration_windows
from bitquilt.models.adapters import architecture_of, decoder_layers
from bitquilt.nn.quant_linear import set_slices
from bitquilt.nn.slice_router import realised_bits, set_precision
from bitquilt.recipes import Recipe

KEY = ("model", "block", "mode", "setup")
MODES = {"router-only": {"train_slices": False}, "refit + re-cut": {"train_slices": True}}


def render(records: list[dict]) -> str:
    lines = ["# MoBiQuant calibration, block by block", "", doc_protocol(__doc__), ""]
    for model, setup in dict.fromkeys((r["model"], r["setup"]) for r in records):
        rows = [r for r in records if (r["model"], r["setup"]) == (model, setup)]
        cols = list(rows[0]["errors"])
        lines += [f"## {model}: {setup}", "",
                  f"Machine: {rows[0]['machine']}; commands: "
                  + ", ".join(f"`{c}`" for c in dict.fromkeys(r["command"] for r in rows)), "",
                  "Relative output error ‖Block_q(x) − Block_fp(x)‖² / ‖Block_fp(x)‖² on held-out windows ("
                  "routed: the bits really used in brackets):", "",
                  "| block | calibration | " + " | ".join(cols) + " | CPU s |", "|---|---|" + "---:|" * (len(cols) + 1)]
        for r in sorted(rows, key=lambda r: (r["block"], r["mode"])):
            cells = [f"{r['errors'][c]:.3g}" + (f" ({r['bits'][c]:.2f})" if c in r["bits"] else "")
                     for c in cols]
            lines.append(f"| {r['block']} | {r['mode']} | " + " | ".join(cells) + f" | {r['cpu_s']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, model="smollm2-135m", threads=1)
    p.add_argument("--blocks", default="0,10")
    p.add_argument("--slices", default="2,1,1,1,1,1,1")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--target-bits", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--avg-bits", default="2.5,3,3.5,4,5")
    p.add_argument("--train", type=int, default=8, help="calibration windows the block is trained on")
    p.add_argument("--held", type=int, default=8, help="held-out windows the errors are measured on")
    p.add_argument("--seqlen", type=int, default=256)
    args = p.parse_args()
    bench = Bench("mobiquant_blocks", KEY, render)
    torch.set_num_threads(args.threads)
    slices = tuple(int(b) for b in args.slices.split(","))
    setup = (f"slices {args.slices} g{args.group_size}, routers at {args.target_bits:g} bits, {args.steps} steps, "
             f"{args.train} + {args.held} windows × {args.seqlen} of sciq")
    model, tokenizer = load(args.model)
    ids = calibration_windows(tokenizer, "sciq", n_samples=args.train + args.held, seqlen=args.seqlen, seed=0)
    train, held = ids[: args.train], ids[args.train:]
    arch = architecture_of(model)
    x, kwargs = capture_block_inputs(model, arch, held)  # x: the inputs of block `at` of the fp model
    blocks, at = decoder_layers(model, arch), 0
    for index in sorted(int(b) for b in args.blocks.split(",")):
        for i in range(at, index):
            x = run_block(blocks[i], x, kwargs[i])
        at = index
        targets = run_block(blocks[index], x, kwargs[index])
        scale = sum(float(y.float().pow(2).sum()) for y in targets) / sum(y.numel() for y in targets)
        skip = tuple(f"{arch.layers}.{i}.*" for i in range(len(blocks)) if i != index)
        for mode, route in MODES.items():
            wanted = {"model": args.model, "block": index, "mode": mode, "setup": setup}
            if not bench.todo({**wanted, "settings": None}):
                continue
            q = copy.deepcopy(model)
            c0 = time.process_time()
            quantize(q, Recipe("mobiquant", w_bits=sum(slices), group_size=args.group_size, options={"slices": slices},
                               skip=skip, stage_options={"mobiroute": {"target_bits": args.target_bits,
                                                                       "steps": args.steps, **route}}),
                     train, progress=False)
            cpu = time.process_time() - c0
            block = decoder_layers(q, arch)[index]
            errors, bits = {}, {}
            for k in range(1, len(slices) + 1):
                set_slices(block, k)
                errors[f"static {sum(slices[:k])}"] = block_error(block, x, targets, kwargs[index]) / scale
            set_slices(block, None)
            for b in (float(v) for v in args.avg_bits.split(",")):
                set_precision(block, b)
                with realised_bits(block) as used:
                    errors[f"routed {b:g}"] = block_error(block, x, targets, kwargs[index]) / scale
                bits[f"routed {b:g}"] = used["avg_bits"]
            print(f"block {index} {mode}: {errors}", flush=True)
            bench.store({**wanted, "settings": None, "errors": errors, "bits": bits, "cpu_s": cpu,
                         "machine": machine(), "load": loadavg(), "command": command_line()})
            del q


if __name__ == "__main__":
    run(main)
