"""The OpenAI shapes the server speaks: a request body checked field by field into a `Request` (any fault an
`ApiError`, answered as `{"error": {"message", "type", "param", "code"}}`), and the JSON of answers and stream
chunks for /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from bitquilt.flag_checks import MAX_SEED, is_integer, is_number

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "n", "user", "avg_bits"}
FIELDS = {"completion": COMMON_FIELDS | {"prompt"}, "chat": COMMON_FIELDS | {"messages", "max_completion_tokens"}}
ROLES = ("system", "user", "assistant")
MAX_STOPS = 4  # as OpenAI: up to four stop strings
MAX_STOP_CHARS = 256  # each: every token's check for a stop string beginning costs its length squared
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the server's limit


class ApiError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    """What one request may ask of the server (`bitquilt serve` flags)."""

    max_prompt_tokens: int
    max_tokens: int
    max_body_bytes: int


@dataclass
class Request:
    """A checked request of either endpoint: the prompt (completion) or the messages (chat), and the sampling."""

    kind: str  # "completion" or "chat"
    prompt: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    max_tokens: int | None = None  # None: the endpoint's default
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    avg_bits: float | None = None  # a MoBiQuant model's precision for this request (None: the server's)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value")


def _number(body: dict, name: str, low: float, high: float, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if not is_number(value) or not math.isfinite(value) or not low <= value <= high:
        raise _bad(name, f"{name} must be a number from {low} to {high}, got {json.dumps(value)}")
    return float(value)


def _max_tokens(body: dict, limits: Limits) -> int | None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is not None and (not is_integer(value) or not 1 <= value <= limits.max_tokens):
        raise _bad(name, f"{name} must be an integer from 1 to {limits.max_tokens} (this server's limit), got "
                   f"{json.dumps(value)}")
    return value


def _text(value: str, param: str) -> str:
    """`value`, refused when it is not UTF-8 text (JSON may spell lone surrogates, which no tokenizer takes)."""
    try:
        value.encode()
    except UnicodeEncodeError as e:
        raise _bad(param, f"{param} is not UTF-8 text (a lone surrogate at character {e.start})") from None
    return value


def _stop(value: Any) -> list[str]:
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or \
            not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise _bad("stop", f"stop must be a string of 1 to {MAX_STOP_CHARS} characters or a list of up to "
                   f"{MAX_STOPS} of them")
    return [_text(s, "stop") for s in stops]


def _content(message: dict, index: int) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts joined."""
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return _text("".join(p["text"] for p in content), f"messages[{index}].content")
    if not isinstance(content, str):
        raise _bad(f"messages[{index}].content", "a message's content must be text (a string or text parts)")
    return _text(content, f"messages[{index}].content")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or set(m) - {"role", "content", "name"}:
            raise _bad(f"messages[{i}]", f"each message is an object with a role ({', '.join(ROLES)}) and content "
                       "(and optionally a name), got " + json.dumps(m)[:200])
        out.append({"role": m["role"], "content": _content(m, i)})
    return out


def parse_request(raw: bytes, kind: str, limits: Limits) -> Request:
    """The `Request` of a body for the `kind` endpoint ("completion" or "chat"); ApiError names the first fault."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, nesting too deep
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}; this endpoint takes {', '.join(sorted(FIELDS[kind]))}",
                       unknown[0], "unknown_field")
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise _bad("n", "n must be 1 (one choice per request)")
    for name, kind_of in (("model", str), ("user", str), ("stream", bool)):
        if body.get(name) is not None and not isinstance(body[name], kind_of):
            raise _bad(name, f"{name} must be a {kind_of.__name__}")
    seed = body.get("seed")
    if seed is not None and (not is_integer(seed) or not 0 <= seed <= MAX_SEED):
        raise _bad("seed", f"seed must be an integer from 0 to {MAX_SEED}, got {json.dumps(seed)}")
    avg_bits = body.get("avg_bits")
    if avg_bits is not None and (not is_number(avg_bits) or not math.isfinite(avg_bits)):
        raise _bad("avg_bits", f"avg_bits must be a number (average bits per weight), got {json.dumps(avg_bits)}")
    request = Request(kind, max_tokens=_max_tokens(body, limits), temperature=_number(body, "temperature", 0, 2, 1.0),
                      top_p=_number(body, "top_p", 0, 1, 1.0), stop=_stop(body.get("stop")), seed=seed,
                      stream=bool(body.get("stream", False)), avg_bits=None if avg_bits is None else float(avg_bits))
    if request.top_p == 0:
        raise _bad("top_p", "top_p must be above 0")
    if kind == "chat":
        request.messages = _messages(body.get("messages"))
    elif not isinstance(body.get("prompt"), str) or not body["prompt"]:
        raise _bad("prompt", "prompt must be a non-empty string (one prompt per request)")
    else:
        request.prompt = _text(body["prompt"], "prompt")
    return request


@dataclass
class Answer:
    """The ids and model name that every answer to one request shares."""

    kind: str
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, suffix: str) -> dict[str, Any]:
        prefix, obj = ("chatcmpl-", "chat.completion") if self.kind == "chat" else ("cmpl-", "text_completion")
        return {"id": prefix + self.id, "object": obj + suffix, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, usage: dict[str, int | float]) -> dict[str, Any]:
        """The non-streamed answer."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope(""), "choices": [choice], "usage": usage}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
        """One streamed chunk: new text, or (with `finish_reason`) the last, empty one."""
        if self.kind == "chat":
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return {**self._envelope(".chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope(""), "choices": [choice]}
