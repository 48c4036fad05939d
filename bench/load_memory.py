"""Memory of a saved quantized model at run time: what loading and running it adds to the process.

    python bench/load_memory.py --models smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b \
        --runtimes transformers,bitquilt,standalone,bitquilt-native

For each model and variant (RTN weights, quantized once with `bitquilt quantize --stream` into --workdir), a child
process with one thread: imports what the runtime needs and loads the tokenizer (the *base*: torch, transformers
with the model's modeling code and AutoTokenizer for the transformers runtime; torch, bitquilt and the `tokenizers`
library alone for the bitquilt one, `bitquilt.runtime.module_tree`; the `tokenizers` library and the C library for the
standalone one, no torch or numpy), then loads the model with that runtime (`bitquilt.load` of the saved directory;
for the standalone runtime, `StandaloneModel` of its export, `bitquilt export --to standalone`, written once beside
the saved directory) (RSS *after load*), then runs what `bench/e2e.py` times: a 128-token prefill and 31 decode
steps with the default engine (optionally with int8 activations; the standalone runtime runs int8 activations only).
The *bitquilt-native* rows run the same export with the native runner, a program without Python (`bitquilt-native`,
csrc/native_runner.cpp): its own peak (VmHWM) and load time as it reports them, on a prompt of the first 128 tokens
of a Wikipedia passage (text, which it tokenizes itself) and 32 new tokens; no base (nothing is loaded before the
model but the program). Reported: the file's size (the saved model's, or the standalone export's for that runtime),
the base, the peak above the base (the model's own memory), the whole process's peak, the kernel layouts' bytes (the
standalone runtime's are the file) and what of the mapped file is still resident at the end (`bitquilt.mapped`: a
linear's pages are given back once its kernel layout is built), and the time from the start of the load to the end
of the decode steps (*ready + run s*). Results: bench/results/load_memory.{json,md}.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {  # name: bitquilt quantize arguments
    "w4 g128": ["--w-bits", "4", "--group-size", "128"],
    "w4 g128 head8": ["--w-bits", "4", "--group-size", "128", "--head-bits", "8"],
    "w4 g128 head4": ["--w-bits", "4", "--group-size", "128", "--head-bits", "4"],
    "w2 g64 head8": ["--w-bits", "2", "--group-size", "64", "--head-bits", "8"],
}
KEY = ("model", "variant", "engine")


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _base(directory: Path, runtime: str) -> float:
    """Import what `runtime` runs on and load its tokenizer once (the skeletons hold nothing): RSS then, the base.
    That tokenizer is dropped again and the heap trimmed before the measured load, which reads its own: a second copy
    on a heap still holding the first's freed blocks measured up to 61 MB (Qwen's) above the real one-tokenizer peak."""
    import gc

    from bitquilt.heap import return_free_memory

    if runtime in ("bitquilt", "standalone"):
        if runtime == "standalone":
            from bitquilt.runtime.standalone.model import set_threads

            set_threads(1)  # builds and loads the library
        from bitquilt.runtime.tokenizer import FastTokenizer

        tokenizer = FastTokenizer(directory)
    else:
        from transformers import AutoTokenizer

        from bitquilt.io import base_config
        from bitquilt.models.loading import empty_model

        empty_model(base_config(directory))  # imports the modeling code
        tokenizer = AutoTokenizer.from_pretrained(directory)
    base = rss_mb()
    del tokenizer
    gc.collect()
    return_free_memory()
    return base


def child(saved: str, engine: str, runtime: str) -> dict:
    """The measurement, in this (fresh) process."""
    if runtime == "standalone":
        return standalone_child(Path(saved))
    import torch

    from bitquilt import kernels
    from bitquilt.io import WEIGHTS_NAME, load
    from bitquilt.nn.quant_linear import QuantLinear
    from bitquilt.resources import peak_rss_mb, resident_bytes
    from bitquilt.runtime.engines import stepper

    torch.set_num_threads(1)
    directory = Path(saved)
    base = _base(directory, runtime)
    with kernels.using(int8_activations=engine.endswith("+int8")):
        t0 = time.perf_counter()
        model, _ = load(directory, runtime)
        load_s, after_load = time.perf_counter() - t0, rss_mb()
        prompt = torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            step = stepper(model, 160, engine.partition("+")[0])
            token = int(step(prompt).argmax())  # as bench/e2e.py: the step returns the last position's logits
            for _ in range(31):
                token = int(step(torch.tensor([[token]])).argmax())
        run_s = time.perf_counter() - t0
        layouts = sum(kernels.kernel_layout_bytes(m.fmt) for m in model.modules() if isinstance(m, QuantLinear))
        mapped = resident_bytes(directory / WEIGHTS_NAME) / 2**20
        return {"base_mb": base, "after_load_mb": after_load, "peak_mb": peak_rss_mb(), "load_s": load_s,
                "run_s": run_s, "layout_mb": layouts / 2**20, "mapped_resident_mb": mapped}


def standalone_child(exported: Path) -> dict:
    """`child` for the standalone runtime: the same steps without torch (or numpy)."""
    import random

    from bitquilt.resources import peak_rss_mb, resident_bytes
    from bitquilt.runtime.standalone.generate import picker
    from bitquilt.runtime.standalone.model import FILE, StandaloneModel

    base = _base(exported, "standalone")
    t0 = time.perf_counter()
    model = StandaloneModel(exported)
    load_s, after_load = time.perf_counter() - t0, rss_mb()
    model.begin(160)
    greedy, draws = picker(), random.Random(0)
    token = greedy(model.forward([draws.randrange(model.vocab_size) for _ in range(128)]))
    for _ in range(31):
        token = greedy(model.forward([token]))
    run_s = time.perf_counter() - t0
    assert "torch" not in sys.modules and "numpy" not in sys.modules, "the standalone runtime imported torch or numpy"
    return {"base_mb": base, "after_load_mb": after_load, "peak_mb": peak_rss_mb(), "load_s": load_s,
            "run_s": run_s, "layout_mb": 0.0, "mapped_resident_mb": resident_bytes(exported / FILE) / 2**20}


def native_runner_child(exported: Path) -> dict:
    """The *bitquilt-native* measurement: the runner on a 128-token text prompt, greedy, 32 new tokens, one thread."""
    from native_runner import prompt_of

    from bitquilt.runtime.standalone.library import runner_path

    prompt = prompt_of(exported)
    runner = str(runner_path())  # built first if need be, outside the timing
    t0 = time.perf_counter()
    done = subprocess.run([runner, str(exported), "--prompt", prompt, "--max-new-tokens", "32",
                           "--ignore-eos", "--threads", "1", "--json"], check=True, capture_output=True, text=True)
    run_s = time.perf_counter() - t0
    result = json.loads(done.stdout)
    return {"peak_mb": result["peak_rss_mb"], "load_s": result["load_seconds"], "run_s": run_s, "layout_mb": 0.0,
            "prompt_tokens": result["prompt_tokens"]}


def export_standalone(saved: Path) -> Path:
    out = saved.with_name(saved.name + "-standalone")
    if not (out / "standalone.safetensors").exists():
        subprocess.run([sys.executable, "-m", "bitquilt.cli", "export", str(saved), "-o", str(out), "--to",
                        "standalone", "--overwrite"], check=True, capture_output=True)
    return out


def quantize(model: str, variant: str, out: Path) -> None:
    if (out / "quantization_config.json").exists():
        return
    argv = [sys.executable, "-m", "bitquilt.cli", "quantize", model, "--method", "rtn", *VARIANTS[variant],
            "--stream", "-o", str(out), "--overwrite"]
    done = subprocess.run(argv, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"quantizing {model} {variant} failed: {done.stderr.strip().splitlines()[-1]}")


def _runtime(record: dict) -> str:
    return record["settings"].get("runtime", "transformers")


def render(records: list[dict]) -> str:
    lines = ["# Memory of a loaded quantized model", "", __doc__.split("\n\n", 2)[2].replace("\n", " ").strip(), "",
             "MB = MiB. *model above base*: peak − base, what the model costs the process; its ratio to the file is "
             "the one the runtime does not set. *process ÷ file*: the whole process's peak over the file.", "",
             "| model | variant | runtime | engine | file MB | base MB | after load MB | peak MB | model above base MB "
             "| above base ÷ file | process ÷ file | kernel layouts MB | mapped still resident MB | load s "
             "| ready + run s | load avg |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    models = list(dict.fromkeys(r["model"] for r in records))
    order = list(VARIANTS)
    def figure(r: dict, key: str, digits: int = 0) -> str:
        return f"{r[key]:.{digits}f}" if key in r else "–"

    for r in sorted(records, key=lambda r: (models.index(r["model"]), order.index(r["variant"]), _runtime(r),
                                            r["engine"])):
        above = {"above": r["peak_mb"] - r["base_mb"], "ratio": (r["peak_mb"] - r["base_mb"]) / r["file_mb"]} \
            if "base_mb" in r else {}
        lines.append(f"| {r['model']} | {r['variant']} | {_runtime(r)} | {r['engine']} | {r['file_mb']:.0f} | "
                     f"{figure(r, 'base_mb')} | {figure(r, 'after_load_mb')} | {r['peak_mb']:.0f} | "
                     f"{figure(above, 'above')} | {figure(above, 'ratio', 2)} | {r['peak_mb'] / r['file_mb']:.2f} | "
                     f"{r['layout_mb']:.0f} | {figure(r, 'mapped_resident_mb')} | {r['load_s']:.2f} | "
                     f"{figure(r, 'run_s', 1)} | {r['loadavg']} |")
    from common import provenance

    return "\n".join(lines + provenance(records))


def main() -> None:
    import torch
    from common import Bench, loadavg, parser, stamp

    p = parser(__doc__, models="smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b", workdir="/tmp/bitquilt-load-memory")
    p.add_argument("--variants", default="w4 g128,w4 g128 head8,w4 g128 head4")
    p.add_argument("--engines", default="auto,auto+int8")
    p.add_argument("--runtimes", default="transformers,bitquilt,standalone",
                   help="transformers, bitquilt (bitquilt.load's runtimes), standalone (bitquilt.runtime.standalone), "
                        "bitquilt-native (the standalone export run by the native runner)")
    args = p.parse_args()
    torch.set_num_threads(1)  # as the children (the machine record states it)
    bench = Bench("load_memory", KEY, render)
    for model in args.models.split(","):
        for variant in args.variants.split(","):
            saved = Path(args.workdir) / model / variant.replace(" ", "-")
            quantize(model, variant, saved)
            for runtime, engine in itertools.product(args.runtimes.split(","), args.engines.split(",")):
                exported = runtime in ("standalone", "bitquilt-native")
                if exported and not engine.endswith("+int8"):
                    continue  # int8 activations only
                target, weights = (export_standalone(saved), "standalone.safetensors") if exported \
                    else (saved, "model.safetensors")
                if runtime == "bitquilt-native":
                    result = native_runner_child(target)
                else:
                    out = subprocess.run([sys.executable, __file__, "--child", str(target), engine, runtime],
                                         check=True, capture_output=True, text=True,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})
                    result = json.loads(out.stdout.strip().splitlines()[-1])
                settings = {} if runtime == "transformers" else {"runtime": runtime}
                record = {"model": model, "variant": variant, "engine": engine, "settings": settings,
                          "file_mb": (target / weights).stat().st_size / 2**20, **result,
                          "loadavg": loadavg(), **stamp()}
                print(f"{model} {variant} [{runtime} {engine}]: peak {result['peak_mb']:.0f} MB, "
                      f"base {result.get('base_mb', 0):.0f}, file {record['file_mb']:.0f}", flush=True)
                bench.store(record)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # a measurement: imports only what its runtime needs (no torch for standalone)
        print(json.dumps(child(*sys.argv[2:5])))
    else:
        from common import run

        run(main)
