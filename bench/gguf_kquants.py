"""K-quant GGUF files side by side: llama.cpp's `llama-quantize --imatrix` against bitquilt's `--gguf-type` export of
the same mix (and, with --autoround, AutoRound's GGUF export), every file scored by llama.cpp's own `llama-perplexity`.

llama.cpp is built for this CPU from the sources inside the `llama-cpp-python` sdist (an optional bench dependency,
fetched with pip: `pip download --no-binary :all: --no-deps llama-cpp-python`) into $BITQUILT_CACHE/llamacpp
(`build_llamacpp`; once, -j2: about 30 minutes on 2 busy cores), targets llama-quantize, llama-imatrix and
llama-perplexity.

Per model: the calibration text (the first --calib-chunks × 512 tokens of a packaged text, --calib-data, bitquilt's
default, written to calib.txt) feeds both `llama-imatrix` (512-token chunks) and bitquilt (`--calib-data calib.txt`,
as many 512-token windows). Per mix:
  llama.cpp   llama-quantize --allow-requantize --imatrix on the packaged GGUF (the weights bitquilt's fp32 model
              is: llama.cpp dequantizes them before quantizing)
  bitquilt    `bitquilt quantize --gguf-type MIX --method M [FLAGS]` for each --methods entry ("M FLAGS", entries
              separated by ";"), then `export --to gguf`
  autoround   with --autoround PRESET[:k=v,...] (peers.py's presets and settings: `light` = iters 50, lr 5e-3;
              `default` = iters 200): AutoRound's `quantize_and_save(format="gguf:<mix>")` on bitquilt's fp32 model,
              tuned in fp32 on the CPU on bitquilt's very calibration windows (`calibration_ids` of calib.txt, as
              many 512-token windows, seed 0: the token ids bitquilt's rows tune on), in a child process of the
              peers venv (--peers-python), which needs two packages besides peers.py's install: gguf-py from the
              llama.cpp sources built here (newer than PyPI's gguf, which lacks architectures AutoRound's Qwen2
              converter names) and sentencepiece; the worker points AutoRound at those sources (LLAMA_CPP_ROOT):
                  .venv-peers/bin/pip install ~/.cache/bitquilt/llamacpp/llama_cpp_python-*/vendor/llama.cpp/gguf-py \
                      sentencepiece==0.2.3 torch==2.13.0
              Mixes AutoRound lacks (Q2_K: it has Q2_K_S) are skipped with a note. `light:iters=0` is the setting
              AutoRound recommends for GGUF (its imatrix-weighted RTN search, no SignRound tuning). Where a tensor's
              rows are no multiple of 256 (smollm2: width 576) it falls back to Q5_0 (Q6_K: Q8_0) whatever the mix,
              where llama.cpp picks Q4_0/Q5_0/Q5_1 by mix: its Q3_K_M file is then larger than llama.cpp's.
Every file: size and `llama-perplexity -c 512` over the first --chunks chunks of wiki (BoolQ passages) and lambada.

    .venv/bin/python bench/gguf_kquants.py --model smollm2-135m --mixes Q2_K,Q3_K_M,Q4_K_M \
        --methods "gptq;gptq --recon-steps 50 --opt recon.lr=0.01 --opt recon.clip=False"
    OMP_NUM_THREADS=1 .venv/bin/python bench/gguf_kquants.py --model smollm2-135m --mixes Q3_K_M,Q4_K_M \
        --methods "" --threads 1 --autoround light
Seconds: wall time of the quantization (llama.cpp: imatrix + quantize; bitquilt and AutoRound: the whole child
process, model load included); CPU seconds: the same processes' user + system time, all threads.
Results: bench/results/gguf_kquants.{json,md}, rewritten after every file, one record per model and calibration
(others kept; a record's files already measured with the same perplexity settings are skipped, so runs add to it);
files stay in --workdir.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from bitquilt.errors import UserError, run_command

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("llama-quantize", "llama-imatrix", "llama-perplexity")
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
# what AutoRound's GGUF writer imports and auto-round does not require: gguf-py from the llama.cpp sources built here
# (its converter for Qwen2 needs architectures newer than PyPI's gguf 0.19.0; the worker points LLAMA_CPP_ROOT at the
# same sources) and sentencepiece (its llama vocabulary code imports it before looking for a tokenizer.model)
GGUF_WRITER = "~/.cache/bitquilt/llamacpp/llama_cpp_python-*/vendor/llama.cpp/gguf-py sentencepiece==0.2.3"


def llamacpp_source(cache: Path) -> Path | None:
    """The llama.cpp sources `build_llamacpp` extracted under `cache` (the newest sdist), if any."""
    sources = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))
    return sources[-1] if sources else None


def build_llamacpp(cache: Path) -> Path:
    """llama.cpp's tools built from the llama-cpp-python sdist under `cache`; the folder of the binaries."""
    bin_dir = cache / "build" / "bin"
    if all((bin_dir / t).is_file() for t in TARGETS):
        return bin_dir
    cache.mkdir(parents=True, exist_ok=True)
    sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "llama-cpp-python", "-d", str(cache)], check=True)
        sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    source = cache / sdists[-1].name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not source.is_dir():
        with tarfile.open(sdists[-1]) as tar:
            tar.extractall(cache, filter="data")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    subprocess.run(["cmake", "-S", str(source), "-B", str(cache / "build"), *flags], check=True)
    subprocess.run(["cmake", "--build", str(cache / "build"), "-j2", "--target", *TARGETS], check=True)
    return bin_dir


