"""llama.cpp for the benches: xllamacpp (a prebuilt CPU wheel, an optional bench dependency that no test needs) in a
venv of its own, run in a subprocess of that venv's Python (llama-cpp-python has no wheel on PyPI):

    python3 -m venv .venv-llamacpp
    .venv-llamacpp/bin/pip install xllamacpp==2026.10.11549 numpy

Bench side (the bench's own venv): `check_python` finds that venv's Python, `run_worker` runs a worker and returns
what it printed. Worker side (.venv-llamacpp; this module imports only the standard library at the top, xllamacpp
inside the functions): `server` starts llama.cpp on a GGUF in this process, `speed` measures prefill and decode,
`serve` runs llama-server on HTTP until the process is killed (bench/serve.py):

    .venv-llamacpp/bin/python bench/llamacpp.py speed '{"gguf": "m.gguf", "prompt": [1, 2, 3], "new_tokens": 4,
                                                      "threads": 1}'
    .venv-llamacpp/bin/python bench/llamacpp.py serve '{"gguf": "m.gguf", "threads": 1, "slots": 16,
                                                      "slot_tokens": 512, "port": 8080}'
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-llamacpp" / "bin" / "python"
INSTALL = "python3 -m venv .venv-llamacpp; .venv-llamacpp/bin/pip install xllamacpp==2026.10.11549 numpy"


# ---------------------------------------------------------------- bench side
def check_python(path: str | Path = PYTHON) -> Path:
    """The Python of the venv with xllamacpp; a UserError saying how to install it if it is not there."""
    from bitquilt.errors import UserError

    python = Path(path)
    if not python.is_file():
        raise UserError(f"{python} not found: install llama.cpp's wheel first ({INSTALL}), or pass --llamacpp-python")
    return python


def run_worker(command: list[str], what: str) -> str:
    """Run a worker process to the end and return its stdout; a UserError with the end of its stderr if it fails."""
    from bitquilt.errors import UserError

    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"{what} failed (exit status {proc.returncode}): "
                        f"{' | '.join(proc.stderr.strip().splitlines()[-3:])}")
    return proc.stdout


def run_json_worker(command: list[str], what: str) -> dict[str, Any]:
    """`run_worker` for a worker that prints its result as one JSON object on its last stdout line."""
    return json.loads(run_worker(command, what).strip().splitlines()[-1])


# ---------------------------------------------------------------- worker side (either venv)
def cpu_seconds() -> float:
    """CPU time of this process so far, all its threads, user + system: the clock of every CPU-time rate."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux VmHWM, else ru_maxrss), in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_decode(start: Callable[[int], Callable[[list[int]], int]], prompt: list[int], new_tokens: int
                 ) -> dict[str, float]:
    """A bitquilt runtime's greedy prefill of `prompt` in one pass and `new_tokens` − 1 single-token steps, timed on
    the wall clock and on this process's CPU time: `start(max_len)` readies a sequence (inside the prefill's time)
    and returns `step(ids) -> the next token`."""
    w0, c0 = time.perf_counter(), cpu_seconds()
    step = start(len(prompt) + new_tokens)
    token = step(prompt)
    w1, c1 = time.perf_counter(), cpu_seconds()
    for _ in range(new_tokens - 1):
        token = step([token])
    w2, c2 = time.perf_counter(), cpu_seconds()
    n, steps = len(prompt), new_tokens - 1
    return {"prefill_tokens_per_s": n / (w1 - w0), "prefill_cpu_tokens_per_s": n / (c1 - c0),
            "decode_tokens_per_s": steps / (w2 - w1), "decode_cpu_tokens_per_s": steps / (c2 - c1),
            "prefill_wall_s": w1 - w0, "prefill_cpu_s": c1 - c0, "decode_wall_s": w2 - w1, "decode_cpu_s": c2 - c1,
            "decode_steps": steps}


def warmup_prompt(prompt: list[int], vocab_size: int) -> list[int]:
    """Eight tokens for an untimed warm-up, sharing no prefix with `prompt` (so llama.cpp's prompt cache cannot
    shorten the timed prefill): the prompt's first eight with the first one changed."""
    head = list(prompt[:8])
    head[0] = (head[0] + 1) % vocab_size
    return head


# ---------------------------------------------------------------- llama.cpp side (runs in .venv-llamacpp)
def server(gguf_file: str | Path, threads: int, **fields: Any) -> Any:
    """An xllamacpp server (llama.cpp's, in this process; requests go through its `handle_*` methods, or HTTP at its
    `listening_address`) on `gguf_file`: one slot, `threads` threads for decode and for prompt batches, llama.cpp's
    defaults otherwise; `fields` set further `CommonParams` attributes (n_ctx, embedding, n_parallel, ...)."""
    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = str(gguf_file)
    params.n_parallel = 1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
    for name, value in fields.items():
        setattr(params, name, value)
    return xlc.Server(params)


def complete(srv: Any, body: dict[str, Any]) -> dict[str, Any]:
    """One `/v1/completions` request; a RuntimeError with llama.cpp's message if it answers with an error."""
    reply = srv.handle_completions(body)
    if not isinstance(reply, dict) or "timings" not in reply:
        raise RuntimeError(f"llama.cpp completion failed: {str(reply)[:500]}")
    return reply


