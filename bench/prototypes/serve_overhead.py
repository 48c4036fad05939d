"""Ad hoc: what `bitquilt serve` costs over `bitquilt generate` for one request, and how fast it answers /health
while a sequence decodes.

    python bench/prototypes/serve_overhead.py --model out/q4h8 --rounds 3 --threads 1 --tokens 64

Each round runs `bitquilt generate --json --ignore-eos` (a fresh process) and one non-streamed greedy request of the
same prompt and length to a server started once (the prompt chosen so that neither stops early: tokens counted),
alternating; end-to-end tokens/s is new tokens ÷ (prefill + decode) for generate and ÷ the request's wall time for the
server (HTTP and JSON included). Meanwhile /health is asked every 50 ms; its latency is the event loop's answer time
while the decode thread runs. Writes bench/results/serve_overhead.{json,md}.
"""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import finish, intro, parser, run, run_child, run_facts, run_header, write_report  # noqa: E402

PROMPT = "Once upon a time"


def _call(port: int, method: str, path: str, body: dict | None = None) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json"})
    return conn.getresponse().read()


def _generate(model: str, tokens: int, threads: int) -> float:
    """End-to-end tokens/s of `bitquilt generate`."""
    child = run_child([sys.executable, "-m", "bitquilt.cli", "generate", model, "--prompt", PROMPT, "--max-new-tokens",
                       str(tokens), "--ignore-eos", "--threads", str(threads), "--json"])
    out = json.loads(child.stdout)
    seconds = out["prompt_tokens"] / out["prefill_tokens_per_s"] + (out["new_tokens"] - 1) / out["decode_tokens_per_s"]
    return out["new_tokens"] / seconds


def _served(port: int, tokens: int) -> tuple[float, list[float]]:
    """End-to-end tokens/s of one request, and the /health latencies (s) seen while it ran."""
    done: list[dict] = []
    request = threading.Thread(target=lambda: done.append(json.loads(_call(
        port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0}))))
    start = time.perf_counter()
    request.start()
    latencies = []
    while request.is_alive():
        t0 = time.perf_counter()
        _call(port, "GET", "/health")
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.05)
    wall = time.perf_counter() - start
    return done[0]["usage"]["completion_tokens"] / wall, latencies


def render(record: dict) -> str:
    lines = intro("bitquilt serve against bitquilt generate, one request", __doc__.split("\n\n", 2)[2])
    lines += [run_header(record["facts"]), "", "| round | generate tok/s | serve tok/s | serve ÷ generate "
              "| /health p50 ms | /health max ms |", "|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(record["rounds"], 1):
        lines.append(f"| {i} | {r['generate']:.1f} | {r['serve']:.1f} | {r['serve'] / r['generate']:.2f} | "
                     f"{r['health_p50_ms']:.1f} | {r['health_max_ms']:.1f} |")
    ratio = statistics.median(r["serve"] / r["generate"] for r in record["rounds"])
    lines += ["", f"Median serve ÷ generate: {ratio:.2f}; {record['tokens']} new tokens, {record['threads']} "
              f"thread(s), model `{record['model']}`."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = parser(__doc__, model="smollm2-135m", threads=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    facts = run_facts()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "bitquilt.cli", "serve", args.model, "--port", str(port),
                               "--threads", str(args.threads), "--max-tokens", str(args.tokens)])
    try:
        while True:
            try:
                _call(port, "GET", "/health")
                break
            except OSError:
                time.sleep(0.5)
        _served(port, 4)  # warm-up
        rounds = []
        for _ in range(args.rounds):
            generate = _generate(args.model, args.tokens, args.threads)
            serve, latencies = _served(port, args.tokens)
            rounds.append({"generate": generate, "serve": serve, "health_p50_ms": 1000 * statistics.median(latencies),
                           "health_max_ms": 1000 * max(latencies)})
    finally:
        server.terminate()
        server.wait()
    write_report("serve_overhead", {"facts": finish(facts), "model": args.model, "tokens": args.tokens,
                                    "threads": args.threads, "rounds": rounds}, render)


if __name__ == "__main__":
    run(main)
