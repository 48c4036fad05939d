"""How the native runner's prefill grows with the prompt: 512, 1,024 and 2,048 tokens through `bitquilt-native`.

    python bench/native_prefill.py --threads 1,2 --repeats 3 [--runners before=OTHER/bitquilt-native]

The export is the default packaged model quantized as the standalone tests' (`bitquilt quantize smollm2-135m --method
rtn --head-bits 8 --stream`, then `bitquilt export --to standalone`), written once into --workdir unless --export
names one. Each prompt is the first N tokens of Wikipedia passages in the export's tokenizer, as text (which the
runner tokenizes again: the count it reports is the one shown). One process per measurement generates one token; the
lengths (and the runners, where --runners names others beside this checkout's) alternate within each repeat, so that
they see the same load. Reported: the prefill's wall seconds (prompt
tokens over the prefill rate the runner reports), best and median over the repeats (on a shared machine load only
adds time: the best is the closest to the program's own), the whole process's wall and CPU seconds (user + system,
loading included; medians), and the load average; then the ratio of the longest prompt's best prefill to the
shortest's (4.0 is linear per token). Results: bench/results/native_prefill.{json,md}.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

LENGTHS = (512, 1024, 2048)


def default_export(workdir: Path) -> Path:
    """The default model's standalone export under `workdir`, quantized and exported on the first run."""
    from bitquilt.models.registry import DEFAULT_MODEL

    saved, out = workdir / "saved", workdir / "standalone"
    cli = [sys.executable, "-m", "bitquilt.cli"]
    if not saved.exists():
        subprocess.run([*cli, "quantize", DEFAULT_MODEL, "--method", "rtn", "--head-bits", "8", "--stream", "-o",
                        str(saved)], check=True)
    if not out.exists():
        subprocess.run([*cli, "export", str(saved), "-o", str(out), "--to", "standalone"], check=True)
    return out


def prompts(export: Path) -> dict[int, str]:
    """Text of the first N tokens of Wikipedia passages, per length."""
    from bitquilt.data.corpora import load_documents
    from bitquilt.runtime.tokenizer import FastTokenizer

    tokenizer = FastTokenizer(export)
    ids: list[int] = []
    for document in load_documents("wiki"):
        ids += tokenizer.encode(document)
        if len(ids) > max(LENGTHS):
            break
    return {n: tokenizer.decode(ids[:n]) for n in LENGTHS}


def measure(command: list[str]) -> dict:
    from common import run_child

    done = run_child(command)
    if done.returncode:
        raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
    result = json.loads(done.stdout)
    return {"prompt_tokens": result["prompt_tokens"],
            "prefill_s": result["prompt_tokens"] / result["prefill_tokens_per_s"], "wall_s": done.wall_s,
            "cpu_s": done.cpu_s}


def render(report: dict) -> str:
    from common import doc_protocol, run_header

    lines = ["# Native runner: prefill time against prompt length", "", doc_protocol(__doc__), "",
             run_header(report["facts"]), "",
             "| runner | threads | prompt tokens | best prefill s | median prefill s | process wall s | process CPU s "
             "| × shortest (best prefill) | load avg |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in report["rows"]:
        lines.append(f"| {row['runner']} | {row['threads']} | {row['prompt_tokens']} | {row['best_prefill_s']:.3f} | "
                     f"{row['prefill_s']:.3f} | {row['wall_s']:.2f} | "
                     f"{row['cpu_s']:.2f} | {row['ratio']:.2f} | {row['loadavg']} |")
    lines.append("")
    for (runner, threads), ratio in zip(report["settings"], report["ratios"], strict=True):
        lines.append(f"{runner}, {threads} thread(s): the {max(LENGTHS)}-token prefill took "
                     f"{ratio['prefill']:.2f}× the {min(LENGTHS)}-token one (process CPU seconds: "
                     f"{ratio['cpu']:.2f}×).")
    return "\n".join(lines) + "\n"


def main() -> None:
    from common import finish, loadavg, parser, run_facts, write_report

    from bitquilt.runtime.standalone.library import runner_path

    p = parser(__doc__, workdir="/tmp/bitquilt-native-prefill")
    p.add_argument("--export", help="a standalone export (default: the default model's, made in --workdir)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runners", default="", help="other runners to time beside this checkout's: name=path,...")
    args = p.parse_args()
    runners = {"this checkout": str(runner_path()), **dict(r.split("=", 1) for r in args.runners.split(",") if r)}
    facts = run_facts()
    export = Path(args.export) if args.export else default_export(Path(args.workdir))
    texts = prompts(export)
    rows, settings, ratios = [], [], []
    for threads in map(int, args.threads.split(",")):
        runs = {(name, n): [] for name in runners for n in LENGTHS}
        for _ in range(args.repeats):
            for name, n in runs:
                runs[name, n].append(measure([runners[name], str(export), "--prompt", texts[n], "--max-new-tokens",
                                              "1", "--threads", str(threads), "--json"]))
        medians = {key: {k: statistics.median(r[k] for r in results) for k in ("prefill_s", "wall_s", "cpu_s")}
                   | {"best_prefill_s": min(r["prefill_s"] for r in results)} for key, results in runs.items()}
        for name, n in runs:
            first = medians[name, min(LENGTHS)]
            rows.append({"runner": name, "threads": threads, "prompt_tokens": runs[name, n][0]["prompt_tokens"],
                         **medians[name, n], "ratio": medians[name, n]["best_prefill_s"] / first["best_prefill_s"],
                         "loadavg": loadavg()})
            print(f"{name} {threads}t {rows[-1]['prompt_tokens']} tokens: prefill {rows[-1]['best_prefill_s']:.3f} s",
                  flush=True)
            if n == max(LENGTHS):
                settings.append((name, threads))
                ratios.append({"prefill": rows[-1]["ratio"], "cpu": medians[name, n]["cpu_s"] / first["cpu_s"]})
    write_report("native_prefill", {"facts": finish(facts), "export": str(export), "rows": rows,
                                    "settings": settings, "ratios": ratios}, render)


if __name__ == "__main__":
    from common import run

    run(main)