def speed(gguf: str, prompt: list[int], new_tokens: int, threads: int, vocab_size: int) -> dict[str, Any]:
    """Greedy prefill of `prompt` then `new_tokens` − 1 single-token decode steps, as bitquilt's `decode` runs them.

    After an untimed warm-up: request 1 evaluates the whole prompt in one batch and samples the first token (the
    prefill); request 2 sends prompt + that token, so llama.cpp reuses the prompt's KV cache, evaluates the one new
    token and decodes the rest (`new_tokens` − 1 single-token forward passes in all: the decode). Wall rates are
    llama.cpp's own timings: prompt eval ms per token of request 1, eval ms per token of request 2 (its decode steps
    after the first, which goes through the prompt path: `decode_all_steps_tokens_per_s` counts that one too); CPU
    rates divide the tokens by this process's CPU time over each request (`cpu_seconds`), so the decode's covers
    all `new_tokens` − 1 steps. Raises if llama.cpp did not evaluate what was asked.
    """
    import xllamacpp as xlc

    n = len(prompt)
    t0 = time.perf_counter()
    batch = max(n, 512)  # the whole prompt in one batch (llama.cpp's default is 2048 / ubatch 512)
    # swa_full: a sliding-window model (Gemma 3) keeps every position's keys, as bitquilt does, so that request 2
    # reuses the prompt's cache (a window-sized cache cannot be reused there); no change for other models
    srv = server(gguf, threads, n_ctx=n + new_tokens + 8, n_batch=batch, n_ubatch=batch, swa_full=True)
    load_s = time.perf_counter() - t0
    greedy = {"temperature": 0, "ignore_eos": True, "cache_prompt": True}
    complete(srv, {**greedy, "prompt": warmup_prompt(prompt, vocab_size), "n_predict": 2})
    ready_s = time.perf_counter() - t0

    w0, c0 = time.perf_counter(), cpu_seconds()
    first = complete(srv, {**greedy, "prompt": prompt, "n_predict": 1, "logprobs": 1})
    w1, c1 = time.perf_counter(), cpu_seconds()
    token = first["choices"][0]["logprobs"]["content"][0]["id"]
    rest = complete(srv, {**greedy, "prompt": [*prompt, token], "n_predict": new_tokens - 1})
    w2, c2 = time.perf_counter(), cpu_seconds()

    p, d = first["timings"], rest["timings"]
    steps = d["prompt_n"] + d["predicted_n"] - 1  # single-token forward passes of request 2
    if (p["cache_n"], p["prompt_n"]) != (0, n) or (d["cache_n"], d["prompt_n"], steps) != (n, 1, new_tokens - 1):
        raise RuntimeError(f"llama.cpp evaluated other tokens than asked: prefill {p}, decode {d}")
    all_ms = d["prompt_ms"] + d["predicted_ms"]  # every decode step, the first one through the prompt path
    eval_ms = d["predicted_per_token_ms"] if d["predicted_n"] > 1 else all_ms / steps
    return {"prefill_tokens_per_s": n / p["prompt_ms"] * 1e3, "prefill_cpu_tokens_per_s": n / (c1 - c0),
            "decode_tokens_per_s": 1e3 / eval_ms, "decode_cpu_tokens_per_s": steps / (c2 - c1),
            "decode_all_steps_tokens_per_s": steps / all_ms * 1e3,
            "prefill_wall_s": p["prompt_ms"] / 1e3, "prefill_cpu_s": c1 - c0, "prefill_request_s": w1 - w0,
            "decode_wall_s": all_ms / 1e3, "decode_cpu_s": c2 - c1, "decode_request_s": w2 - w1,
            "decode_steps": steps, "peak_rss_mb": peak_rss_mb(), "setup_s": load_s, "ready_s": ready_s,
            "timings": {"prefill": p, "decode": d},
            "versions": {"xllamacpp": xlc.__version__, "llama.cpp system": xlc.get_system_info().strip()}}


def serve(gguf: str, threads: int, slots: int, slot_tokens: int, port: int) -> None:
    """llama-server on `gguf` at 127.0.0.1:`port` until this process is killed: `slots` sequences decoding together
    (continuous batching, llama-server's default), each with a KV cache of `slot_tokens` positions (n_ctx is shared
    out among the slots), `threads` threads; prints {"address", "versions"} once it answers."""
    import xllamacpp as xlc

    srv = server(gguf, threads, n_parallel=slots, n_ctx=slots * slot_tokens, cont_batching=True, port=port)
    print(json.dumps({"address": srv.listening_address,
                      "versions": {"xllamacpp": xlc.__version__, "llama.cpp system": xlc.get_system_info().strip()}}),
          flush=True)
    threading.Event().wait()


COMMANDS = {"speed": "gguf, prompt, new_tokens, threads, vocab_size",
            "serve": "gguf, threads, slots, slot_tokens, port"}

if __name__ == "__main__":
    if sys.argv[1:2] not in [[c] for c in COMMANDS] or len(sys.argv) != 3:
        sys.exit("usage: " + "; ".join(f"llamacpp.py {c} JSON (keys: {k})" for c, k in COMMANDS.items()))
    if sys.argv[1] == "serve":
        serve(**json.loads(sys.argv[2]))
    print(json.dumps(speed(**json.loads(sys.argv[2]))), flush=True)
