"""How coarse are the packaged weights already? Distinct values per 32 consecutive weights of a row.

    python bench/upstream_grid.py --models smollm2-135m,qwen2.5-1.5b

The packaged models were dequantized from llama.cpp GGUF files, whose blocks hold 32 (or 16)
weights of a row on one affine grid. A 32-weight run with at most 16 distinct values sits on a
4-bit grid, so a re-quantizer whose groups line up with those blocks gets it almost for free;
17–32 values mean a finer upstream format (5-bit, or 6-bit in 16-weight blocks). This measures,
per linear of every decoder block, the largest and the mean number of distinct values per
32-weight run, and writes bench/results/upstream_grid.md and .json.
"""

from __future__ import annotations

import argparse
import json
import re

import torch
from common import RESULTS, machine, run, write_atomic
from safetensors import safe_open

from bitquilt.models.registry import fetched_dir

BLOCK = 32
LINEAR = re.compile(r"layers\.(\d+)\.(\w+\.\w+_proj)\.weight$")


def levels_per_block(weight: torch.Tensor) -> torch.Tensor:
    """Distinct values in each run of BLOCK consecutive weights of a row."""
    blocks = weight.reshape(-1, BLOCK).sort(dim=1).values
    return (blocks[:, 1:] != blocks[:, :-1]).sum(dim=1) + 1


def survey(name: str) -> list[dict]:
    """One row per linear tensor of the decoder blocks: its largest and mean levels per block."""
    rows = []
    for path in sorted(fetched_dir(name).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                match = LINEAR.search(key)
                if match:
                    levels = levels_per_block(f.get_tensor(key).float())
                    rows.append({"layer": int(match[1]), "linear": match[2], "max_levels": int(levels.max()),
                                 "mean_levels": float(levels.float().mean())})
    return sorted(rows, key=lambda r: (r["layer"], r["linear"]))


def summary(name: str, rows: list[dict]) -> list[str]:
    """Per linear name: how many blocks' tensors sit on a 4-bit grid, a finer one, or none."""
    lines = [f"## {name}", "", "| linear | tensors | max ≤ 16 levels (4-bit grid) | max 17–32 levels (finer grid) "
             "| max > 32 | mean levels |", "|---|---|---|---|---|---|"]
    for linear in dict.fromkeys(r["linear"] for r in rows):
        sel = [r for r in rows if r["linear"] == linear]
        four_bit = sum(r["max_levels"] <= 16 for r in sel)
        finer = sum(16 < r["max_levels"] <= 32 for r in sel)
        mean = sum(r["mean_levels"] for r in sel) / len(sel)
        lines.append(f"| {linear} | {len(sel)} | {four_bit} | {finer} | {len(sel) - four_bit - finer} | {mean:.1f} |")
    return lines + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m,qwen2.5-1.5b")
    args = p.parse_args()
    surveys = {name: survey(name) for name in args.models.split(",")}
    write_atomic(RESULTS / "upstream_grid.json",
                 json.dumps({"machine": machine(), "block": BLOCK, "models": surveys}, indent=1))
    lines = ["# Upstream grids of the packaged weights", "",
             f"`python bench/upstream_grid.py --models {args.models}`", "",
             f"Distinct values (levels) per {BLOCK} consecutive weights of a row, the block of llama.cpp's "
             "4/5/8-bit formats; per decoder-block linear, the number of blocks whose tensor has at most 16 "
             "levels in every run (a 4-bit grid), at most 32, or more, and the mean over runs.", ""]
    for name, rows in surveys.items():
        lines += summary(name, rows)
    write_atomic(RESULTS / "upstream_grid.md", "\n".join(lines))


if __name__ == "__main__":
    run(main)
