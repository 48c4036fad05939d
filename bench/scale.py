"""An 8B-class model quantized with --stream: wall and CPU time per block, peak RSS, disk written.

    python bench/scale.py --layers 2 --calib-samples 64   # the per-block cost at the default calibration
    python bench/scale.py --calib-samples 8               # all 32 blocks end to end: memory, disk, every block

There is no 8B checkpoint to download here, so the bench writes one: Llama-3-8B's config (32 layers, hidden 4,096, MLP
14,336, 32/8 heads, vocabulary 128,256, rope_theta 500,000, untied LM head; `--layers` and the widths are options)
with random bf16 weights (normal, std 0.02, norms 1; a seeded generator per shard, written tensor by tensor so memory
stays low) as sharded safetensors in the Hugging Face layout (model-0000X-of-0000N.safetensors,
model.safetensors.index.json, config.json) with smollm2-135m's tokenizer (its ids are below the vocabulary), under
--ckpt-root, and reuses it while its config and shard sizes match. Timing does not depend on the values; accuracy is
not claimed.

The run is what `bitquilt quantize CKPT --stream --method awq+gptq --w-bits 4 --group-size 128 --calib-dtype auto`
runs (`bitquilt.open_streaming` with the output's folder as its spill directory, as the CLI does, unless --no-spill;
`bitquilt.quantize_streaming`, then `bitquilt.save`), on sciq calibration windows, in a child process with
--threads threads: its wall and CPU seconds and peak RSS (ru_maxrss from wait4) over the whole run, every block's
wall and CPU seconds (the engine's per-block report, stored in the results as each block ends, so a run cut short
keeps its blocks) and resident memory at its end, and the bytes of the saved model, which is deleted once measured.
Before the child starts, one thread's 2048² matmul rate in fp32 and bf16. The report extrapolates, with the formulas
it shows, a block's CPU time as a + b·T over T calibration tokens from the blocks measured at the smallest and largest
calibration sizes (the two runs above, or a 2-block run at each size), the 32-block time and memory at the largest,
and time and memory of Llama-3-70B's shape. Results: bench/results/scale.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import torch
from common import Bench, finish, intro, loadavg, parser, run, run_child, run_facts, run_header
from quant_time import matmul_gflops

from bitquilt.recipes import Recipe

LLAMA3_8B = {"hidden": 4096, "mlp": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256}
LLAMA3_8B_LAYERS = 32  # what the 8B-shaped runs extrapolate to (--layers may be fewer)
LLAMA3_70B = {"layers": 80, "hidden": 8192, "mlp": 28672, "heads": 64, "kv_heads": 8, "vocab": 128256}
FIELDS = ("model", "layers", "calibration")
BF16_BYTES = 2
GB = 1e9
CHUNK = 1 << 26  # values generated and written at a time


# ---------------------------------------------------------------------------------------- the random checkpoint
def widths(args: argparse.Namespace) -> dict[str, int]:
    return {k: getattr(args, k) for k in LLAMA3_8B}


def model_label(shape: dict[str, int]) -> str:
    if shape == LLAMA3_8B:
        return "Llama-3-8B shape"
    return "llama h{hidden} mlp{mlp} heads{heads}/{kv_heads} vocab{vocab}".format(**shape)


def hf_config(shape: dict[str, int], layers: int) -> dict:
    """Llama-3-8B's config.json with the given widths and layer count (bos/eos: the Llama defaults, 1 and 2, which
    are the copied tokenizer's)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "attention_dropout": 0.0, "mlp_bias": False, "hidden_act": "silu", "hidden_size": shape["hidden"],
            "intermediate_size": shape["mlp"], "num_hidden_layers": layers, "num_attention_heads": shape["heads"],
            "num_key_value_heads": shape["kv_heads"], "vocab_size": shape["vocab"], "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "initializer_range": 0.02, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "use_cache": True}


