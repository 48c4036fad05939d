"""The running batch behind an asyncio queue: requests wait in the queue (a full one is refused at once); between
decode steps up to `max_batch` of them run together in the batch of the model's runtime (a saved model's
`bitquilt.runtime.batch.Batch` or a standalone export's `bitquilt.runtime.standalone.batch.StandaloneBatch`: the same
interface, and this module imports neither), one step at a time in the decode thread while the event loop keeps
answering, each with its own sampling, stop strings and token limit, and each request's text comes back as events
on its own asyncio queue. A request whose client went away is cancelled: skipped if it waits, out of the batch before
the next step if it runs, its place taken by the next waiting one.
On a MoBiQuant model a request may carry its own precision (avg_bits, within the checkpoint's range), and its usage
reports the bits per weight its tokens used. In elastic mode (`bitquilt.serve.elastic`) the steps of the running
streams are timed end to end, and the requests without their own avg_bits run at the controller's level, moved between
steps."""

from __future__ import annotations

import asyncio
import contextvars
import secrets
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from bitquilt.flag_checks import MAX_SEED, in_routed_range
from bitquilt.runtime.loop import NON_FINITE
from bitquilt.serve.elastic import ElasticController
from bitquilt.serve.protocol import ApiError, Request
from bitquilt.serve.text import TextStream


@dataclass(eq=False)
class Job:
    """A request in the server: its prompt ids and settings, its events ("text", str), ("done", finish_reason,
    usage) or ("error", message), and its cancellation; while it runs, its sequence in the batch and its text."""

    ids: list[int]
    request: Request
    max_tokens: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ended: bool = False  # its last event is sent: nothing left to cancel
    sequence: Any = None  # a Sequence of the batch's runtime
    text: TextStream | None = None


@dataclass
class Counters:
    """What /metrics reports."""

    requests: int = 0
    rejected: int = 0  # refused because the queue was full
    cancelled: int = 0  # clients that went away before their answer ended
    prompt_tokens: int = 0
    generated_tokens: int = 0
    active: int = 0  # sequences in the batch now
    run_tokens: int = 0  # tokens of the running (or last) busy stretch, from the batch's first sequence to its last
    run_started: float = 0.0
    run_ended: float | None = None


