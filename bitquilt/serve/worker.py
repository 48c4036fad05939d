"""One sequence at a time behind an asyncio queue: requests wait in the queue (a full one is refused at once), one
decode thread runs them in turn with `bitquilt.runtime.engines.decode` while the event loop keeps answering, and
each request's text comes back as events on its own asyncio queue. A request whose client went away is cancelled:
skipped if it waits, its decode stopped at the next token if it runs."""

from __future__ import annotations

import asyncio
import contextvars
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from bitquilt.flag_checks import MAX_SEED
from bitquilt.serve.protocol import ApiError, Request
from bitquilt.serve.text import TextStream


@dataclass
class Job:
    """A request in the server: its prompt ids and settings, its events ("text", str), ("done", finish_reason,
    usage) or ("error", message), and its cancellation."""

    ids: list[int]
    request: Request
    max_tokens: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ended: bool = False  # its last event is sent: nothing left to cancel


@dataclass
class Counters:
    """What /metrics reports."""

    requests: int = 0
    rejected: int = 0  # refused because the queue was full
    cancelled: int = 0  # clients that went away before their answer ended
    prompt_tokens: int = 0
    generated_tokens: int = 0
    active: int = 0  # sequences decoding now (0 or 1)
    run_tokens: int = 0  # tokens of the running (or last) sequence
    run_started: float = 0.0
    run_ended: float | None = None


class Worker:
    """The queue and the decode thread of a model (module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, engine: str, max_queue: int):
        import torch  # the server runs torch models; imported here so the package imports nothing heavy

        self.torch, self.model, self.tokenizer, self.engine, self.max_queue = torch, model, tokenizer, engine, max_queue
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.counters = Counters()
        self.stop_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="bitquilt-decode")
        self.context = contextvars.copy_context()  # the kernel options in force where the server started
        self.running: Job | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop `run` serves
        self.closing = False

    def submit(self, ids: list[int], request: Request, max_tokens: int) -> Job:
        """Queue a request; ApiError 503 at once when `max_queue` requests wait already or the server is closing."""
        if self.closing:
            raise ApiError(503, "the server is shutting down", code="shutting_down", kind="server_busy")
        if self.queue.qsize() >= self.max_queue:
            self.counters.rejected += 1
            raise ApiError(503, f"the server is busy: {self.max_queue} requests wait already; retry later",
                           code="queue_full", kind="server_busy")
        job = Job(ids, request, max_tokens)
        self.counters.requests += 1
        self.counters.prompt_tokens += len(ids)
        self.queue.put_nowait(job)
        return job

    async def run(self) -> None:
        """Decode the queued jobs one after another, for as long as the server runs."""
        self.loop = loop = asyncio.get_running_loop()
        while True:
            job = await self.queue.get()
            if job.cancelled.is_set():
                continue
            self.running = job
            await loop.run_in_executor(self.thread, self.context.copy().run, self._decode, job, loop)
            self.running = None

    def shut_down_soon(self) -> None:
        """Callable from a signal handler: on the event loop's next turn, end the running decode at its next token
        (its answer ends as if at max_tokens), answer the waiting requests with an error, refuse new ones."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._shut_down)

    def _shut_down(self) -> None:
        self.closing = True
        if self.running is not None:
            self.running.cancelled.set()
        while not self.queue.empty():
            job = self.queue.get_nowait()
            job.ended = True
            job.events.put_nowait(("error", "the server is shutting down"))

    def close(self) -> None:
        """Stop the running decode and the thread after it (the server has stopped)."""
        self._shut_down()
        self.thread.shutdown(wait=False, cancel_futures=True)

    def metrics(self) -> dict[str, float]:
        c = self.counters
        seconds = (c.run_ended or time.perf_counter()) - c.run_started
        return {"queue_depth": self.queue.qsize(), "active_sequences": c.active, "requests_total": c.requests,
                "requests_rejected_total": c.rejected, "requests_cancelled_total": c.cancelled,
                "prompt_tokens_total": c.prompt_tokens, "generated_tokens_total": c.generated_tokens,
                "tokens_per_second": c.run_tokens / seconds if c.run_tokens and seconds > 0 else 0.0}

    def _decode(self, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        """Run one job in the decode thread, its events sent to the event loop."""
        from bitquilt.runtime.engines import decode

        def emit(*event: Any) -> None:
            loop.call_soon_threadsafe(job.events.put_nowait, event)

        c = self.counters
        text = TextStream(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), job.request.stop)

        def on_token(token: int) -> bool:
            c.generated_tokens += 1
            c.run_tokens += 1
            delta = text.push(token)
            if delta:
                emit("text", delta)
            return text.stopped or job.cancelled.is_set()

        r = job.request
        seed = r.seed if r.seed is not None else secrets.randbelow(MAX_SEED + 1)
        c.active, c.run_tokens, c.run_started, c.run_ended = 1, 0, time.perf_counter(), None
        try:
            run = decode(self.model, self.torch.tensor([job.ids]), job.max_tokens, r.temperature, seed,
                         self.stop_ids, self.engine, r.top_p, on_token)
        except Exception as e:  # a NaN logit or a fault of the model: this request fails, the server goes on
            job.ended = True
            emit("error", str(e) or type(e).__name__)
            return
        finally:
            c.active, c.run_ended = 0, time.perf_counter()
        rest = text.finish()
        if rest:
            emit("text", rest)
        stopped = text.stopped or run.new_ids[-1] in self.stop_ids
        usage = {"prompt_tokens": len(job.ids), "completion_tokens": len(run.new_ids),
                 "total_tokens": len(job.ids) + len(run.new_ids)}
        job.ended = True
        emit("done", "stop" if stopped else "length", usage)
