"""What quantizing the LM head and input embeddings costs: RTN W4 g128 with `--head-bits` 16 / 8 / 4.

    python bench/head_bits.py --model smollm2-135m --threads 1

Each configuration is quantized from the packaged model (RTN, no calibration), saved with `bitquilt.save` into a
temporary directory, and evaluated on the same perplexity windows. Reported: the saved weights file's size, the
bits per weight of the quantized matrices as `model_summary` counts them (the linears, plus the head and
embeddings when quantized, a tied pair once), the whole file's bits over every parameter of the model (a tied pair
once: what a full-precision table costs the file), and perplexity. *head4 g32* is the 4-bit head in groups of 32
(`--head-group-size 32`); *fp* the packaged model, its fp32 tensors' size. Results: bench/results/head_bits.{json,md}.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common import doc_protocol, fmt_ppl, parser, ppl_bench, run, sections, stamp

from bitquilt.api import load, model_summary, quantize, save
from bitquilt.eval import perplexity
from bitquilt.recipes import Recipe

CONFIGS = {"fp": None,
           "head16": Recipe("rtn", w_bits=4, group_size=128),
           "head8": Recipe("rtn", w_bits=4, group_size=128, head_bits=8),
           "head4": Recipe("rtn", w_bits=4, group_size=128, head_bits=4),
           "head4 g32": Recipe("rtn", w_bits=4, group_size=128, head_bits=4, head_group_size=32)}
KEY = ("model", "config")


def render(records: list[dict]) -> str:
    lines = ["# LM head and embeddings: size and perplexity", "", doc_protocol(__doc__), ""]
    for _model, _settings, rows, header in sections(records):
        lines += header
        lines += ["| configuration | saved MB | bits/weight, quantized matrices | bits/weight, whole file | ppl |",
                  "|---|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['config']} | {r['file_mb']:.1f} | {r['bits_per_weight']:.2f} | "
                         f"{r['file_bits_per_weight']:.2f} | {fmt_ppl(r['ppl'])} |")
        lines.append("")
    return "\n".join(lines)


def saved_file_mb(model, tokenizer) -> float:
    """The size of the weights file `bitquilt.save` writes for `model`, in MiB."""
    with tempfile.TemporaryDirectory(prefix="bitquilt-head-bits-") as tmp:
        directory = save(model, Path(tmp) / "model", tokenizer)
        return sum(f.stat().st_size for f in directory.glob("*.safetensors")) / 2**20


def main() -> None:
    p = parser(__doc__, model="smollm2-135m")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    # the calibration flags unused: RTN
    args, _, settings, bench = ppl_bench(p, "head_bits", KEY, render, calib_samples=1, ppl_windows=8)
    settings.pop("calibration")  # RTN: none
    for config in args.configs.split(","):
        record = {"model": args.model, "config": config, "settings": settings}
        if not bench.todo(record):
            continue
        model, tokenizer = load(args.model)
        parameters = sum(t.numel() for t in model.parameters())  # a tied head and table counted once
        if CONFIGS[config] is not None:
            quantize(model, CONFIGS[config], None, progress=False)
        file_mb = saved_file_mb(model, tokenizer) if CONFIGS[config] else model_summary(model)["size_mb"]
        t0 = time.perf_counter()
        ppl = perplexity(model, tokenizer, args.ppl_data, args.seqlen, args.ppl_windows, progress=False).ppl
        record.update(ppl=ppl, eval_s=time.perf_counter() - t0, file_mb=file_mb,
                      file_bits_per_weight=file_mb * 2**20 * 8 / parameters, **model_summary(model),
                      **stamp())
        print(f"{config:10s} {file_mb:7.1f} MB  ppl {ppl:.3f}", flush=True)
        bench.store(record)


if __name__ == "__main__":
    run(main)