def write_texts(model: str, workdir: Path, calib: str, calib_chunks: int) -> dict[str, Path]:
    """calib.txt (packaged text `calib`, about `calib_chunks` × 512 tokens), wiki.txt and lambada.txt (documents
    joined by blank lines, as bitquilt's perplexity joins them)."""
    from transformers import AutoTokenizer

    from bitquilt.data.corpora import load_documents
    from bitquilt.data.windows import SEPARATOR
    from bitquilt.models import registry

    tokenizer = AutoTokenizer.from_pretrained(registry.model_dir(model))
    paths = {}
    for key, name in (("calib", calib), ("wiki", "wiki"), ("lambada", "lambada")):
        docs = load_documents(name)
        if key == "calib":
            kept = []
            for doc in docs:  # whole passages until the calibration length is reached
                kept.append(doc)
                if len(tokenizer(SEPARATOR.join(kept))["input_ids"]) > calib_chunks * 512 + 512:
                    break
            docs = kept
        path = workdir / f"{key}.txt"
        path.write_text(SEPARATOR.join(docs))
        paths[key] = path
    return paths


def run(command: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Run to the end (output to `log`), raise with its tail on failure; its wall seconds and CPU seconds (user +
    system, all threads)."""
    t0, c0 = time.perf_counter(), child_cpu()
    with log.open("w") as f:
        proc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        raise RuntimeError(f"{command[0]} failed: {log.read_text()[-1500:]}")
    return time.perf_counter() - t0, child_cpu() - c0


def child_cpu() -> float:
    """User + system seconds of this process's ended (waited-for) children, all their threads."""
    t = os.times()
    return t.children_user + t.children_system


def slug(text: str) -> str:
    """`text` as a file-name part: runs of other characters than letters, digits and dots become one _."""
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def perplexity(bin_dir: Path, gguf_file: Path, text: Path, chunks: int, threads: int, log: Path) -> float:
    run([str(bin_dir / "llama-perplexity"), "-m", str(gguf_file), "-f", str(text), "-c", "512", "--chunks",
         str(chunks), "-t", str(threads)], log)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", log.read_text())
    if not found:
        raise RuntimeError(f"no perplexity in {log}")
    return float(found.group(1))


def load_records(results: Path) -> dict:
    record_file = results.with_suffix(".json")
    return json.loads(record_file.read_text()) if record_file.is_file() else {}


def record_key(model: str, settings: dict) -> str:
    """The record of `model` measured with `settings`: one per model and calibration (chunks of which text)."""
    return f"{model}, {settings['calib_chunks']} x {settings['calib']}"


def earlier_rows(results: Path, model: str, settings: dict) -> list[dict]:
    """The rows of `model`'s record with the same `settings` (a later run adds to them)."""
    record = load_records(results).get(record_key(model, settings), {})
    return record.get("rows", []) if all(record.get(k) == v for k, v in settings.items()) else []


def write_results(results: Path, model: str, rows: list[dict], settings: dict, bin_dir: Path) -> None:
    """The rows of `model` with `settings` into results.json (other records kept) and every record's table into
    results.md."""
    results.parent.mkdir(parents=True, exist_ok=True)
    records = load_records(results)
    records[record_key(model, settings)] = {"model": model, "rows": rows, **settings, "llama.cpp": str(bin_dir)}
    record_file = results.with_suffix(".json")
    record_file.write_text(json.dumps(records, indent=1))
    lines = ["# K-quant GGUF files: llama.cpp's imatrix quantization vs bitquilt's (and AutoRound's) export of the "
             "same mix", "",
             "`python bench/gguf_kquants.py --model MODEL --mixes Q2_K,Q3_K_M,Q4_K_M`. Every file scored by "
             "llama.cpp's `llama-perplexity -c 512` (first N chunks of each text; wiki = BoolQ's Wikipedia "
             "passages, lambada = LAMBADA passages). Calibration: the same text for `llama-imatrix` (512-token "
             "chunks) and bitquilt (as many 512-token windows). llama.cpp requantizes the packaged GGUF, whose "
             "dequantized weights are bitquilt's fp32 model; AutoRound (`autoround PRESET`: peers.py's settings) tunes "
             "that fp32 model on bitquilt's calibration windows (the same token ids) and writes its GGUF export. "
             "Seconds: wall time of llama.cpp's imatrix + quantize, of bitquilt's and AutoRound's quantize "
             "processes (model load included); cpu s: their user + system time (2 cores shared with other "
             "jobs: indicative only); export s: wall time of `bitquilt export --to gguf` from the saved model "
             "(process start included).", ""]
    for record in records.values():
        lines += [f"## {record['model']} ({record['calib_chunks']} calibration chunks of {record['calib']}, "
                  f"{record['chunks']} perplexity chunks)",
                  "", "| mix | file | size MB | ppl wiki | ppl lambada | seconds | cpu s | export s |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in record["rows"]:  # rows measured before CPU and export time were recorded have none
            ppl = [f"{r[k]:.2f}" if k in r else "—" for k in ("ppl_wiki", "ppl_lambada")]
            cpu, export = (f"{r[k]:.0f}" if k in r else "—" for k in ("cpu_s", "export_s"))
            lines.append(f"| {r['mix']} | {r['file']} | {r['size_mb']:.2f} | {ppl[0]} | {ppl[1]} | "
                         f"{r['seconds']:.0f} | {cpu} | {export} |")
        tuned = {r["file"]: r["autoround"] for r in record["rows"] if "autoround" in r}
        lines += [f"- {label}: " + ", ".join(f"{k} {v}" for k, v in config.items()) for label, config in tuned.items()]
        lines.append("")
    results.with_suffix(".md").write_text("\n".join(lines))


def install_line() -> str:
    from peers import AUTOROUND_VERSION

    return ("python3 -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 && .venv-peers/bin/pip install "
            f"-e . torch==2.13.0 && .venv-peers/bin/pip install auto-round=={AUTOROUND_VERSION} {GGUF_WRITER} "
            "torch==2.13.0")


def autoround_probe() -> None:
    """(In the peers venv.) One JSON line: auto-round's and gguf's versions and the GGUF mixes AutoRound writes."""
    from importlib.metadata import version

    import gguf  # noqa: F401  # AutoRound's GGUF writer needs both (GGUF_WRITER)
    import sentencepiece  # noqa: F401
    from auto_round.export.export_to_gguf.config import GGUF_CONFIG

    mixes = sorted(name.removeprefix("gguf:").upper() for name in GGUF_CONFIG)
    print(json.dumps({"auto_round": version("auto-round"), "gguf": version("gguf"), "mixes": mixes}))


def peers_autoround(python: Path) -> dict:
    """What `autoround_probe` says in the peers venv `python`; a UserError with the install commands where that venv,
    auto-round or gguf is missing."""
    if not python.is_file():
        raise UserError(f"--autoround runs AutoRound in a venv of its own, and {python} is missing; make it with: "
                        f"{install_line()}")
    proc = subprocess.run([str(python), str(Path(__file__).resolve()), "--autoround-probe"], capture_output=True,
                          text=True)
    if proc.returncode:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"--autoround: {python} cannot run AutoRound's GGUF export ({why}); install with: "
                        f"{install_line()}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def autoround_worker(job: dict) -> None:
    """(In the peers venv.) AutoRound's GGUF file of `job["model"]` at `job["mix"]` to `job["out"]`, tuned with
    `job["settings"]` in fp32 on the CPU on the calibration windows bitquilt's rows get from the same text (the
    `--calib-data FILE --calib-samples N --calib-seqlen 512` of `bitquilt quantize`, seed 0); its resolved settings to
    the .json beside it."""
    from importlib.metadata import version

    import torch
    from auto_round import AutoRound

    from bitquilt.api import calibration_ids, load
    from bitquilt.recipes import CalibConfig

    torch.set_num_threads(job["threads"])
    model, tokenizer = load(job["model"])  # fp32; name_or_path is the packaged folder (config, tokenizer) it reads
    ids = calibration_ids(tokenizer, CalibConfig(job["calib"], job["calib_chunks"], 512))
    if tokenizer.pad_token_id is not None and bool((ids == tokenizer.pad_token_id).any()):
        raise UserError("the calibration windows contain the pad token, which AutoRound would mask out")
    settings, scheme = job["settings"], f"gguf:{job['mix'].lower()}"
    compressor = AutoRound(model, tokenizer=tokenizer, scheme=scheme, dataset=list(ids.split(settings["batch_size"])),
                           nsamples=len(ids), seqlen=ids.shape[1], amp=False, device_map="cpu",
                           low_cpu_mem_usage=False, **settings)
    out, folder = Path(job["out"]), Path(job["folder"])
    shutil.rmtree(folder, ignore_errors=True)  # no file of an earlier run to pick up
    compressor.quantize_and_save(str(folder), format=scheme)
    written = sorted(folder.rglob("*.gguf"))
    if len(written) != 1:
        raise RuntimeError(f"expected one .gguf file under {folder}, found {[str(f) for f in written]}")
    written[0].replace(out)
    config = compressor.quantize_config
    resolved = {**settings, **{k: getattr(config, k, None) for k in ("lr", "minmax_lr")},
                "algorithm": type(config).__name__, "seed": compressor.seed, "amp": False, "nsamples": len(ids),
                "seqlen": ids.shape[1], "auto_round": version("auto-round")}  # iters=0: its imatrix RTN, no lr
    out.with_suffix(".json").write_text(json.dumps(resolved))


def main() -> int:
    from bitquilt.recipes import CalibConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--mixes", default="Q2_K,Q3_K_M,Q4_K_M")
    p.add_argument("--methods", default="rtn;gptq",
                   help='bitquilt methods, each run with --gguf-type: "METHOD [FLAGS]" entries separated by ";"')
    p.add_argument("--calib-data", default=CalibConfig.source, help="packaged calibration text for both tools")
    p.add_argument("--calib-chunks", type=int, default=32, help="512-token calibration chunks/windows")
    p.add_argument("--chunks", type=int, default=20, help="512-token perplexity chunks per text")
    p.add_argument("--texts", default="wiki,lambada", help="perplexity texts: wiki, lambada")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/gguf_kquants"))
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "gguf_kquants")
    p.add_argument("--autoround", nargs="*", default=[], metavar="PRESET[:k=v,...]",
                   help="AutoRound's GGUF export in these settings as more rows: peers.py's presets (light, default) "
                        "and settings, e.g. light or default:iters=100")
    p.add_argument("--peers-python", type=Path, default=PEERS_PYTHON,
                   help="the interpreter of the venv with auto-round and gguf (default .venv-peers)")
    p.add_argument("--autoround-probe", action="store_true", help=argparse.SUPPRESS)  # the two child modes
    p.add_argument("--autoround-worker", metavar="JOB", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.autoround_probe:
        autoround_probe()
        return 0
    if args.autoround_worker:
        autoround_worker(json.loads(args.autoround_worker))
        return 0
    autoround, peer = {}, {}
    if args.autoround:
        from peers import autoround_settings

        autoround = {spec: autoround_settings(spec) for spec in args.autoround}  # UserError on a bad spec
        peer = peers_autoround(args.peers_python)

    from bitquilt.cache import cache_dir
    from bitquilt.models import registry

    bin_dir = build_llamacpp(cache_dir() / "llamacpp")
    source = str(llamacpp_source(cache_dir() / "llamacpp"))  # AutoRound's converter and gguf-py (LLAMA_CPP_ROOT)
    work = args.workdir / args.model
    work.mkdir(parents=True, exist_ok=True)
    texts = write_texts(args.model, work, args.calib_data, args.calib_chunks)
    original = registry.model_dir(args.model) / registry.MODELS[args.model].file
    settings = {"calib": args.calib_data, "calib_chunks": args.calib_chunks, "chunks": args.chunks,
                "texts": args.texts}
    rows = earlier_rows(args.results, args.model, settings)
    measured = {(r["mix"], r["file"]) for r in rows}
    imatrix, imatrix_time = work / "imatrix.gguf", None  # (wall, CPU) seconds once computed

    def score(label: str, mix: str, gguf_file: Path, seconds: float, cpu: float, **extra: Any) -> None:
        row = {"model": args.model, "mix": mix, "file": label, "size_mb": gguf_file.stat().st_size / 1e6,
               "seconds": seconds, "cpu_s": cpu, **extra}
        for text in args.texts.split(","):
            row[f"ppl_{text}"] = perplexity(bin_dir, gguf_file, texts[text], args.chunks, args.threads,
                                            work / f"{gguf_file.stem}.{text}.log")
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_results(args.results, args.model, rows, settings, bin_dir)  # after every file

    for mix in args.mixes.split(","):
        if (mix, "llama.cpp imatrix") not in measured:
            if imatrix_time is None:  # once per run: the calibration text is the run's
                imatrix_time = run([str(bin_dir / "llama-imatrix"), "-m", str(original), "-f", str(texts["calib"]),
                                    "-c", "512", "--chunks", str(args.calib_chunks), "-t", str(args.threads), "-o",
                                    str(imatrix)], work / "imatrix.log")
            out = work / f"llamacpp-{mix}.gguf"
            seconds, cpu = run([str(bin_dir / "llama-quantize"), "--allow-requantize", "--imatrix", str(imatrix),
                                str(original), str(out), mix, str(args.threads)], work / f"quantize-{mix}.log")
            score("llama.cpp imatrix", mix, out, seconds + imatrix_time[0], cpu + imatrix_time[1])
        for entry in filter(None, (e.strip() for e in args.methods.split(";"))):
            if (mix, f"bitquilt {entry}") in measured:
                continue
            method, *flags = shlex.split(entry)
            name = slug(entry)
            saved, out = work / f"bitquilt-{name}-{mix}", work / f"bitquilt-{name}-{mix}.gguf"
            bq = [sys.executable, "-m", "bitquilt.entry"]
            quantize = [*bq, "quantize", args.model, "--gguf-type", mix, "--method", method, *flags, "--calib-data",
                        str(texts["calib"]), "--calib-samples", str(args.calib_chunks), "--calib-seqlen", "512",
                        "--threads", str(args.threads), "-o", str(saved), "--overwrite"]
            quantize_s, quantize_cpu = run(quantize, work / f"bq-{name}-{mix}.log")
            export_s, _ = run([*bq, "export", str(saved), "--to", "gguf", "-o", str(out), "--overwrite"],
                              work / f"export-{name}-{mix}.log")
            score(f"bitquilt {entry}", mix, out, quantize_s, quantize_cpu, export_s=export_s)
        for spec, settings_ar in autoround.items():
            label = f"autoround {spec}"
            if (mix, label) in measured:
                continue
            if mix.upper() not in peer["mixes"]:
                print(f"{label}: no {mix} file: AutoRound {peer['auto_round']} writes no {mix} mix (its GGUF mixes: "
                      f"{', '.join(peer['mixes'])})", file=sys.stderr, flush=True)
                continue
            name = slug(spec)
            out = work / f"autoround-{name}-{mix}.gguf"
            job = {"model": args.model, "mix": mix, "settings": settings_ar, "calib": str(texts["calib"]),
                   "calib_chunks": args.calib_chunks, "threads": args.threads, "out": str(out),
                   "folder": str(work / f"autoround-{name}-{mix}")}
            seconds, cpu = run([str(args.peers_python), str(Path(__file__).resolve()), "--autoround-worker",
                                json.dumps(job)], work / f"ar-{name}-{mix}.log",
                               env={**os.environ, "OMP_NUM_THREADS": str(args.threads), "LLAMA_CPP_ROOT": source})
            score(label, mix, out, seconds, cpu, autoround=json.loads(out.with_suffix(".json").read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(run_command(Path(sys.argv[0]).name, main))
