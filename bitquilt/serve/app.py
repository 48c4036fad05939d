"""The HTTP side of `bitquilt serve`: a Starlette app (run by uvicorn) with OpenAI's /v1/completions,
/v1/chat/completions and /v1/models, plus /health and /metrics (Prometheus text). Every fault of a request is an
OpenAI-style error answer and never reaches the server: a bad body 400, a wrong or missing API key 401, a body
over the limit 413, a full queue 503."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from bitquilt.errors import UserError
from bitquilt.serve.caller_thread import CallerThreadExecutor
from bitquilt.serve.chat import ChatTemplate
from bitquilt.serve.protocol import COMPLETION_DEFAULT_MAX_TOKENS, Answer, ApiError, Limits, Request, parse_request
from bitquilt.serve.worker import Job, Worker

DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there
SHUTDOWN_GRACE_S = 5  # at Ctrl-C, how long answers may take to end before they are cut


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _body(http: HttpRequest, limit: int) -> bytes:
    """The request body, refused (413) as soon as it passes `limit` bytes: by its declared length, or as it arrives."""
    too_large = ApiError(413, f"the body is over this server's limit of {limit} bytes", code="body_too_large")
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


class Server:
    """The routes of one served model; `app` is the ASGI application."""

    def __init__(self, worker: Worker, chat: ChatTemplate, name: str, limits: Limits, positions: int | None,
                 api_key: str | None = None):
        self.worker, self.chat, self.name, self.limits, self.positions = worker, chat, name, limits, positions
        self.api_key = api_key
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/models", self.models), Route("/health", self.health), Route("/metrics", self.metrics)]
        self.app = Starlette(routes=routes, lifespan=self._lifespan,
                             exception_handlers={ApiError: self._api_error, 404: self._not_found,
                                                 405: self._not_allowed, Exception: self._internal})

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(self.worker.run())
        try:
            yield
        finally:
            task.cancel()
            self.worker.close()

    async def _api_error(self, http: HttpRequest, e: Exception) -> Response:
        return _error(e)  # type: ignore[arg-type]  (registered for ApiError only)

    async def _not_found(self, http: HttpRequest, e: Exception) -> Response:
        return _error(ApiError(404, f"no route {http.url.path}", code="not_found"))

    async def _not_allowed(self, http: HttpRequest, e: Exception) -> Response:
        return _error(ApiError(405, f"{http.method} is not allowed on {http.url.path}", code="method_not_allowed"))

    async def _internal(self, http: HttpRequest, e: Exception) -> Response:
        return _error(ApiError(500, f"internal error: {e}", kind="server_error"))

    def _check_key(self, http: HttpRequest) -> None:
        if self.api_key is None:
            return
        given = http.headers.get("authorization", "").removeprefix("Bearer ").encode()
        if not hmac.compare_digest(given, self.api_key.encode()):  # constant time: no key guessed byte by byte
            raise ApiError(401, "a missing or wrong API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key", kind="authentication_error")

    async def health(self, http: HttpRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, http: HttpRequest) -> Response:
        self._check_key(http)
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "created": 0,
                                                         "owned_by": "bitquilt"}]})

    async def metrics(self, http: HttpRequest) -> Response:
        self._check_key(http)
        lines = [f"bitquilt_{name} {value:.6g}" for name, value in self.worker.metrics().items()]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def completions(self, http: HttpRequest) -> Response:
        return await self._serve(http, "completion")

    async def chat_completions(self, http: HttpRequest) -> Response:
        return await self._serve(http, "chat")

    def _prompt_ids(self, request: Request) -> list[int]:
        """The request's prompt as token ids, within the server's limits and the model's positions."""
        tokenizer = self.worker.tokenizer
        if request.kind == "chat":  # the template writes the special tokens itself
            ids = tokenizer(self.chat.render(request.messages), add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(request.prompt)["input_ids"]
        room = self.limits.max_prompt_tokens if self.positions is None else min(self.limits.max_prompt_tokens,
                                                                                self.positions - 1)
        if not ids or len(ids) > room:
            param = "prompt" if request.kind == "completion" else "messages"
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this server takes 1 to {room}", param,
                           "prompt_too_long")
        return ids

    def _max_tokens(self, request: Request, prompt_tokens: int) -> int:
        """The request's max_tokens (or the endpoint's default), within the room its prompt leaves."""
        room = self.limits.max_tokens if self.positions is None else self.positions - prompt_tokens
        if request.max_tokens is None:
            default = COMPLETION_DEFAULT_MAX_TOKENS if request.kind == "completion" else self.limits.max_tokens
            return min(default, room)
        if request.max_tokens > room:
            raise ApiError(400, f"a {prompt_tokens}-token prompt leaves room for {room} new tokens in the model's "
                           f"{self.positions} positions, not max_tokens={request.max_tokens}", "max_tokens",
                           "context_length_exceeded")
        return request.max_tokens

    async def _serve(self, http: HttpRequest, kind: str) -> Response:
        self._check_key(http)
        request = parse_request(await _body(http, self.limits.max_body_bytes), kind, self.limits)
        ids = await asyncio.to_thread(self._prompt_ids, request)  # a long prompt's encoding holds no other request
        job = self.worker.submit(ids, request, self._max_tokens(request, len(ids)))
        answer = Answer(kind, self.name)
        if request.stream:
            return StreamingResponse(self._stream(job, answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            return await self._whole(http, job, answer)
        finally:
            self._cancel(job)

    def _cancel(self, job: Job) -> None:
        """Stop `job` if it has not ended (its client went away, or its answer failed)."""
        if not job.cancelled.is_set() and not job.ended:
            job.cancelled.set()
            self.worker.counters.cancelled += 1

    async def _whole(self, http: HttpRequest, job: Job, answer: Answer) -> Response:
        """A non-streamed answer: the job's text gathered while a watcher checks that the client is still there."""
        gone = asyncio.create_task(_until_gone(http))
        parts = []
        try:
            while True:
                get = asyncio.ensure_future(job.events.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():  # the client left: `_serve` cancels the job; nobody reads this answer
                    get.cancel()  # a cancelled get takes no event
                    return Response(status_code=499)
                event = get.result()
                if event[0] == "text":
                    parts.append(event[1])
                elif event[0] == "error":
                    return _error(ApiError(500, f"generation failed: {event[1]}", kind="server_error"))
                else:
                    return JSONResponse(answer.whole("".join(parts), event[1], event[2]))
        finally:
            gone.cancel()

    async def _stream(self, job: Job, answer: Answer) -> AsyncIterator[str]:
        """Server-sent events: a chunk per piece of text, a last chunk with the finish reason, then [DONE]. When the
        client goes away Starlette cancels this generator, and `finally` stops the decode."""
        try:
            if answer.kind == "chat":
                yield _sse(answer.chunk("", first=True))
            while (event := await job.events.get())[0] == "text":
                yield _sse(answer.chunk(event[1]))
            if event[0] == "error":
                yield _sse(ApiError(500, f"generation failed: {event[1]}", kind="server_error").body())
            else:
                yield _sse(answer.chunk("", event[1]) | {"usage": event[2]})
            yield "data: [DONE]\n\n"
        finally:
            self._cancel(job)


async def _until_gone(http: HttpRequest) -> None:
    """Return once the client of `http` has gone away (checked every DISCONNECT_POLL_S)."""
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not yet listening (clients are refused until `run`), or one line saying why not:
    taken before the model loads, so a port in use is said at once."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:  # an address in use or not this machine's, a name that does not resolve
        if sock is not None:
            sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, which at Ctrl-C (or SIGTERM) first has the worker end its sequences, so that open streams
    end with their last chunk instead of waiting for the grace period."""

    def __init__(self, config: uvicorn.Config, worker: Worker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.worker.shut_down_soon()
        super().handle_exit(sig, frame)


def run(server: Server, sock: socket.socket, steps: CallerThreadExecutor) -> None:
    """Answer on `sock` with uvicorn until Ctrl-C or SIGTERM: its event loop in a thread, the batch's steps (`steps`,
    the worker's executor) on this one, the main thread (`bitquilt.serve.caller_thread` says why)."""
    config = uvicorn.Config(server.app, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    uv = _Uvicorn(config, server.worker)
    loop = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name="bitquilt-http")
    caught: list[int] = []

    def on_signal(sig: int, frame: Any) -> None:
        caught.append(sig)
        uv.handle_exit(sig, frame)

    # uvicorn listens for them only on the main thread: here, as it does there, and the process then ends by the
    # signal it got, as one that did not catch it
    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    loop.start()
    steps.work(until=lambda: not loop.is_alive())
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    for sig in reversed(caught):
        signal.raise_signal(sig)