class Worker:
    """The queue, the running batch and the decode thread of a model (module docstring): `batch`, either runtime's
    (its add, route, remove and step, its `sampler` and `routed_range`); `elastic`: elastic mode's controller (a
    MoBiQuant model's); `steps`: the executor the batch steps on."""

    def __init__(self, batch: Any, tokenizer: Any, max_queue: int, max_batch: int,
                 elastic: ElasticController | None = None, steps: Executor | None = None):
        self.batch = batch
        self.precision = batch.routed_range  # (low, high) average bits of a routed model, else None
        self.tokenizer, self.max_queue, self.max_batch, self.elastic = tokenizer, max_queue, max_batch, elastic
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.counters = Counters()
        self.stop_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        # where the steps run: a thread of their own unless given (`bitquilt serve`: its main thread)
        self.thread = steps if steps is not None else ThreadPoolExecutor(1, thread_name_prefix="bitquilt-decode")
        self.context = contextvars.copy_context()  # the kernel options in force where the server started
        self.running: list[Job] = []  # changed by the decode thread only
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop `run` serves
        self.step_ended: float | None = None  # when the last step of a busy stretch ended (elastic mode)
        self.closing = False

    def submit(self, ids: list[int], request: Request, max_tokens: int) -> Job:
        """Queue a request; ApiError 400 for an avg_bits the model cannot route to, 503 at once when `max_queue`
        requests wait already or the server is closing."""
        if request.avg_bits is not None:
            self.check_avg_bits(request.avg_bits)
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

    def check_avg_bits(self, avg_bits: float) -> None:
        """ApiError 400 unless the model routes and `avg_bits` is within its checkpoint's range."""
        if self.precision is None:
            raise ApiError(400, "avg_bits needs a MoBiQuant model; this model has no slice routers", "avg_bits",
                           "invalid_value")
        low, high = self.precision
        if not in_routed_range(avg_bits, low, high):
            raise ApiError(400, f"avg_bits {avg_bits:g} is outside this checkpoint's routed range [{low:.2f}, "
                           f"{high:.2f}]", "avg_bits", "invalid_value")

    async def run(self) -> None:
        """Step the batch, waiting requests joining it between steps while it has room, for as long as the server
        runs."""
        self.loop = loop = asyncio.get_running_loop()
        while True:
            joining = [] if self.running else [await self.queue.get()]  # idle: wait for a request
            while len(self.running) + len(joining) < self.max_batch and not self.queue.empty():
                joining.append(self.queue.get_nowait())
            joining = [job for job in joining if not job.cancelled.is_set()]
            await loop.run_in_executor(self.thread, self.context.copy().run, self._step, joining)

    def shut_down_soon(self) -> None:
        """Callable from a signal handler: on the event loop's next turn, end the running sequences before the next
        step (their answers end as if at max_tokens), answer the waiting requests with an error, refuse new ones."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._shut_down)

    def _shut_down(self) -> None:
        self.closing = True
        for job in list(self.running):
            job.cancelled.set()
        while not self.queue.empty():
            job = self.queue.get_nowait()
            job.ended = True
            job.events.put_nowait(("error", "the server is shutting down"))

    def close(self) -> None:
        """Stop the running sequences and the thread after them (the server has stopped)."""
        self._shut_down()
        self.thread.shutdown(wait=False, cancel_futures=True)

    def metrics(self) -> dict[str, float]:
        c = self.counters
        seconds = (c.run_ended or time.perf_counter()) - c.run_started
        return {"queue_depth": self.queue.qsize(), "active_sequences": c.active, "requests_total": c.requests,
                "requests_rejected_total": c.rejected, "requests_cancelled_total": c.cancelled,
                "prompt_tokens_total": c.prompt_tokens, "generated_tokens_total": c.generated_tokens,
                "tokens_per_second": c.run_tokens / seconds if c.run_tokens and seconds > 0 else 0.0,
                **({} if self.precision is None else {"average_bits": self._average_bits()}),
                **({} if self.elastic is None else {"elastic_target_tokens_per_second": self.elastic.target,
                                                    "elastic_bits": self.elastic.level,
                                                    "elastic_stream_tokens_per_second": self.elastic.speed})}

    def _average_bits(self) -> float:
        """The mean of the bits per weight the active sequences' tokens used so far (0 when none has run a token)."""
        seqs = [job.sequence for job in list(self.running) if job.sequence is not None]
        bits = [s.avg_bits for s in seqs if s.avg_bits is not None]
        return sum(bits) / len(bits) if bits else 0.0

    def _step(self, joining: list[Job]) -> None:
        """In the decode thread: `joining` into the batch, cancelled sequences out, then one step of the batch and
        each new token to its request."""
        for job in joining:
            self._join(job)
        for job in [j for j in self.running if j.cancelled.is_set()]:
            self._finish(job, "length")
        if not self.running:
            self.step_ended = None  # idle: the wait for the next request is no stream's
            return
        decoding = any(job.sequence.new_ids for job in self.running)  # streams this step gives a token
        try:
            picked = self.batch.step()
        except Exception as e:  # a fault of the model: the running requests fail, the server goes on
            for job in list(self.running):
                self._fail(job, str(e) or type(e).__name__)
            return
        if self.elastic is not None:
            self._elastic_step(decoding)
        owner = {id(job.sequence): job for job in self.running}
        for seq, token in picked:
            self._token(owner[id(seq)], token)

    def _elastic_step(self, decoding: bool) -> None:
        """A step ended: the seconds since the last one ended to the controller if this one gave streams a token (the
        time between steps and a prompt chunk read in it included), and its level to the running requests without
        their own avg_bits if it moved."""
        now = time.perf_counter()
        last, self.step_ended = self.step_ended, now
        if last is None or not decoding:
            return
        level = self.elastic.level
        if self.elastic.observe(now - last) != level:
            self.batch.route([j.sequence for j in self.running if j.request.avg_bits is None], self.elastic.level)

    def _join(self, job: Job) -> None:
        r = job.request
        seed = r.seed if r.seed is not None else secrets.randbelow(MAX_SEED + 1)
        avg_bits = self.elastic.level if r.avg_bits is None and self.elastic is not None else r.avg_bits
        try:
            job.sequence = self.batch.add(job.ids, len(job.ids) + job.max_tokens,
                                          self.batch.sampler(r.temperature, r.top_p, seed),
                                          avg_bits)
        except Exception as e:  # a cache that does not fit in memory: this request fails
            job.ended = True
            self._emit(job, "error", str(e) or type(e).__name__)
            return
        job.text = TextStream(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), r.stop)
        c = self.counters
        if not self.running:
            c.run_tokens, c.run_started, c.run_ended = 0, time.perf_counter(), None
        self.running.append(job)
        c.active = len(self.running)

    def _token(self, job: Job, token: int) -> None:
        """A new token of a running request: its text sent, and its end if it ends there."""
        if token < 0:
            self._fail(job, NON_FINITE)
            return
        c = self.counters
        c.generated_tokens += 1
        c.run_tokens += 1
        delta = job.text.push(token)
        if delta:
            self._emit(job, "text", delta)
        stopped = job.text.stopped or token in self.stop_ids
        if stopped or len(job.sequence.new_ids) >= job.max_tokens or job.cancelled.is_set():
            self._finish(job, "stop" if stopped else "length")

    def _finish(self, job: Job, reason: str) -> None:
        rest = job.text.finish()
        if rest:
            self._emit(job, "text", rest)
        n, bits = len(job.sequence.new_ids), job.sequence.avg_bits
        self._leave(job)
        usage = {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n}
        self._emit(job, "done", reason, usage if bits is None else {**usage, "avg_bits": bits})

    def _fail(self, job: Job, message: str) -> None:
        self._leave(job)
        self._emit(job, "error", message)

    def _leave(self, job: Job) -> None:
        """`job` out of the batch (its slot free for the next waiting request); its last event follows."""
        self.batch.remove(job.sequence)
        self.running.remove(job)
        job.ended = True
        c = self.counters
        c.active = len(self.running)
        if not self.running:
            c.run_ended = time.perf_counter()

    def _emit(self, job: Job, *event: Any) -> None:
        self.loop.call_soon_threadsafe(job.events.put_nowait, event)
