"""How concentrated the Hessian diagonal is: the share of Σ_j H_jj in a linear's top columns.

    python bench/hessian_concentration.py --models smollm2-135m,qwen2.5-0.5b

MXSens gives a linear's top 32 columns by H_jj = Σ_t x_tj² 8 bits and a middle class 6 bits; how
much that buys depends on how much of Σ_j H_jj those columns hold. For q/o/up/down of the first,
middle and last decoder block, over --windows calibration windows: the share of the top 32 columns
and of the next 12.5% of the columns. Results: bench/results/hessian_concentration.{json,md}.
"""

from __future__ import annotations

import json
import statistics

import torch
from common import RESULTS, doc_protocol, finish, parser, run, run_facts, run_header, write_atomic

from bitquilt.api import load
from bitquilt.calib.capture import capture_block_inputs, feed_linears, run_block
from bitquilt.data.windows import calibration_windows
from bitquilt.models.adapters import architecture_of, decoder_layers

LINEARS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")


@torch.no_grad()
def concentration(model_name: str, windows: int) -> dict[str, tuple[float, float]]:
    """{block.linear: (top-32 share, next-12.5% share)} of Σ_j H_jj."""
    model, tokenizer = load(model_name)
    ids = calibration_windows(tokenizer, "sciq", n_samples=windows, seqlen=512, seed=0)
    arch = architecture_of(model)
    blocks = decoder_layers(model, arch)
    x, kwargs = capture_block_inputs(model, arch, ids)
    picks = (0, len(blocks) // 2, len(blocks) - 1)
    diag: dict[str, torch.Tensor] = {}
    for i in range(picks[-1] + 1):
        if i in picks:
            def add(name: str, h: torch.Tensor, i: int = i) -> None:
                diag[f"{i}.{name}"] = diag.get(f"{i}.{name}", 0) + h.reshape(-1, h.shape[-1]).float().pow(2).sum(0)
            feed_linears(blocks[i], list(LINEARS), x, kwargs[i], add)
        x = run_block(blocks[i], x, kwargs[i])
    shares = {}
    for key, h in diag.items():
        s = h.sort(descending=True).values
        shares[key] = (float(s[:32].sum() / s.sum()), float(s[32:32 + s.numel() // 8].sum() / s.sum()))
    return shares


def main() -> None:
    p = parser(__doc__, models="smollm2-135m,qwen2.5-0.5b", threads=1)
    p.add_argument("--windows", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    facts = run_facts()
    results = {m: concentration(m, args.windows) for m in args.models.split(",")}
    finish(facts)
    lines = ["# Hessian-diagonal concentration", "", doc_protocol(__doc__), "", run_header(facts), "",
             "| model | linear | top-32 share | next 12.5% share |", "|---|---|---:|---:|"]
    for model, shares in results.items():
        lines += [f"| {model} | {k} | {a:.3f} | {b:.3f} |" for k, (a, b) in shares.items()]
    lines += ["", "Median top-32 share: " + ", ".join(
        f"{m} {statistics.median(a for a, _ in s.values()):.3f}" for m, s in results.items()) + ".", ""]
    write_atomic(RESULTS / "hessian_concentration.json", json.dumps({"results": results, **facts}, indent=1))
    write_atomic(RESULTS / "hessian_concentration.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    run(main)