def tensor_shapes(shape: dict[str, int], layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the Llama checkpoint, in the order Hugging Face stores them."""
    h, m, kv = shape["hidden"], shape["mlp"], shape["kv_heads"] * shape["hidden"] // shape["heads"]
    block = [("input_layernorm.weight", (h,)), ("self_attn.q_proj.weight", (h, h)),
             ("self_attn.k_proj.weight", (kv, h)), ("self_attn.v_proj.weight", (kv, h)),
             ("self_attn.o_proj.weight", (h, h)), ("post_attention_layernorm.weight", (h,)),
             ("mlp.gate_proj.weight", (m, h)), ("mlp.up_proj.weight", (m, h)), ("mlp.down_proj.weight", (h, m))]
    return ([("model.embed_tokens.weight", (shape["vocab"], h))]
            + [(f"model.layers.{i}.{name}", s) for i in range(layers) for name, s in block]
            + [("model.norm.weight", (h,)), ("lm_head.weight", (shape["vocab"], h))])


def shards(tensors: list[tuple[str, tuple[int, ...]]], max_bytes: float) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors split into consecutive shards of at most `max_bytes` (one tensor alone may exceed it), as
    transformers' save_pretrained splits them."""
    out: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, s in tensors:
        n = math.prod(s) * BF16_BYTES
        if out[-1] and size + n > max_bytes:
            out.append([])
            size = 0
        out[-1].append((name, s))
        size += n
    return out


def shard_header(tensors: list[tuple[str, tuple[int, ...]]]) -> bytes:
    """A safetensors header (length prefix included) for bf16 tensors stored back to back."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, s in tensors:
        n = math.prod(s) * BF16_BYTES
        header[name] = {"dtype": "BF16", "shape": list(s), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    """One safetensors file of random bf16 weights (norms 1), generated CHUNK values at a time."""
    gen = torch.Generator().manual_seed(seed)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(shard_header(tensors))
        for _, s in tensors:
            if len(s) == 1:
                f.write(torch.ones(s, dtype=torch.bfloat16).view(torch.uint8).numpy())
                continue
            rows = max(1, CHUNK // s[1])
            for start in range(0, s[0], rows):
                chunk = torch.empty(min(rows, s[0] - start), s[1], dtype=torch.bfloat16).normal_(0, 0.02,
                                                                                                 generator=gen)
                f.write(chunk.view(torch.uint8).numpy())
    os.replace(tmp, path)


def checkpoint(args: argparse.Namespace) -> tuple[Path, dict]:
    """The random checkpoint of this shape (written unless one with the same config and shard sizes is there) and
    what it is: parameters, bytes, shards, seconds to write it (0 when reused)."""
    from bitquilt.models.loading import TOKENIZER_FILES, resolve_path

    shape = widths(args)
    name = "llama-L{layers}-h{hidden}-m{mlp}-a{heads}-kv{kv_heads}-v{vocab}".format(layers=args.layers, **shape)
    folder, config = Path(args.ckpt_root) / name, hf_config(shape, args.layers)
    tensors = tensor_shapes(shape, args.layers)
    parts = shards(tensors, args.shard_gb * GB)
    files = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    sizes = [len(shard_header(p)) + sum(math.prod(s) for _, s in p) * BF16_BYTES for p in parts]
    info = {"path": str(folder), "params": sum(math.prod(s) for _, s in tensors), "bytes": sum(sizes),
            "shards": len(parts)}
    config_file = folder / "config.json"
    if (config_file.is_file() and json.loads(config_file.read_text()) == config
            and all((folder / f).is_file() and (folder / f).stat().st_size == n for f, n in zip(files, sizes))):
        return folder, {**info, "write_s": 0}
    print(f"writing {folder} ({info['bytes'] / GB:.1f} GB in {len(parts)} shards)", flush=True)
    t0 = time.perf_counter()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for i, (part, file) in enumerate(zip(parts, files)):
        write_shard(folder / file, part, args.seed + i)
    index = {"metadata": {"total_size": sum(math.prod(s) for _, s in tensors) * BF16_BYTES},
             "weight_map": {n: file for part, file in zip(parts, files) for n, _ in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    source = resolve_path(args.tokenizer_from)
    for f in TOKENIZER_FILES:
        if (source / f).is_file():
            shutil.copy(source / f, folder / f)
    config_file.write_text(json.dumps(config, indent=2))  # last: a checkpoint cut short is not reused
    return folder, {**info, "write_s": round(time.perf_counter() - t0)}


# ------------------------------------------------------------------------------------------------ the run
def recipe(args: argparse.Namespace) -> Recipe:
    return Recipe(args.method, w_bits=4, group_size=128)


def wanted(args: argparse.Namespace) -> dict:
    """The record's key: model shape, blocks, calibration (none for a recipe without), and the settings it was
    measured with."""
    calibrated = recipe(args).needs_calibration
    return {"model": model_label(widths(args)), "layers": args.layers,
            "calibration": f"{args.calib_samples} × {args.calib_seqlen}" if calibrated else "none",
            "settings": {"method": f"{args.method} W4g128", "calib_dtype": args.calib_dtype if calibrated else None,
                         "threads": args.threads, "shape": widths(args), "spill": not args.no_spill}}


def output_dir(args: argparse.Namespace) -> Path:
    return Path(args.ckpt_root) / f"out-{args.method}-L{args.layers}-{args.calib_samples}x{args.calib_seqlen}"


def rss_mb() -> float:
    """This process's resident memory now, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def worker(args: argparse.Namespace, bench: Bench) -> None:
    """The child: stream-quantize the checkpoint and save it, storing each block's seconds as it ends."""
    from bitquilt.api import open_streaming, quantize_streaming, save
    from bitquilt.calib.report import QuantReport
    from bitquilt.cli_common import set_threads
    from bitquilt.recipes import CalibConfig

    set_threads(args.threads)
    record = bench.stored(wanted(args))

    def on_block(i: int, report: QuantReport) -> None:
        solve = sum(r.seconds for r in report.linears if r.name.startswith(f"{stream.arch.layers}.{i}."))
        record["blocks"].append({"block": i, "wall_s": round(report.block_seconds[-1], 1),
                                 "cpu_s": round(report.block_cpu_seconds[-1], 1), "solve_wall_s": round(solve, 1),
                                 "rss_mb": round(rss_mb()), "loadavg": loadavg()})
        bench.store(record)

    t0 = time.perf_counter()
    stream = open_streaming(args.ckpt, spill_dir=None if args.no_spill else output_dir(args).parent)
    t1 = time.perf_counter()
    model, tokenizer, report = quantize_streaming(
        stream, recipe(args), CalibConfig("sciq", args.calib_samples, args.calib_seqlen, 0),
        progress=False, calib_dtype=args.calib_dtype, on_block=on_block)
    t2 = time.perf_counter()
    save(model, output_dir(args), tokenizer=tokenizer)
    print(json.dumps({"open_s": round(t1 - t0, 1), "quantize_s": round(t2 - t1, 1),
                      "engine_s": round(report.total_seconds, 1), "save_s": round(time.perf_counter() - t2, 1),
                      "compute": report.compute}))


def measure(args: argparse.Namespace, bench: Bench) -> None:
    folder, info = checkpoint(args)
    out = output_dir(args)
    shutil.rmtree(out, ignore_errors=True)  # a run cut short left it
    facts = run_facts()
    gflops = {"fp32": round(matmul_gflops(torch.float32)), "bf16": round(matmul_gflops(torch.bfloat16))}
    record = {**wanted(args), "status": "incomplete", "checkpoint": info, "gflops": gflops, "blocks": [], **facts}
    bench.store(record)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    child = run_child([sys.executable, __file__, *sys.argv[1:], "--ckpt", str(folder), "--worker"], env)
    record = {**bench.stored(record), **finish(facts), "wall_s": round(child.wall_s), "cpu_s": round(child.cpu_s),
              "peak_rss_mb": round(child.peak_rss_mb)}
    if child.returncode == 0:
        written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        record.update(status="done", disk_written_bytes=written, **json.loads(child.stdout.strip().splitlines()[-1]))
    else:
        last = child.stderr.strip().splitlines()[-1:] or [f"killed by signal {-child.returncode}"]
        record.update(status=f"failed (exit {child.returncode}): {last[0][:300]}")
    shutil.rmtree(out, ignore_errors=True)
    bench.store(record)
    print(f"{record['model']}, {args.layers} blocks, {record['calibration']}: {record['status']}, wall "
          f"{record['wall_s']} s, CPU {record['cpu_s']} s, peak RSS {record['peak_rss_mb']} MB", flush=True)


# --------------------------------------------------------------------------------------------- the report
ABOUT = """\
Generated by `bench/scale.py`. A Llama-3-8B-shaped checkpoint (32 layers, hidden 4,096, MLP 14,336, 32/8 heads,
vocabulary 128,256, untied LM head) with random bf16 weights, written as sharded safetensors in the Hugging Face
layout, is quantized with `--stream` and the fast recipe, `awq+gptq` W4 g128 with `--calib-dtype auto`, on SciQ
calibration windows of the given size, in a child process. *wall*, *CPU* (user + system, all threads) and *peak RSS*
(ru_maxrss) are the child's over the whole run: opening the checkpoint, building the calibration windows, every block,
the LM head and the save. *disk written*: the saved model's bytes (deleted after). The per-block tables are the
engine's own per-block wall and CPU seconds, and the child's resident memory as each block ended. Timing does not
depend on the weights' values; accuracy is not claimed. A run marked *incomplete* was cut short (or is running): its
blocks so far are kept.
"""


def block_params(s: dict[str, int]) -> int:
    """Weights of one block's linears."""
    kv = s["kv_heads"] * s["hidden"] // s["heads"]
    return s["hidden"] * (2 * s["hidden"] + 2 * kv) + 3 * s["hidden"] * s["mlp"]


def block_sweep(s: dict[str, int]) -> int:
    """Σ out · in² over one block's linears: the calibration-size-independent work (GPTQ's Cholesky and column sweep,
    AWQ's tr(D H Dᵀ) per candidate scale)."""
    h, m, kv = s["hidden"], s["mlp"], s["kv_heads"] * s["hidden"] // s["heads"]
    return (2 * h + 2 * kv) * h * h + 2 * m * h * h + h * m * m


def tokens(r: dict) -> int:
    if r["calibration"] == "none":
        return 0
    n, seqlen = r["calibration"].split(" × ")
    return int(n) * int(seqlen)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def run_rows(records: list[dict]) -> list[str]:
    lines = ["| blocks | calibration | status | wall s | CPU s | peak RSS MiB | quantize s | save s | disk written GB "
             "| checkpoint GB (shards) | matmul GFLOPS fp32 / bf16, 1 thread | calibration ran in | load average |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    for r in records:
        status = r["status"] if r["status"] != "incomplete" else f"incomplete ({len(r['blocks'])} blocks stored)"
        disk = f"{r['disk_written_bytes'] / GB:.2f}" if "disk_written_bytes" in r else ""
        compute = r.get("compute") if r["calibration"] != "none" else None
        compute = compute or {}
        lines.append(f"| {r['layers']} | {r['calibration']} | {status} | {r.get('wall_s', '')} | {r.get('cpu_s', '')} "
                     f"| {r.get('peak_rss_mb', '')} | {r.get('quantize_s', '')} | {r.get('save_s', '')} | {disk} | "
                     f"{r['checkpoint']['bytes'] / GB:.2f} ({r['checkpoint']['shards']}) | {r['gflops']['fp32']} / "
                     f"{r['gflops']['bf16']} | {compute.get('precision', '')} | {r['loadavg_start']} → "
                     f"{r.get('loadavg_end', '…')} |")
    return lines


def block_table(r: dict) -> list[str]:
    calibration = "no calibration" if r["calibration"] == "none" else f"{r['calibration']} calibration tokens"
    lines = [f"### {r['layers']} blocks, {calibration}", "",
             "| block | wall s | CPU s | of it the solver + reported error, wall s | RSS at its end MiB "
             "| load average at its end |", "|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {b['block']} | {b['wall_s']} | {b['cpu_s']} | {b.get('solve_wall_s', '')} | {b['rss_mb']:,} | "
              f"{b['loadavg']} |" for b in r["blocks"]]
    if r["blocks"]:
        lines.append(f"| mean | {mean([b['wall_s'] for b in r['blocks']]):.1f} | "
                     f"{mean([b['cpu_s'] for b in r['blocks']]):.1f} | | | |")
    return lines + [""]


def block_means(records: list[dict]) -> dict[int, tuple[float, float]]:
    """Mean CPU and wall seconds of a block by calibration tokens, over every block any run stored."""
    by: dict[int, list[dict]] = {}
    for r in records:
        by.setdefault(tokens(r), []).extend(r["blocks"])
    return {t: (mean([b["cpu_s"] for b in bs]), mean([b["wall_s"] for b in bs])) for t, bs in by.items() if bs}


def outside_blocks(r: dict) -> float:
    """CPU seconds of a finished run outside its blocks: start, opening the checkpoint, calibration windows, LM head,
    save."""
    return r["cpu_s"] - sum(b["cpu_s"] for b in r["blocks"])


def extrapolation(records: list[dict]) -> list[str]:
    """Per-block CPU cost a + b·T from the blocks measured at the smallest and largest calibration sizes; the full
    model at the largest; Llama-3-70B's shape from the shape ratios; memory from the full model's run."""
    points = block_means(records)
    if len(points) < 2:
        full = max(records, key=lambda r: r["layers"])
        return ["Time extrapolation: needs blocks measured at two calibration sizes.",
                *memory(records, full, records[0]["settings"]["shape"], model_layers(full)), ""]
    t_small, t_big = min(points), max(points)
    (c_small, _), (c_big, w_big) = points[t_small], points[t_big]
    b = (c_big - c_small) / (t_big - t_small)
    a = c_small - b * t_small
    shape, threads = records[0]["settings"]["shape"], records[0]["settings"]["threads"]
    full = max(records, key=lambda r: r["layers"])
    layers = model_layers(full)
    done = [r for r in records if r["status"] == "done"]
    ref = full if full["status"] == "done" else next((r for r in done if tokens(r) == t_big), None)
    big_calib = f"{t_big // 512} × 512" if t_big % 512 == 0 else f"{t_big:,} tokens"
    lines = ["## Extrapolation", "",
             f"CPU seconds (all threads), as the machine was shared: wall seconds measure the load as much as the "
             f"work. **Per block**: t(T) = a + b·T CPU seconds over T calibration tokens, through the mean block at "
             f"T = {t_small:,} ({c_small:.0f} s) and T = {t_big:,} ({c_big:.0f} s): a = {a:.0f} s (the work that does "
             f"not grow with T: GPTQ's Cholesky and sweep, AWQ's tr(D H Dᵀ) per candidate scale, the reported "
             f"errors), b = {b * 1e3:.2f} ms per token (forwards, Hessians)."]
    if ref is not None:
        over = outside_blocks(ref)
        total = over + layers * c_big
        lines += ["", f"**{layers} blocks at {big_calib}** = CPU outside the blocks ({over:.0f} s, the "
                  f"{ref['layers']}-block run's: start, open, calibration windows, LM head, save) + {layers} × "
                  f"t({t_big:,}) = **{total / 60:.0f} CPU-min**: ≥ {total / threads / 60:.0f} min wall on {threads} "
                  f"idle cores (÷ {threads} threads, perfect scaling), {total * w_big / c_big / 60:.0f} min at the "
                  f"wall/CPU ratio its blocks had here ({w_big / c_big:.2f})."]
    lines += memory(records, full, shape, layers)
    big_shape = {k: v for k, v in LLAMA3_70B.items() if k != "layers"}
    rho_t, rho_f = block_params(big_shape) / block_params(shape), block_sweep(big_shape) / block_sweep(shape)
    params_70 = LLAMA3_70B["layers"] * block_params(big_shape) + 2 * big_shape["vocab"] * big_shape["hidden"]
    rho_p = params_70 / (layers * block_params(shape) + 2 * shape["vocab"] * shape["hidden"])
    block_70 = rho_f * a + rho_t * b * t_big
    lines += ["", f"**Llama-3-70B shape** (80 blocks, hidden 8,192, MLP 28,672, 64/8 heads): b·T grows with a "
              f"block's linear weights, ×{rho_t:.2f} ({block_params(big_shape) / 1e6:.0f} M vs "
              f"{block_params(shape) / 1e6:.0f} M; attention, which grows ×2, is counted at ×{rho_t:.2f} too), a with "
              f"Σ out·in² over the linears, ×{rho_f:.2f}. Per block at T = {t_big:,}: {rho_f:.2f}·a + "
              f"{rho_t:.2f}·b·T = {block_70 / 60:.0f} CPU-min"]
    if ref is not None:
        total_70 = rho_p * outside_blocks(ref) + LLAMA3_70B["layers"] * block_70
        lines[-1] += (f"; the model, with the time outside the blocks ×{rho_p:.2f} (the parameters): "
                      f"**{total_70 / 3600:.0f} CPU-hours**, ≥ {total_70 / threads / 3600:.0f} h wall on {threads} "
                      "idle cores of this machine")
    lines[-1] += "."
    gf = next(r for r in records if tokens(r) == t_big)["gflops"]
    amx = layers * (a * gf["fp32"] / 168 + b * t_big * gf["bf16"] / 1289)
    lines += ["", f"**AMX estimate** (not measured): one core here multiplied {gf['bf16']} GFLOPS bf16 and "
              f"{gf['fp32']} fp32 when the {big_calib} run started; the issue's AMX Xeon core 1,289 and 168. With "
              f"b·T (bf16 products) at the AMX bf16 rate and a at the AMX fp32 rate (GPTQ's sweep and Cholesky are "
              f"fp32; AWQ's bf16 search counted as fp32), the {layers} blocks at {big_calib} take {layers} × "
              f"({a:.0f} × {gf['fp32']}/168 + {b * t_big:.0f} × {gf['bf16']}/1289) = {amx / 60:.0f} CPU-min, "
              f"**≥ {amx / threads / 60:.0f} min wall** on {threads} cores: a lower bound, as only matrix products "
              "speed up.", ""]
    return lines


def model_layers(full: dict) -> int:
    """The blocks of the model a run's shape stands for: 32 for the Llama-3-8B shape, else the longest run's."""
    return max(full["layers"], LLAMA3_8B_LAYERS) if full["settings"]["shape"] == LLAMA3_8B else full["layers"]


def memory(records: list[dict], full: dict, shape: dict[str, int], layers: int) -> list[str]:
    """Peak RSS of the `layers`-block model (measured, or from a shorter run's peak plus the packed blocks the model
    holds beyond it) and its 70B estimate."""
    ends = 2 * shape["vocab"] * shape["hidden"] * 4 / GB  # the fp32 embedding and LM head
    done = [r for r in records if r["status"] == "done"]
    if not done:
        return []
    if full["settings"].get("spill"):
        return spilled_memory(done, shape, layers, ends)
    ref = max(done, key=lambda r: r["layers"])
    per_block = (ref["disk_written_bytes"] / GB - ends) / ref["layers"]  # a packed block, as saved
    lines, peak = [], 0.0
    if full["status"] == "done" and full["layers"] == layers:
        peak = full["peak_rss_mb"] * 2**20 / GB
        lines += ["", f"**Memory**: the {layers}-block run peaked at {peak:.1f} GB RSS: the fp32 embedding and LM "
                  f"head ({ends:.1f} GB), the packed blocks kept until the save ({per_block * layers:.1f} GB: the "
                  f"saved model less those two) and {peak - ends - per_block * layers:.1f} GB more (the working set "
                  "of a block, the interpreter)."]
    short = max((r for r in done if r["layers"] < layers), key=tokens, default=None)
    if short is not None and (full["status"] != "done" or full["layers"] < layers or tokens(short) > tokens(full)):
        during = short["peak_rss_mb"] * 2**20 / GB + per_block * (layers - short["layers"])
        lines += ["", f"**Memory at {short['calibration']}**: the {short['layers']}-block run peaked at "
                  f"{short['peak_rss_mb'] * 2**20 / GB:.1f} GB (RSS after its last block "
                  f"{short['blocks'][-1]['rss_mb'] * 2**20 / GB:.1f} GB); with the {layers - short['layers']} more "
                  f"packed blocks ({per_block:.3f} GB each) the {layers}-block model holds by its last block, it "
                  f"would peak at ≈ **{max(during, peak):.1f} GB** (estimated)."]
        peak = max(during, peak)
    big_shape = {k: v for k, v in LLAMA3_70B.items() if k != "layers"}
    ends_70 = 2 * big_shape["vocab"] * big_shape["hidden"] * 4 / GB
    rho_t = block_params(big_shape) / block_params(shape)
    packed_70 = per_block * rho_t * LLAMA3_70B["layers"]
    rest = peak - ends - per_block * layers
    lines += ["", f"**Memory, 70B**: the fp32 embedding and head take {ends_70:.1f} GB, the packed blocks grow with "
              f"the linear weights (×{rho_t:.2f} per block, {LLAMA3_70B['layers']} blocks: {packed_70:.1f} GB) and the "
              f"rest ({rest:.1f} GB here) ×{rho_t:.2f} (a block's weights; its largest Hessian grows ×4): "
              f"**≈ {ends_70 + packed_70 + rest * rho_t:.0f} GB**; the saved model ≈ {ends_70 + packed_70:.0f} GB."]
    return lines


def spilled_memory(done: list[dict], shape: dict[str, int], layers: int, ends: float) -> list[str]:
    """Peak RSS of spilled runs: finished blocks wait on disk, so a longer run holds no more during its blocks, and
    the end holds the fp32 embedding and LM head for the save."""
    rho_t = block_params({k: v for k, v in LLAMA3_70B.items() if k != "layers"}) / block_params(shape)
    ends_70 = ends * LLAMA3_70B["hidden"] / shape["hidden"]
    lines = []
    for r in sorted(done, key=lambda r: (r["layers"], tokens(r))):
        peak, rss = r["peak_rss_mb"] * 2**20 / GB, [b["rss_mb"] * 2**20 / GB for b in r["blocks"]]
        calibration = "no calibration" if r["calibration"] == "none" else f"calibration {r['calibration']}"
        lines += ["", f"**Memory, {r['layers']} blocks, {calibration}** (finished blocks' packed linears and "
                  f"the embedding table spilled to mapped files beside the output): peak **{peak:.1f} GB** RSS; "
                  f"resident at the end of the first and the last block {rss[0]:.1f} and {rss[-1]:.1f} GB (the "
                  f"blocks do not accumulate in memory); the end reads the fp32 embedding and LM head back "
                  f"({ends:.1f} GB) for the save."]
    big = max(done, key=lambda r: (tokens(r), r["layers"]))
    peak = big["peak_rss_mb"] * 2**20 / GB
    if big["layers"] < layers:
        lines += ["", f"**{layers} blocks at {big['calibration']}**: blocks do not add memory, so the "
                  f"{big['layers']}-block run's peak stands for the whole model: ≈ **{peak:.1f} GB** (estimated)."]
    rho = max(rho_t, (LLAMA3_70B["mlp"] / shape["mlp"]) ** 2)
    lines += ["", f"**Memory, 70B** (estimated, an upper bound): what the run holds at any time grows at most as a "
              f"block's weights (×{rho_t:.2f}) or its largest Hessian (the MLP width squared) do, ×{rho:.2f}: "
              f"≤ {peak * rho:.0f} GB; of it the fp32 embedding and head at the save take {ends_70:.1f} GB."]
    return lines


def render(records: list[dict]) -> str:
    lines = intro("Quantizing an 8B-class model with --stream", ABOUT)
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(json.dumps([r["model"], r["settings"]], sort_keys=True), []).append(r)
    for rows in groups.values():
        model, settings = rows[0]["model"], rows[0]["settings"]
        calibration = f"calibration {settings['calib_dtype']}" if settings["calib_dtype"] else "no calibration"
        spill = "finished blocks spilled beside the output" if settings.get("spill") else "finished blocks in memory"
        lines += [f"## {model}, {settings['method']}, {calibration}, {settings['threads']} threads, {spill}", "",
                  *run_rows(rows), ""]
        lines += [*(f"- {r['layers']} blocks, {r['calibration']}: {run_header(r)}" for r in rows), ""]
        if settings["calib_dtype"]:
            lines += extrapolation(rows)
        else:
            full = max(rows, key=lambda r: r["layers"])
            lines += [*memory(rows, full, settings["shape"], model_layers(full)), ""]
        lines += ["## Per block", ""] + [line for r in rows for line in block_table(r)]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, threads=2)
    p.add_argument("--layers", type=int, default=32)
    for k, v in LLAMA3_8B.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--method", default="awq+gptq", help="the recipe, W4 g128 (rtn: the memory and disk of a run "
                   "without calibration, in minutes)")
    p.add_argument("--calib-samples", type=int, default=64)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--calib-dtype", default="auto", choices=("auto", "fp32", "bf16"))
    p.add_argument("--ckpt-root", default="/work/scale-ckpt", help="where checkpoints and the quantized output go")
    p.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors shard, GB")
    p.add_argument("--tokenizer-from", default="smollm2-135m", help="packaged model whose tokenizer files are copied")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-spill", action="store_true", help="keep finished blocks and the embedding in memory (the "
                   "CLI spills them beside the output, `bitquilt.open_streaming(spill_dir=...)`)")
    p.add_argument("--report", default="scale", help="results name under bench/results/")
    p.add_argument("--render-only", action="store_true", help="only rewrite the report from its .json")
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    bench = Bench(args.report, FIELDS, render)
    if args.render_only:
        bench.rerender()
    elif args.worker:
        worker(args, bench)
    else:
        measure(args, bench)


if __name__ == "__main__":
    run(main)
