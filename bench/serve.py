"""Serving speed against llama-server: `bitquilt serve` and llama.cpp's server under concurrent streaming clients.

    python bench/serve.py --model smollm2-135m --concurrency 1,4,16 --max-tokens 32 --threads 1

Both servers run at once, each a subprocess started by this script: `bitquilt serve` (the model quantized W4 g128
RTN with a 4- or 8-bit LM head and embeddings, or a saved model given with --saved; `--max-batch` and `--max-queue`
the largest concurrency) and llama-server (xllamacpp's CPU wheel, `bench/llamacpp.py serve`: that many slots with
continuous batching, each slot's KV cache the longest prompt plus max_tokens; the packaged model's own GGUF unless
--gguf), the same --threads in both. Each is waited for on /health and warmed up (as many short requests at once as
the largest concurrency). One load generator (this process, the `openai` async client, `stream=True`) then sends
each server the same --requests completion requests, greedy (temperature 0), max_tokens --max-tokens each, from
--concurrency clients that each send their next request as soon as the last one ended, each request on a new
connection (a phase); the prompts are
passages of the packaged `wiki` text cut to --prompt-lengths tokens (the model's tokenizer), taken in turn. At each
concurrency the two servers run one after the other, the first alternating from level to level and round to round,
so that both see the same machine load; llama-server is asked not to reuse a cached prompt (`cache_prompt: false`:
bitquilt has no prompt cache, and the same prompts come again).

Per phase: aggregate decode tok/s = the generated tokens of all requests (each answer's `usage.completion_tokens`) ÷
the phase's wall seconds (first request sent to last answer ended, prefills included); TTFT = from sending a request
to its first chunk with text; inter-token latency (ITL) = the gaps between consecutive text chunks of an answer, all
answers pooled (both servers send one chunk per token here, but a token whose text is not final yet waits for the
next one); p50 / p99 by linear interpolation between order statistics (with few samples p99 is close to the
largest). Server CPU = the server process's user + system CPU seconds over the phase (/proc/PID/stat, all its
threads), and per generated token (prefills included); client CPU = this process's (the load generator); load
average (1 min) before and after the phase. With --rounds > 1 a cell is the median over the rounds. Results:
bench/results/serve.{json,md}, one record per (model, server, concurrency) and settings.

A MoBiQuant checkpoint (`--saved`, `--parts bits,elastic`), bitquilt serve alone. bits: at each --avg-bits within
its routed range, its perplexity routed there in this process (--ppl-windows windows of --seqlen tokens of
--ppl-data), then a phase of --requests requests from --bits-concurrency clients, each request with that `avg_bits`
(its answers' `usage.avg_bits` averaged); plotted in serve_bits_<model>[_int8].png (_int8: --int8-activations, the
perplexity's too). elastic: `bitquilt serve --elastic --elastic-target`, clients added in --elastic-stages every
--stage-seconds, each sending its next request (no `avg_bits` of its own) as its last one ends until the last stage
is over, /metrics read every 0.5 s; per answer its per-stream decode tok/s (first to last text chunk) and its
`usage.avg_bits`; plotted over time in serve_elastic_<model>[_int8].png.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import e2e
import llamacpp
from common import RESULTS, Bench, by_setting, command_line, doc_protocol, intro, machine, parser, provenance, run

from bitquilt.data.corpora import load_documents
from bitquilt.errors import UserError
from bitquilt.models.loading import resolve_path
from bitquilt.models.registry import fetched_dir, get_spec

SERVERS = ("bitquilt", "llama.cpp")
START_TIMEOUT_S = 600  # loading (and bitquilt's first kernel build) may take minutes on a busy machine
WARMUP_TOKENS = 4
LLAMA = {"cache_prompt": False}  # llama-server's own fields: no prompt reuse
SAMPLE_S = 0.5  # elastic run: how often /metrics is read
SAMPLED = ("active_sequences", "elastic_bits", "elastic_stream_tokens_per_second")  # what the elastic run keeps


# ---------------------------------------------------------------- the servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, all its threads (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Served:
    """A server subprocess: its name, OpenAI base URL and process; its stderr goes to a temporary file."""

    name: str
    url: str
    proc: subprocess.Popen
    log: Any
    info: dict = field(default_factory=dict)

    def why(self) -> str:
        self.log.seek(0)
        return " | ".join(self.log.read().decode(errors="replace").strip().splitlines()[-3:])

    def wait_ready(self) -> None:
        """Until /health answers 200; a UserError with the end of its stderr if it exits or takes too long."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UserError(f"{self.name} exited (status {self.proc.returncode}): {self.why()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url.removesuffix("/v1") + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            time.sleep(0.5)
        raise UserError(f"{self.name} did not answer /health within {START_TIMEOUT_S} s: {self.why()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def start_bitquilt(source: str, args: Any, slots: int, flags: tuple[str, ...] = ()) -> Served:
    port = free_port()
    argv = [sys.executable, "-m", "bitquilt.cli", "serve", source, "--port", str(port), "--threads", str(args.threads),
            "--max-batch", str(slots), "--max-queue", str(slots), "--max-tokens", str(args.max_tokens),
            *(["--int8-activations"] if args.int8_activations else []), *flags]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    return Served("bitquilt serve", f"http://127.0.0.1:{port}/v1", proc, log)


def start_llama(python: str, gguf: Path, args: Any, slots: int, slot_tokens: int) -> Served:
    spec = {"gguf": str(gguf), "threads": args.threads, "slots": slots, "slot_tokens": slot_tokens,
            "port": free_port()}
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([python, str(Path(llamacpp.__file__).resolve()), "serve", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    served = Served("llama-server", "", proc, log)
    line = proc.stdout.readline()  # printed once the model is loaded and the server listens
    if not line:
        proc.wait()
        raise UserError(f"llama-server exited (status {proc.returncode}): {served.why()}")
    served.info = json.loads(line)
    served.url = served.info["address"] + "/v1"
    return served


@contextlib.contextmanager
def servers(source: str, gguf: Path, args: Any, slots: int, slot_tokens: int) -> Iterator[dict[str, Served]]:
    """Both servers, running and answering /health, stopped on the way out."""
    started: dict[str, Served] = {}
    try:
        started["bitquilt"] = start_bitquilt(source, args, slots)
        started["llama.cpp"] = start_llama(args.llamacpp_python, gguf, args, slots, slot_tokens)
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            s.stop()


# ---------------------------------------------------------------- the load generator
async def one_request(client: Any, prompt: str, max_tokens: int, extra: dict) -> dict:
    """One streamed completion: when it was sent, the arrival times of its text chunks, its finish reason and usage."""
    out: dict[str, Any] = {"sent": time.perf_counter(), "chunks": [], "finish": None, "tokens": None, "bits": None,
                           "error": None}
    try:
        stream = await client.completions.create(model="served", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, **extra)
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices:
                if choice.text:
                    out["chunks"].append(now)
                out["finish"] = choice.finish_reason or out["finish"]
            if chunk.usage is not None:
                out["tokens"] = chunk.usage.completion_tokens
                out["bits"] = getattr(chunk.usage, "avg_bits", None)  # bitquilt serve on a MoBiQuant model
    except Exception as e:  # a failed request is counted, not fatal
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    out["ended"] = time.perf_counter()
    return out


def new_client(url: str) -> Any:
    """The `openai` async client of the load generator, on a new connection per request."""
    import httpx2
    from openai import AsyncOpenAI, DefaultAsyncHttpx2Client

    # a connection per request: llama-server (cpp-httplib) closes a kept-alive connection after 5 requests, and the
    # client's next request on it fails ("Server disconnected without sending a response"); both servers alike
    fresh = DefaultAsyncHttpx2Client(limits=httpx2.Limits(max_connections=1000, max_keepalive_connections=0))
    return AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600, http_client=fresh)


async def drive(url: str, prompts: list[str], requests: int, concurrency: int, max_tokens: int, extra: dict
                ) -> tuple[list[dict], float]:
    """`requests` requests from `concurrency` clients, each sending its next as soon as its last one ended, prompts
    taken in turn; the answers (in prompt order) and the wall seconds from the first sent to the last ended."""
    client = new_client(url)
    todo = iter(range(requests))
    answers: dict[int, dict] = {}

    async def client_loop() -> None:
        for i in todo:  # a shared iterator: each request goes to the first client free
            answers[i] = {"prompt": i % len(prompts), **await one_request(client, prompts[i % len(prompts)],
                                                                           max_tokens, extra)}

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return [answers[i] for i in range(requests)], wall


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0–100) by linear interpolation between order statistics; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def phase(served: Served, prompts: list[str], requests: int, concurrency: int, max_tokens: int,
          body: dict | None = None) -> dict:
    """One measured phase against `served`, `body` added to each request's: throughput, latencies, CPU and load
    (module docstring)."""
    extra = {"extra_body": LLAMA, "stream_options": {"include_usage": True}} if served.name == "llama-server" else {}
    if body:
        extra["extra_body"] = {**extra.get("extra_body", {}), **body}
    load0, cpu0, client0 = os.getloadavg()[0], process_cpu_s(served.proc.pid), time.process_time()
    answers, wall = asyncio.run(drive(served.url, prompts, requests, concurrency, max_tokens, extra))
    cpu, client = process_cpu_s(served.proc.pid) - cpu0, time.process_time() - client0
    done = [a for a in answers if a["error"] is None and a["finish"] is not None]
    tokens = sum(a["tokens"] if a["tokens"] is not None else len(a["chunks"]) for a in done)
    ttft = [((a["chunks"] or [a["ended"]])[0] - a["sent"]) * 1e3 for a in done]
    itl = [(b - a) * 1e3 for x in done for a, b in zip(x["chunks"], x["chunks"][1:], strict=False)]
    bits = [a["bits"] for a in done if a["bits"] is not None]
    finishes: dict[str, int] = {}
    for a in done:
        finishes[a["finish"]] = finishes.get(a["finish"], 0) + 1
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "requests": requests, "completed": len(done),
            "finish_reasons": finishes, "errors": [a["error"] for a in answers if a["error"]][:3],
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
            "server_cpu_s": cpu, "server_cpu_ms_per_token": 1e3 * cpu / tokens if tokens else None,
            "client_cpu_s": client, "load_start": load0, "load_end": os.getloadavg()[0],
            "tokens_per_request": [a["tokens"] for a in answers],
            "avg_bits": statistics.mean(bits) if bits else None}


def warm_up(served: Served, concurrency: int) -> None:
    """Untimed: `concurrency` short requests at once (bitquilt builds its kernel layouts on first calls)."""
    drive_prompts = [f"Warm-up request {i}: the weather today is" for i in range(concurrency)]
    phase(served, drive_prompts, concurrency, concurrency, WARMUP_TOKENS)


# ---------------------------------------------------------------- prompts, models
def make_prompts(model: str, n: int, lengths: list[int]) -> tuple[list[str], list[int]]:
    """`n` prompts: the first passages of the packaged `wiki` text long enough, each cut to the next of `lengths`
    tokens of the model's tokenizer (decoded back to text); and each text's length in tokens as served."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_path(model), local_files_only=True)
    texts, counts = [], []
    for doc in load_documents("wiki"):
        want = lengths[len(texts) % len(lengths)]
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        if len(ids) < want:
            continue
        text = tokenizer.decode(ids[:want]).strip()
        texts.append(text)
        counts.append(len(tokenizer(text)["input_ids"]))
        if len(texts) == n:
            return texts, counts
    raise UserError(f"the wiki text has fewer than {n} passages of {max(lengths)} tokens")


def bitquilt_source(args: Any) -> tuple[str, str]:
    """The model bitquilt serves (a saved directory) and how it was made: --saved, else the packaged model quantized
    RTN W4 g128 with a --head-bits head (e2e's save worker), saved in --workdir once and kept."""
    if args.saved:
        return args.saved, f"saved model `{args.saved}`"
    variant = e2e.Variant("uniform", 4, 128, head_bits=args.head_bits).name
    saved = Path(args.workdir) / f"{args.model}-{variant.replace(' ', '-')}"
    if not (saved / "quantization_config.json").exists():
        print(f"quantizing {args.model} as {variant} into {saved}", file=sys.stderr, flush=True)
        e2e.worker("save", {"model": args.model, "variant": variant, "saved": str(saved)},
                   f"quantizing {args.model}")
    return str(saved), f"RTN {variant}"


# ---------------------------------------------------------------- the report
def fmt(x: float | None, digits: int = 1) -> str:
    return "" if x is None else f"{x:,.{digits}f}"


def cell(r: dict, key: str) -> float | None:
    """The median over a record's rounds."""
    values = [p[key] for p in r["phases"] if p[key] is not None]
    return statistics.median(values) if values else None


def prompts_line(counts: list[int]) -> str:
    """"16 prompts (tokens: 4 × 32, 4 × 64, ...)": the prompt set by length as the model's tokenizer counts it."""
    by_length = {n: counts.count(n) for n in sorted(set(counts))}
    return f"{len(counts)} prompts (tokens: " + ", ".join(f"{k} × {n}" for n, k in by_length.items()) + ")"


def phase_prompt_tokens(settings: dict) -> int:
    """The prompt tokens of one phase: its requests take the prompts in turn."""
    counts = settings["prompt_tokens"]
    return sum(counts[i % len(counts)] for i in range(settings["requests"]))


def part_of(record: dict) -> str:
    return record["settings"].get("part", "compare")


def render(records: list[dict]) -> str:
    lines = intro("Serving speed: bitquilt serve and llama-server",
                  "Generated by `bench/serve.py`. " + doc_protocol(__doc__))
    lines += render_compare([r for r in records if part_of(r) == "compare"])
    lines += render_bits([r for r in records if part_of(r) == "bits"])
    lines += render_elastic([r for r in records if part_of(r) == "elastic"])
    return "\n".join(lines)


def render_compare(records: list[dict]) -> list[str]:
    lines = []
    for model, settings, rows in by_setting(records):
        s = settings
        lines += [f"## {model}: {s['threads']} thread{'s' if s['threads'] > 1 else ''}, max_tokens {s['max_tokens']}",
                  "",
                  f"bitquilt: {s['bitquilt']}{', int8 activations' if s['int8_activations'] else ''}; llama.cpp: "
                  f"`{s['gguf']}` (" + ", ".join(f"{k} {v}" for k, v in s["gguf_types"].items()) + " tensors). "
                  f"{s['requests']} requests per phase over {prompts_line(s['prompt_tokens'])}, "
                  f"{phase_prompt_tokens(s)} prompt tokens per phase; {s['slots']} slots (bitquilt --max-batch, "
                  f"llama.cpp n_parallel).", "",
                  "| clients | server | decode tok/s | ÷ llama-server | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
                  "| ITL p99 ms | completed | tokens | wall s | server CPU s | server CPU ms/token | client CPU s "
                  "| load | rounds |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        by_key = {(r["concurrency"], r["server"]): r for r in rows}
        for c in sorted({r["concurrency"] for r in rows}):
            ref = by_key.get((c, "llama.cpp"))
            for name in SERVERS:
                r = by_key.get((c, name))
                if r is None:
                    continue
                ratio = f"{cell(r, 'tok_s') / cell(ref, 'tok_s'):.2f}×" if ref and name != "llama.cpp" else ""
                loads = [x for p in r["phases"] for x in (p["load_start"], p["load_end"])]
                done = sum(p["completed"] for p in r["phases"])
                sent = sum(p["requests"] for p in r["phases"])
                lines.append(
                    f"| {c} | {name} | {fmt(cell(r, 'tok_s'))} | {ratio} | {fmt(cell(r, 'ttft_p50_ms'), 0)} "
                    f"| {fmt(cell(r, 'ttft_p99_ms'), 0)} | {fmt(cell(r, 'itl_p50_ms'))} "
                    f"| {fmt(cell(r, 'itl_p99_ms'))} | {done}/{sent} | {fmt(cell(r, 'tokens'), 0)} "
                    f"| {fmt(cell(r, 'wall_s'))} | {fmt(cell(r, 'server_cpu_s'))} "
                    f"| {fmt(cell(r, 'server_cpu_ms_per_token'))} | {fmt(cell(r, 'client_cpu_s'))} "
                    f"| {min(loads):.1f}–{max(loads):.1f} | {len(r['phases'])} |")
        finishes = {f"{r['server']} ×{r['concurrency']}": r["phases"][-1]["finish_reasons"] for r in rows}
        lines += ["", "Finish reasons (last round): " + "; ".join(
            f"{k} " + ", ".join(f"{reason} {n}" for reason, n in v.items()) for k, v in finishes.items()) + "."]
        lines += provenance(rows)
    return lines


def bits_groups(records: list[dict]) -> list[tuple[str, dict, list[dict]]]:
    """Bits records grouped by model and settings but their avg_bits, rows by avg_bits."""
    plain = [{**r, "asked": r["settings"]["avg_bits"],
              "settings": {k: v for k, v in r["settings"].items() if k != "avg_bits"}} for r in records]
    return [(model, settings, sorted(rows, key=lambda r: r["asked"])) for model, settings, rows in by_setting(plain)]


def render_bits(records: list[dict]) -> list[str]:
    lines = []
    for model, s, rows in bits_groups(records):
        name = plot_bits(model, rows)
        lines += [f"## {model}, MoBiQuant{int8_tag(s)[1]}: decode speed and perplexity against average bits", "",
                  f"{s['bitquilt']} (routed range {s['range'][0]:.2f}–{s['range'][1]:.2f} bits), {s['threads']} "
                  f"thread{'s' if s['threads'] > 1 else ''}; {s['requests']} requests per phase at "
                  f"{rows[0]['concurrency']} clients, each with its own `avg_bits`, max_tokens {s['max_tokens']}, "
                  f"{prompts_line(s['prompt_tokens'])}. Perplexity: the checkpoint routed at the same avg_bits "
                  f"in this process (`set_precision`, as `bitquilt eval --avg-bits`), {s['ppl_windows']} windows × "
                  f"{s['seqlen']} tokens of `{s['ppl_data']}`; its bits are those the evaluation used.", "",
                  "| avg_bits asked | bits used (usage, mean) | decode tok/s | ITL p50 ms | TTFT p50 ms | completed "
                  "| load | perplexity | bits used (perplexity) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            ph = r["phases"][0]
            lines.append(f"| {r['asked']:g} | {fmt(ph['avg_bits'], 2)} | {fmt(ph['tok_s'])} "
                         f"| {fmt(ph['itl_p50_ms'])} | {fmt(ph['ttft_p50_ms'], 0)} "
                         f"| {ph['completed']}/{ph['requests']} | {ph['load_start']:.1f}–{ph['load_end']:.1f} "
                         f"| {r['ppl']:.2f} | {r['ppl_bits']:.2f} |")
        lines += ["", f"![decode tok/s and perplexity against bits]({name})"] + provenance(rows)
    return lines


def render_elastic(records: list[dict]) -> list[str]:
    lines = []
    for r in records:
        s = r["settings"]
        name = plot_elastic(r)
        lines += [f"## {r['model']}, elastic mode{int8_tag(s)[1]}: --elastic {s['target']:g} under clients "
                  f"{' → '.join(map(str, s['stages']))}", "",
                  f"{s['bitquilt']}, {s['threads']} thread{'s' if s['threads'] > 1 else ''}, `--max-batch "
                  f"{r['concurrency']}`; clients added every {s['stage_seconds']:g} s, each sending its next request "
                  f"(max_tokens {s['max_tokens']}, no avg_bits of its own) as its last one ends, "
                  f"{prompts_line(s['prompt_tokens'])}; /metrics read every {SAMPLE_S:g} s. Per stage, the answers "
                  "sent in it: per-stream decode tok/s (first to last text chunk of an answer, p50 over answers) and "
                  "the bits their usage reports (mean; prompt tokens included); over the stage's /metrics samples, "
                  "the server's elastic level (lowest–highest) and the per-stream speed it acts on (p50).", "",
                  "| clients | answers | per-stream decode tok/s p50 | bits used (usage, mean) | elastic level "
                  "| server's per-stream tok/s p50 |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for row in stage_rows(r):
            lines.append(f"| {row['clients']} | {row['answers']} | {fmt(row['stream_tok_s'])} | {fmt(row['bits'], 2)} "
                         f"| {level_range(row['levels'])} | {fmt(row['server_stream_tok_s'])} |")
        errors = f" Errors: {r['errors']}." if r["errors"] else ""
        lines += ["", f"Load average {r['load'][0]:.1f} at the start, {r['load'][1]:.1f} at the end.{errors}", "",
                  f"![per-stream speed and bits over time]({name})"] + provenance([r])
    return lines


def saved_figure(fig: Any, name: str) -> str:
    """`fig` written to bench/results/NAME (atomically) and closed; NAME."""
    import matplotlib.pyplot as plt

    tmp = RESULTS / f"{name}.tmp.png"
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    tmp.replace(RESULTS / name)
    plt.close(fig)
    return name


def int8_tag(settings: dict) -> tuple[str, str]:
    """A MoBiQuant run's activations, as (a plot name's suffix, a heading's words)."""
    return ("_int8", ", int8 activations") if settings.get("int8_activations") else ("", "")


def plot_bits(model: str, rows: list[dict]) -> str:
    """Aggregate decode tok/s and perplexity against the bits used: bench/results/serve_bits_<model>[_int8].png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = [(r["phases"][0]["avg_bits"], r["phases"][0]["tok_s"], r["ppl_bits"], r["ppl"]) for r in rows]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color="tab:blue", label="decode tok/s (all streams)")
    ax.set_xlabel("average bits per weight used")
    ax.set_ylabel(f"decode tok/s, {rows[0]['concurrency']} clients", color="tab:blue")
    ppl = ax.twinx()
    ppl.plot([p[2] for p in pts], [p[3] for p in pts], "s--", color="tab:red", label="perplexity")
    ppl.set_ylabel(f"perplexity ({rows[0]['settings']['ppl_data']})", color="tab:red")
    ppl.set_yscale("log")
    ax.set_title(f"{model}, one MoBiQuant checkpoint served at each avg_bits")
    ax.grid(alpha=0.3)
    return saved_figure(fig, f"serve_bits_{model}{int8_tag(rows[0]['settings'])[0]}.png")


def plot_elastic(record: dict) -> str:
    """Per-stream speed (answers, and the server's average) and bits (level, answers' usage) over the elastic run:
    bench/results/serve_elastic_<model>[_int8].png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, answers, samples = record["settings"], record["answers"], record["samples"]
    fig, (speed, bits) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    done = [a for a in answers if a["stream_tok_s"] is not None]
    speed.plot([a["ended"] for a in done], [a["stream_tok_s"] for a in done], ".", color="tab:blue",
               label="an answer's decode tok/s (at its end)")
    speed.plot([m["t"] for m in samples], [m["elastic_stream_tokens_per_second"] for m in samples], "-",
               color="tab:cyan", label="server's per-stream speed (its last steps)")
    speed.axhline(s["target"], color="black", linestyle=":", label=f"target {s['target']:g}")
    speed.set_ylabel("per-stream tok/s")
    speed.legend(fontsize=7)
    bits.step([m["t"] for m in samples], [m["elastic_bits"] for m in samples], where="post", color="tab:green",
              label="elastic level")
    bits.plot([a["ended"] for a in answers if a["bits"] is not None], [a["bits"] for a in answers
                                                                        if a["bits"] is not None], ".",
              color="tab:orange", label="an answer's usage.avg_bits (at its end)")
    bits.set_ylabel("bits per weight")
    bits.set_xlabel("seconds")
    bits.legend(fontsize=7)
    for ax in (speed, bits):
        for i, n in enumerate(s["stages"]):
            ax.axvline(i * s["stage_seconds"], color="gray", alpha=0.4)
            ax.text(i * s["stage_seconds"], ax.get_ylim()[1], f" {n} clients", fontsize=7, va="top")
        ax.grid(alpha=0.3)
    speed.set_title(f"{record['model']}: bitquilt serve --elastic {s['target']:g}")
    return saved_figure(fig, f"serve_elastic_{record['model']}{int8_tag(record['settings'])[0]}.png")


# ---------------------------------------------------------------- a MoBiQuant checkpoint: bits, elastic mode
def bits_settings(args: Any, counts: list[int], part: str) -> dict:
    """The settings of a bits or elastic record (compare records have no `part`)."""
    return {"part": part, "bitquilt": f"saved model `{args.saved}`", "threads": args.threads,
            "max_tokens": args.max_tokens, "prompt_tokens": counts, "int8_activations": args.int8_activations}


def perplexities(saved: str, bits: list[float], args: Any) -> tuple[tuple[float, float], dict[float, dict]]:
    """The routed range of the MoBiQuant checkpoint `saved`, and at each of `bits` in it the perplexity (--ppl-data,
    --seqlen, --ppl-windows) with the bits it really used (`bitquilt eval --avg-bits` alike); the model let go."""
    import torch

    from bitquilt import kernels
    from bitquilt.api import load
    from bitquilt.eval import perplexity
    from bitquilt.flag_checks import in_routed_range
    from bitquilt.nn.slice_router import has_routers, precision_range, realised_bits, set_precision

    torch.set_num_threads(args.threads)
    model, tokenizer = load(saved)
    if not has_routers(model):
        raise UserError(f"--parts bits and elastic need a MoBiQuant checkpoint (--saved); {saved} has no routers")
    low, high = precision_range(model)
    out = {}
    for b in (b for b in bits if in_routed_range(b, low, high)):
        set_precision(model, b)
        with realised_bits(model) as used:
            with kernels.using(int8_activations=args.int8_activations):  # as the server runs it
                ppl = perplexity(model, tokenizer, args.ppl_data, args.seqlen, args.ppl_windows, progress=False).ppl
        out[b] = {"ppl": ppl, "ppl_bits": used["avg_bits"]}
        print(f"avg_bits {b:g}: perplexity {ppl:.2f} at {used['avg_bits']:.2f} bits", file=sys.stderr, flush=True)
    return (low, high), out


@contextlib.contextmanager
def bitquilt_alone(args: Any, slots: int, flags: tuple[str, ...] = ()) -> Iterator[Served]:
    """`bitquilt serve` on --saved with `flags`, answering and warmed up, stopped on the way out."""
    served = start_bitquilt(args.saved, args, slots, flags)
    try:
        served.wait_ready()
        warm_up(served, slots)
        yield served
    finally:
        served.stop()


def bits_part(args: Any, prompts: list[str], counts: list[int], bench: Bench) -> None:
    """Aggregate decode tok/s at --bits-concurrency with every request at each --avg-bits, beside the perplexity
    there."""
    (low, high), ppl = perplexities(args.saved, [float(b) for b in args.avg_bits.split(",")], args)
    c = args.bits_concurrency
    with bitquilt_alone(args, c) as served:
        for b, quality in ppl.items():
            result = phase(served, prompts, args.requests, c, args.max_tokens, {"avg_bits": b})
            print(f"avg_bits {b:g} ×{c}: {result['tok_s']:.1f} tok/s, usage {fmt(result['avg_bits'], 2)} bits",
                  file=sys.stderr, flush=True)
            settings = {**bits_settings(args, counts, "bits"), "avg_bits": b, "range": [low, high],
                        "requests": args.requests, "ppl_data": args.ppl_data, "seqlen": args.seqlen,
                        "ppl_windows": args.ppl_windows}
            bench.store({"model": args.model, "server": "bitquilt", "concurrency": c, "settings": settings,
                         "phases": [result], **quality, "source": args.saved, "command": command_line(),
                         "machine": machine()})


def metrics(base: str) -> dict[str, float]:
    """A server's /metrics, `bitquilt_` taken off the names."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        pairs = (line.split() for line in r.read().decode().splitlines() if line)
        return {name.removeprefix("bitquilt_"): float(value) for name, value in pairs}


async def staged(url: str, prompts: list[str], stages: list[int], seconds: float, max_tokens: int) -> dict:
    """Clients added in stages (stage i: `stages[i]` in all, `seconds` long), each sending its next request as soon
    as its last one ended until the last stage ends; /metrics sampled every SAMPLE_S until the last answer. Times in
    seconds from the start."""
    client = new_client(url)
    t0 = time.perf_counter()
    end = t0 + seconds * len(stages)
    turn = itertools.count()
    answers: list[dict] = []
    samples: list[dict] = []

    async def client_loop() -> None:
        while time.perf_counter() < end:
            answers.append(await one_request(client, prompts[next(turn) % len(prompts)], max_tokens, {}))

    async def sample() -> None:
        while True:
            m = await asyncio.to_thread(metrics, url.removesuffix("/v1"))
            samples.append({"t": time.perf_counter() - t0, **{k: m[k] for k in SAMPLED}})
            await asyncio.sleep(SAMPLE_S)

    sampler = asyncio.create_task(sample())
    loops = []
    for i, n in enumerate(stages):
        loops += [asyncio.create_task(client_loop()) for _ in range(n - len(loops))]
        await asyncio.sleep(max(0.0, t0 + seconds * (i + 1) - time.perf_counter()))
    await asyncio.gather(*loops)
    sampler.cancel()
    await client.close()
    return {"answers": [{"sent": a["sent"] - t0, "first": a["chunks"][0] - t0, "ended": a["ended"] - t0,
                         "tokens": len(a["chunks"]), "bits": a["bits"], "error": a["error"],
                         "stream_tok_s": (len(a["chunks"]) - 1) / (a["chunks"][-1] - a["chunks"][0])
                         if len(a["chunks"]) > 1 and a["chunks"][-1] > a["chunks"][0] else None}
                        for a in answers if a["chunks"]],
            "errors": [a["error"] for a in answers if a["error"]][:3], "samples": samples}


def stage_rows(record: dict) -> list[dict]:
    """Per stage of an elastic record: its answers (those sent during it): their per-stream decode tok/s (p50) and
    the bits their usage reports (mean); the server's level (lowest, highest) and the per-stream speed it acts on
    (p50) over the /metrics samples of the stage."""
    s = record["settings"]
    rows = []
    for i, n in enumerate(s["stages"]):
        start, stop = i * s["stage_seconds"], (i + 1) * s["stage_seconds"]
        sent = [a for a in record["answers"] if start <= a["sent"] < stop]
        speeds = [a["stream_tok_s"] for a in sent if a["stream_tok_s"] is not None]
        bits = [a["bits"] for a in sent if a["bits"] is not None]
        samples = [m for m in record["samples"] if start <= m["t"] < stop]
        levels = [m["elastic_bits"] for m in samples]
        rows.append({"clients": n, "answers": len(sent), "stream_tok_s": percentile(speeds, 50),
                     "bits": statistics.mean(bits) if bits else None,
                     "levels": (min(levels), max(levels)) if levels else None,
                     "server_stream_tok_s": percentile([m["elastic_stream_tokens_per_second"] for m in samples], 50)})
    return rows


def level_range(levels: tuple[float, float] | None) -> str:
    return "" if levels is None else f"{levels[0]:.2f}–{levels[1]:.2f}"


def elastic_part(args: Any, prompts: list[str], counts: list[int], bench: Bench) -> None:
    """`bitquilt serve --elastic --elastic-target` on --saved under clients rising in --elastic-stages."""
    stages = [int(n) for n in args.elastic_stages.split(",")]
    with bitquilt_alone(args, max(stages), ("--elastic", repr(args.elastic_target))) as served:
        load = os.getloadavg()[0]
        trace = asyncio.run(staged(served.url, prompts, stages, args.stage_seconds, args.max_tokens))
    trace["load"] = [load, os.getloadavg()[0]]
    settings = {**bits_settings(args, counts, "elastic"), "target": args.elastic_target, "stages": stages,
                "stage_seconds": args.stage_seconds}
    record = {"model": args.model, "server": "bitquilt", "concurrency": max(stages), "settings": settings, **trace,
              "source": args.saved, "command": command_line(), "machine": machine()}
    for row in stage_rows(record):
        print(f"elastic ×{row['clients']}: {fmt(row['stream_tok_s'])} tok/s per stream, usage "
              f"{fmt(row['bits'], 2)} bits, level {level_range(row['levels'])}", file=sys.stderr, flush=True)
    bench.store(record)


# ---------------------------------------------------------------- the run
def compare_part(args: Any, prompts: list[str], counts: list[int], bench: Bench) -> None:
    """bitquilt serve and llama-server at each --concurrency (module docstring)."""
    levels = [int(c) for c in args.concurrency.split(",")]
    args.llamacpp_python = str(llamacpp.check_python(args.llamacpp_python))
    gguf = Path(args.gguf) if args.gguf else fetched_dir(args.model) / get_spec(args.model).file
    source, about = bitquilt_source(args)
    slots = max(levels)
    info = e2e.gguf_info(gguf)
    settings = {"bitquilt": about, "int8_activations": args.int8_activations, "gguf": gguf.name,
                "gguf_types": info["gguf_types"], "threads": args.threads, "max_tokens": args.max_tokens,
                "requests": args.requests, "prompt_tokens": counts, "slots": slots}
    records: dict[tuple[str, int], dict] = {}
    with servers(source, gguf, args, slots, max(counts) + args.max_tokens + 16) as started:
        for s in started.values():
            warm_up(s, slots)
        versions = started["llama.cpp"].info["versions"]
        for rnd in range(args.rounds):
            for i, c in enumerate(levels):
                for name in SERVERS if (i + rnd) % 2 == 0 else SERVERS[::-1]:
                    result = phase(started[name], prompts, args.requests, c, args.max_tokens)
                    print(f"[round {rnd + 1}] {name} ×{c}: {result['tok_s']:.1f} tok/s, TTFT p50 "
                          f"{fmt(result['ttft_p50_ms'], 0)} ms, ITL p50 {fmt(result['itl_p50_ms'])} ms, "
                          f"{result['completed']}/{result['requests']} done, "
                          f"server CPU {result['server_cpu_s']:.1f} s, "
                          f"load {result['load_end']:.1f}", file=sys.stderr, flush=True)
                    record = records.setdefault((name, c), {"model": args.model, "server": name, "concurrency": c,
                                                            "settings": settings, "phases": []})
                    record["phases"].append(result)
                    record.update(source=source if name == "bitquilt" else str(gguf), command=command_line(),
                                  machine={**machine(), **versions})
                    bench.store(record)


PARTS = {"compare": compare_part, "bits": bits_part, "elastic": elastic_part}


def main() -> None:
    p = parser(__doc__, model="smollm2-135m", threads=1, workdir=str(llamacpp.ROOT / "out" / "serve"),
               helps={"threads": "threads of each server (bitquilt --threads, llama.cpp n_threads)",
                      "workdir": "where the quantized model is saved (kept for the next run)"})
    p.add_argument("--parts", default="compare", help="comma-separated: compare (bitquilt serve and llama-server; "
                   "default), bits and elastic (a MoBiQuant checkpoint given with --saved)")
    p.add_argument("--saved", help="serve this saved bitquilt model instead of quantizing --model (bits, elastic: "
                   "a MoBiQuant checkpoint of --model)")
    p.add_argument("--head-bits", type=int, choices=(4, 8), default=4,
                   help="bits of the LM head and embeddings of the RTN W4 g128 model (default 4)")
    p.add_argument("--int8-activations", action="store_true", help="bitquilt serve --int8-activations")
    p.add_argument("--gguf", help="llama.cpp's GGUF (default: the packaged model's own)")
    p.add_argument("--concurrency", default="1,4,16", help="concurrent clients, comma-separated")
    p.add_argument("--requests", type=int, default=32, help="requests per phase (≥ the largest concurrency)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts, taken in turn")
    p.add_argument("--prompt-lengths", default="32,64,128,256", help="prompt lengths in tokens, taken in turn")
    p.add_argument("--rounds", type=int, default=1, help="phases per server and concurrency (cells: medians)")
    p.add_argument("--llamacpp-python", default=str(llamacpp.PYTHON), help="Python of the venv with xllamacpp")
    p.add_argument("--avg-bits", default="2.5,3,3.5,4,5,6",
                   help="bits: the requests' avg_bits (those outside the checkpoint's routed range left out)")
    p.add_argument("--bits-concurrency", type=int, default=4, help="bits: concurrent clients")
    p.add_argument("--ppl-data", default="wiki", help="bits: perplexity text")
    p.add_argument("--seqlen", type=int, default=512, help="bits: perplexity window tokens")
    p.add_argument("--ppl-windows", type=int, default=8, help="bits: perplexity windows")
    p.add_argument("--elastic-target", type=float, default=4.0, help="elastic: bitquilt serve --elastic (tok/s)")
    p.add_argument("--elastic-stages", default="1,4,16", help="elastic: clients in each stage, rising")
    p.add_argument("--stage-seconds", type=float, default=40.0, help="elastic: seconds of each stage")
    args = p.parse_args()
    parts = args.parts.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    lengths = [int(n) for n in args.prompt_lengths.split(",")]
    stages = [int(n) for n in args.elastic_stages.split(",")]
    largest = max(levels if "compare" in parts else [], default=1)
    if min(levels) < 1 or args.requests < largest or args.max_tokens < 2 or args.rounds < 1 or min(lengths) < 1:
        raise UserError("need concurrency ≥ 1, --requests ≥ the largest concurrency, --max-tokens ≥ 2, --rounds ≥ 1")
    if set(parts) - set(PARTS) or ({"bits", "elastic"} & set(parts) and not args.saved):
        raise UserError(f"--parts: some of {', '.join(PARTS)}; bits and elastic need --saved (a MoBiQuant checkpoint)")
    if stages != sorted(stages) or stages[0] < 1 or args.stage_seconds <= 0 or args.bits_concurrency < 1:
        raise UserError("need rising --elastic-stages ≥ 1, --stage-seconds > 0, --bits-concurrency ≥ 1")
    prompts, counts = make_prompts(args.model, args.prompts, lengths)
    bench = Bench("serve", ("model", "server", "concurrency"), render)
    for part in parts:
        PARTS[part](args, prompts, counts, bench)
    print(f"wrote {Path(__file__).parent / 'results' / 'serve.md'}", file=sys.stderr)


if __name__ == "__main__":
    run(main)
