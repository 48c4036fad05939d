"""K-quant GGUF files side by side: llama.cpp's `llama-quantize --imatrix` against bitquilt's `--gguf-type` export of
the same mix, every file scored by llama.cpp's own `llama-perplexity`.

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
Every file: size and `llama-perplexity -c 512` over the first --chunks chunks of wiki (BoolQ passages) and lambada.

    .venv/bin/python bench/gguf_kquants.py --model smollm2-135m --mixes Q2_K,Q3_K_M,Q4_K_M \
        --methods "gptq;gptq --recon-steps 50 --opt recon.lr=0.01 --opt recon.clip=False"
Results: bench/results/gguf_kquants.{json,md}, rewritten after every file (records of other models kept; a model's
files already measured with the same calibration and perplexity settings are skipped, so runs add to its table);
files stay in --workdir.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("llama-quantize", "llama-imatrix", "llama-perplexity")


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


def run(command: list[str], log: Path) -> float:
    """Run to the end (output to `log`), raise with its tail on failure; wall seconds."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise RuntimeError(f"{command[0]} failed: {log.read_text()[-1500:]}")
    return time.perf_counter() - t0


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


def earlier_rows(results: Path, model: str, settings: dict) -> list[dict]:
    """The rows of `model`'s record when it was measured with the same `settings` (a later run adds to them)."""
    record = load_records(results).get(model, {})
    return record.get("rows", []) if all(record.get(k) == v for k, v in settings.items()) else []


def write_results(results: Path, model: str, rows: list[dict], settings: dict, bin_dir: Path) -> None:
    """`model`'s rows into results.json (other models' records kept) and the table of every model into results.md."""
    results.parent.mkdir(parents=True, exist_ok=True)
    records = load_records(results)
    records[model] = {"rows": rows, **settings, "llama.cpp": str(bin_dir)}
    record_file = results.with_suffix(".json")
    record_file.write_text(json.dumps(records, indent=1))
    lines = ["# K-quant GGUF files: llama.cpp's imatrix quantization vs bitquilt's export of the same mix", "",
             "`python bench/gguf_kquants.py --model MODEL --mixes Q2_K,Q3_K_M,Q4_K_M`. Every file scored by "
             "llama.cpp's `llama-perplexity -c 512` (first N chunks of each text; wiki = BoolQ's Wikipedia "
             "passages, lambada = LAMBADA passages). Calibration: the same text for `llama-imatrix` (512-token "
             "chunks) and bitquilt (as many 512-token windows). llama.cpp requantizes the packaged GGUF, whose "
             "dequantized weights are bitquilt's fp32 model. Seconds: llama.cpp's imatrix + quantize, bitquilt's "
             "quantize (CPU, 2 cores shared with other jobs: indicative only).", ""]
    for name, record in records.items():
        lines += [f"## {name} ({record['calib_chunks']} calibration chunks of {record.get('calib', 'sciq')}, "
                  f"{record['chunks']} perplexity chunks)",
                  "", "| mix | file | size MB | ppl wiki | ppl lambada | seconds |", "|---|---|---:|---:|---:|---:|"]
        ppl = [[f"{r[k]:.2f}" if k in r else "—" for k in ("ppl_wiki", "ppl_lambada")] for r in record["rows"]]
        lines += [f"| {r['mix']} | {r['file']} | {r['size_mb']:.2f} | {p[0]} | {p[1]} | {r['seconds']:.0f} |"
                  for r, p in zip(record["rows"], ppl, strict=True)]
        lines.append("")
    results.with_suffix(".md").write_text("\n".join(lines))


def main() -> None:
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
    args = p.parse_args()

    from bitquilt.cache import cache_dir
    from bitquilt.models import registry

    bin_dir = build_llamacpp(cache_dir() / "llamacpp")
    work = args.workdir / args.model
    work.mkdir(parents=True, exist_ok=True)
    texts = write_texts(args.model, work, args.calib_data, args.calib_chunks)
    original = registry.model_dir(args.model) / registry.MODELS[args.model].file
    settings = {"calib": args.calib_data, "calib_chunks": args.calib_chunks, "chunks": args.chunks,
                "texts": args.texts}
    rows = earlier_rows(args.results, args.model, settings)
    measured = {(r["mix"], r["file"]) for r in rows}
    imatrix, imatrix_s = work / "imatrix.gguf", None

    def score(label: str, mix: str, gguf_file: Path, seconds: float) -> None:
        row = {"model": args.model, "mix": mix, "file": label, "size_mb": gguf_file.stat().st_size / 1e6,
               "seconds": seconds}
        for text in args.texts.split(","):
            row[f"ppl_{text}"] = perplexity(bin_dir, gguf_file, texts[text], args.chunks, args.threads,
                                            work / f"{gguf_file.stem}.{text}.log")
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_results(args.results, args.model, rows, settings, bin_dir)  # after every file

    for mix in args.mixes.split(","):
        if (mix, "llama.cpp imatrix") not in measured:
            if imatrix_s is None:  # once per run: the calibration text is the run's
                imatrix_s = run([str(bin_dir / "llama-imatrix"), "-m", str(original), "-f", str(texts["calib"]),
                                 "-c", "512", "--chunks", str(args.calib_chunks), "-t", str(args.threads), "-o",
                                 str(imatrix)], work / "imatrix.log")
            out = work / f"llamacpp-{mix}.gguf"
            seconds = run([str(bin_dir / "llama-quantize"), "--allow-requantize", "--imatrix", str(imatrix),
                           str(original), str(out), mix, str(args.threads)], work / f"quantize-{mix}.log")
            score("llama.cpp imatrix", mix, out, seconds + imatrix_s)
        for entry in filter(None, (e.strip() for e in args.methods.split(";"))):
            if (mix, f"bitquilt {entry}") in measured:
                continue
            method, *flags = shlex.split(entry)
            slug = re.sub(r"[^A-Za-z0-9.]+", "_", entry).strip("_")
            saved, out = work / f"bitquilt-{slug}-{mix}", work / f"bitquilt-{slug}-{mix}.gguf"
            t0 = time.perf_counter()
            bq = [sys.executable, "-m", "bitquilt.entry"]
            run([*bq, "quantize", args.model, "--gguf-type", mix, "--method", method, *flags, "--calib-data",
                 str(texts["calib"]), "--calib-samples", str(args.calib_chunks), "--calib-seqlen", "512",
                 "--threads", str(args.threads), "-o", str(saved), "--overwrite"], work / f"bq-{slug}-{mix}.log")
            quantize_s = time.perf_counter() - t0
            run([*bq, "export", str(saved), "--to", "gguf", "-o", str(out), "--overwrite"],
                work / f"export-{slug}-{mix}.log")
            score(f"bitquilt {entry}", mix, out, quantize_s)


if __name__ == "__main__":
    main()
