"""`bitquilt serve` as a client sees it: a real server process on smollm2-135m RTN W4, called with the openai client
(and with raw HTTP where a client would not send the request), then bad requests, a full queue and a client that
goes away, after which it still answers."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from bitquilt.cli import main
from bitquilt.runtime.engines import _next_token

for extra in ("starlette", "uvicorn", "jinja2"):  # the serve extra (`make setup` installs it)
    pytest.importorskip(extra)
openai = pytest.importorskip("openai")

from bitquilt.serve.chat import ChatTemplate  # noqa: E402  (jinja2: after the skip)
from bitquilt.serve.protocol import ApiError  # noqa: E402
from bitquilt.serve.text import TextStream  # noqa: E402

KEY = "test-key"
PROMPT = "The capital of France is"
MAX_PROMPT_TOKENS = 64
MAX_BODY_BYTES = 4096


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, key: str | None = KEY) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    response = conn.getresponse()
    return response.status, response.read().decode()


def _post(port: int, path: str, body: bytes | dict, key: str | None = KEY) -> tuple[int, dict]:
    """Status and JSON answer of a raw POST (the body sent as it is when given as bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", path, body if isinstance(body, bytes) else json.dumps(body).encode(), headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def _metrics(port: int) -> dict[str, float]:
    status, text = _get(port, "/metrics")
    assert status == 200
    pairs = (line.split() for line in text.splitlines())
    return {name.removeprefix("bitquilt_"): float(value) for name, value in pairs}


def test_text_is_released_once_final_and_cut_before_a_stop_string():
    pieces = {1: "Hel", 2: "lo wo", 3: "rld!", 4: " more"}
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids), ["world"])
    assert [stream.push(i) for i in (1, 2, 3)] == ["Hel", "lo ", ""]  # "wo" waited: it could begin "world"
    assert stream.stopped and stream.finish() == ""
    utf8 = {1: b"caf", 2: b"\xc3", 3: b"\xa9!"}  # "é" split over two tokens
    stream = TextStream(lambda ids: b"".join(utf8[i] for i in ids).decode(errors="replace"), [])
    assert [stream.push(i) for i in (1, 2, 3)] == ["caf", "", "é!"] and not stream.stopped


def test_top_p_keeps_the_fewest_likely_tokens_that_reach_it():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    generator = torch.Generator().manual_seed(0)
    assert {_next_token(logits, 1.0, generator, top_p=0.6) for _ in range(200)} == {0, 1}
    assert {_next_token(logits, 1.0, generator, top_p=0.5) for _ in range(50)} == {0}
    assert len({_next_token(logits, 1.0, generator) for _ in range(400)}) == 4


@pytest.mark.parametrize("template, error", [
    ("{{ messages.append(1) }}", "refused"),  # the immutable sandbox: no changing the messages
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "refused"),  # no reaching Python's objects
    ("{{ raise_exception('no system messages') }}", "no system messages"),
])
def test_a_chat_template_runs_in_the_sandbox(tmp_path, template, error):
    (tmp_path / "chat_template.jinja").write_text(template)
    with pytest.raises(ApiError, match=error):
        ChatTemplate(tmp_path, None, None).render([{"role": "user", "content": "hi"}])


def test_a_chat_template_from_the_tokenizer_config(tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ApiError, match="no chat template"):
        ChatTemplate(tmp_path, None, None).render(messages)
    template = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}" \
               "{% if add_generation_prompt %}<assistant>{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert ChatTemplate(tmp_path, "<s>", "</s>").render(messages) == "<s><user>hi<assistant>"


@contextlib.contextmanager
def _serving(model, *flags: str):
    """(port, process) of `bitquilt serve` on `model` with `flags`, once it answers /health; killed after."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bitquilt.cli", "serve", str(model), "--port", str(port),
                             "--max-tokens", "256", "--threads", "1", *flags],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if _get(port, "/health", None)[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("the server did not answer /health within 300 s")
        yield port, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(saved_smollm):
    """(port, served model name, process) of `bitquilt serve` on the saved model, one sequence at a time and one
    waiting request allowed."""
    with _serving(saved_smollm, "--api-key", KEY, "--max-batch", "1", "--max-queue", "1", "--max-prompt-tokens",
                  str(MAX_PROMPT_TOKENS), "--max-body-bytes", str(MAX_BODY_BYTES)) as (port, proc):
        yield port, saved_smollm.name, proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[0]}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_greedy_completion_is_what_generate_writes(server, client, saved_smollm, capsys):
    answer = client.completions.create(model=server[1], prompt=PROMPT, max_tokens=8, temperature=0)
    assert main(["generate", str(saved_smollm), "--prompt", PROMPT, "--max-new-tokens", "8", "--json"]) == 0
    generated = json.loads(capsys.readouterr().out)["completion"]
    assert answer.choices[0].text == generated and "Paris" in generated
    assert answer.usage.prompt_tokens == 5 and answer.usage.completion_tokens == 8
    assert answer.choices[0].finish_reason == "length" and answer.model == server[1]


def test_streamed_answers_join_to_the_whole_one(server, client):
    whole = client.completions.create(model=server[1], prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=server[1], prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert len(chunks) > 2 and chunks[-1].choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=server[1], messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model=server[1], messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content


def test_stop_strings_end_the_text_before_them(server, client):
    full = client.completions.create(model=server[1], prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]  # a piece from the middle of the greedy text
    expected = full[:full.find(stop)]
    answer = client.completions.create(model=server[1], prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "zzz"])
    assert answer.choices[0].text == expected and answer.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=server[1], prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_a_seed_reproduces_a_sampled_answer(server, client):
    def sample(seed: int) -> str:
        return client.completions.create(model=server[1], prompt=PROMPT, max_tokens=10, temperature=1.0, top_p=0.95,
                                         seed=seed).choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9)}) > 1  # and the seed does change the draw


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list()] == [server[1]]
    assert _get(server[0], "/health", None) == (200, '{"status":"ok"}')
    metrics = _metrics(server[0])
    assert {"queue_depth", "active_sequences", "tokens_per_second", "generated_tokens_total"} <= set(metrics)
    assert metrics["generated_tokens_total"] > 0 and metrics["tokens_per_second"] > 0


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/completions", b'{"prompt": "hi",', 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate", "unknown_field"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 257}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "avg_bits": "4"}, 400, "avg_bits", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "avg_bits": 4}, 400, "avg_bits", "invalid_value"),  # no routers
    ("/v1/completions", {"prompt": ["hi", "ho"]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": "word " * (MAX_PROMPT_TOKENS + 1)}, 400, "prompt", "prompt_too_long"),
    ("/v1/completions", {"prompt": "x" * MAX_BODY_BYTES}, 413, None, "body_too_large"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0]",
     "invalid_value"),
    ("/v1/chat/completions", {"prompt": "hi"}, 400, "prompt", "unknown_field"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt", "invalid_value"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000, 413, None, "body_too_large"),
    ("/v1/completions", b"[" * 4000, 400, None, "invalid_json"),
    ("/v1/nowhere", {"prompt": "hi"}, 404, None, "not_found"),
    ("/health", {"prompt": "hi"}, 405, None, "method_not_allowed"),
])
def test_a_bad_request_gets_an_openai_error_and_the_server_goes_on(server, path, body, status, param, code):
    got, answer = _post(server[0], path, body)
    assert got == status and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param and answer["error"]["code"] == code and answer["error"]["message"]
    assert _get(server[0], "/health", None)[0] == 200


def test_a_wrong_or_missing_api_key_is_refused(server):
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{server[0]}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=server[1], prompt=PROMPT, max_tokens=2)
    status, answer = _post(server[0], "/v1/completions", {"prompt": PROMPT}, key=None)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert _get(server[0], "/metrics", key=None)[0] == 401 and _get(server[0], "/health", None)[0] == 200


def test_a_full_queue_answers_503_and_a_client_that_leaves_frees_its_slot(server):
    port = server[0]
    before = _metrics(port)
    streaming = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # a long stream, left after one chunk
    streaming.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 256, "temperature": 0,
                                                             "stream": True}).encode(),
                      {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = streaming.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    waiting: list = []  # the one request the queue holds (greedy: two tokens, no end-of-sequence before them)
    short = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    thread = threading.Thread(target=lambda: waiting.append(_post(port, "/v1/completions", short)))
    thread.start()
    deadline = time.monotonic() + 30
    while _metrics(port)["queue_depth"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    status, answer = _post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert status == 503 and answer["error"]["code"] == "queue_full" and time.monotonic() - start < 5  # at once

    response.close()  # the streaming client goes away: its decode stops, the waiting request runs
    streaming.close()
    thread.join(timeout=120)
    assert waiting and waiting[0][0] == 200 and waiting[0][1]["usage"]["completion_tokens"] == 2
    after = _metrics(port)
    assert after["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
    assert after["requests_rejected_total"] == before["requests_rejected_total"] + 1
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 128  # not the 256 it asked for
    assert after["active_sequences"] == 0 and after["queue_depth"] == 0
    assert _get(port, "/health", None)[0] == 200


def test_a_client_that_leaves_before_a_whole_answer_stops_its_decode(server):
    port = server[0]
    before = _metrics(port)
    leaving = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    leaving.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 256,  # greedy: no early end
                                                           "temperature": 0}).encode(),
                    {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while _metrics(port)["active_sequences"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    leaving.close()  # gone without reading the answer
    while _metrics(port)["active_sequences"] > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    after = _metrics(port)
    assert after["active_sequences"] == 0
    assert after["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 128


STORY = "Once upon a time, in a small village by the sea, there lived"
LONG = "Write a long story about a dragon: " * 6  # over one prefill chunk: read in several steps


@pytest.fixture(scope="module")
def batch_server(saved_smollm):
    """The port of `bitquilt serve` running up to three sequences at once on the default engine (fused: each step one
    compiled call, one kernel call per linear, for all of them; tests/test_batch.py runs engine lean too)."""
    with _serving(saved_smollm, "--max-batch", "3", "--max-queue", "4") as (port, _):
        yield port


def _together(port: int, bodies: list[dict], stagger: float = 0.2) -> tuple[list, float]:
    """The answers to `bodies`, sent from threads `stagger` seconds apart (they join a running batch at different
    steps), with the most sequences /metrics saw active at once."""
    answers: list = [None] * len(bodies)
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, _post(port, "/v1/completions", bodies[i])))
               for i in range(len(bodies))]
    most = 0.0
    for thread in threads:
        thread.start()
        time.sleep(stagger)
    while any(thread.is_alive() for thread in threads):
        most = max(most, _metrics(port)["active_sequences"])
        time.sleep(0.02)
    return answers, most


def _texts(answers: list) -> list[str]:
    assert all(status == 200 for status, _ in answers), answers
    return [answer["choices"][0]["text"] for _, answer in answers]


def test_each_sequence_of_a_batch_gets_the_greedy_tokens_it_gets_alone(batch_server):
    bodies = [{"prompt": prompt, "max_tokens": n, "temperature": 0}
              for prompt, n in ((PROMPT, 60), (STORY, 40), (LONG, 50), ("def fibonacci(n):", 30))]
    alone = [_post(batch_server, "/v1/completions", body) for body in bodies]
    together, most = _together(batch_server, bodies)  # the fourth waits for a free place among three
    assert most >= 2 and _texts(together) == _texts(alone)
    assert [a["usage"] for _, a in together] == [a["usage"] for _, a in alone]
    after = _metrics(batch_server)
    assert after["active_sequences"] == 0 and after["queue_depth"] == 0


def test_a_seed_reproduces_a_sampled_answer_in_a_batch(batch_server):
    sampled = {"prompt": STORY, "max_tokens": 30, "temperature": 1.0, "top_p": 0.9, "seed": 11}
    alone = _texts([_post(batch_server, "/v1/completions", sampled)])
    others = [{"prompt": PROMPT, "max_tokens": 40, "temperature": 1.0}, {"prompt": LONG, "max_tokens": 20}]
    together, most = _together(batch_server, [others[0], sampled, others[1]], stagger=0.1)
    assert most >= 2 and _texts(together)[1] == alone[0]


def test_a_request_cancelled_mid_batch_frees_its_place_and_the_others_go_on(batch_server):
    port = batch_server
    before = _metrics(port)
    bodies = [{"prompt": prompt, "max_tokens": 100, "temperature": 0} for prompt in (PROMPT, STORY)]
    alone = _texts([_post(port, "/v1/completions", body) for body in bodies])
    streaming = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # a long stream, left mid-batch
    streaming.request("POST", "/v1/completions", json.dumps({"prompt": LONG, "max_tokens": 256, "temperature": 0,
                                                             "stream": True}).encode(),
                      {"Content-Type": "application/json"})
    response = streaming.getresponse()
    assert response.readline().startswith(b"data: ")
    answers: list = [None] * 3
    ended: list = [0.0] * 3

    def ask(i: int, body: dict) -> None:
        answers[i] = _post(port, "/v1/completions", body)
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=ask, args=(i, body)) for i, body in enumerate(bodies)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while _metrics(port)["active_sequences"] < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    short = threading.Thread(target=ask, args=(2, {"prompt": "Hello", "max_tokens": 4, "temperature": 0}))
    short.start()  # the batch is full: it waits
    while _metrics(port)["queue_depth"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    response.close()  # the streaming client goes away: its place goes to the waiting request
    streaming.close()
    for thread in [*threads, short]:
        thread.join(timeout=120)
    assert _texts(answers[:2]) == alone  # the others went on as if alone
    assert answers[2][0] == 200 and ended[2] < max(ended[:2])  # it ran beside them, not after them
    after = _metrics(port)
    assert after["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
    assert after["active_sequences"] == 0 and after["queue_depth"] == 0


@pytest.mark.parametrize("args, message", [
    (["--port", "0"], "--port must be ≥ 1, got 0"),
    (["--max-queue", "-1"], "--max-queue must be ≥ 0, got -1"),
    (["--max-batch", "0"], "--max-batch must be ≥ 1, got 0"),
    (["--max-tokens", "0"], "--max-tokens must be ≥ 1, got 0"),
    (["--api-key", ""], "--api-key is empty"),
    (["--threads", "0"], "--threads must be ≥ 1, got 0"),
    (["--elastic", "-1"], "--elastic must be ≥ 0, got -1.0"),
])
def test_bad_serve_flags_are_one_line_and_exit_2(capsys, args, message):
    assert main(["serve", "smollm2-135m", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_port_in_use_is_one_line_before_the_model_loads(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        assert main(["serve", "smollm2-135m", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1
    assert time.monotonic() - start < 5  # said before loading anything


def test_sigterm_ends_an_open_stream_with_its_last_chunk_and_the_server(server):
    """(Last of the tests on the server: it stops it.) uvicorn ends the process by the signal it got, as a process
    that did not catch it ends."""
    port, _, proc = server
    streaming = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    streaming.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 256, "temperature": 0,
                                                             "stream": True}).encode(),
                      {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = streaming.getresponse()
    assert response.readline().startswith(b"data: ")
    proc.terminate()
    lines = [line.strip() for line in response.read().splitlines() if line.strip()]
    assert lines[-1] == b"data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=30) == -signal.SIGTERM


def _stream_usage(port: int, body: dict) -> dict:
    """The usage of the last chunk of a streamed completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                 {"Content-Type": "application/json"})
    events = [line.removeprefix("data: ") for line in conn.getresponse().read().decode().splitlines() if line]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


def test_a_request_routes_a_mobiquant_model_at_its_own_avg_bits(routed_tiny):
    """avg_bits per request (two precisions in one batch): its usage reports the bits its tokens used, within the
    checkpoint's range and fewer at the lower setting, streamed too; out of range a 400; /metrics the active
    sequences' average; --avg-bits out of range at start-up one line and exit 2."""
    from bitquilt.io import load_quantized
    from bitquilt.nn.slice_router import precision_range

    low, high = precision_range(load_quantized(routed_tiny / "saved", runtime="bitquilt")[0])
    settings = (low + 0.2 * (high - low), high - 0.2 * (high - low))
    with _serving(routed_tiny / "saved", "--max-batch", "2", "--avg-bits", repr(settings[1])) as (port, _):
        bodies = [{"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "avg_bits": b} for b in settings]
        answers, _ = _together(port, bodies, stagger=0.0)
        used = [a[1]["usage"]["avg_bits"] for a in answers]
        assert all(low - 1e-6 <= b <= high + 1e-6 for b in used) and used[0] < used[1]
        assert _stream_usage(port, bodies[0])["avg_bits"] == pytest.approx(used[0])
        plain = _post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})[1]
        assert plain["usage"]["avg_bits"] == pytest.approx(used[1])  # the server's --avg-bits
        status, answer = _post(port, "/v1/completions", {"prompt": PROMPT, "avg_bits": high + 1})
        assert status == 400 and answer["error"]["param"] == "avg_bits" and answer["error"]["code"] == "invalid_value"
        assert "routed range" in answer["error"]["message"]
        assert "average_bits" in _metrics(port)
    assert main(["serve", str(routed_tiny / "saved"), "--port", str(_free_port()), "--avg-bits", "99"]) == 2


def _usage_bits(port: int, body: dict) -> float:
    status, answer = _post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **body})
    assert status == 200, answer
    return answer["usage"]["avg_bits"]


def test_elastic_mode_routes_requests_without_their_own_bits_at_the_controllers_level(routed_tiny):
    """--elastic far above any speed: after a first request's steps the requests without avg_bits run at the
    checkpoint's lowest bits (as a request asking for them), a request's own avg_bits beside them untouched; far
    below: the highest bits (the default ceiling), or --avg-bits. /metrics reports the target and the level."""
    from bitquilt.io import load_quantized
    from bitquilt.nn.slice_router import precision_range
    from bitquilt.serve.elastic import MAX_MOVE, SETTLE_STEPS

    low, high = precision_range(load_quantized(routed_tiny / "saved", runtime="bitquilt")[0])
    with _serving(routed_tiny / "saved", "--max-batch", "2", "--elastic", "1e9") as (port, _):
        moves = math.ceil((high - low) / MAX_MOVE)  # a move every SETTLE_STEPS steps, down to the lowest
        _usage_bits(port, {"max_tokens": moves * SETTLE_STEPS + 4})
        metrics = _metrics(port)
        assert metrics["elastic_target_tokens_per_second"] == 1e9 and metrics["elastic_bits"] == pytest.approx(low)
        answers, _ = _together(port, [{"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **extra}
                                      for extra in ({}, {"avg_bits": high})], stagger=0.0)
        fast, own = (a[1]["usage"]["avg_bits"] for a in answers)
        assert fast == pytest.approx(_usage_bits(port, {"avg_bits": low}))
    with _serving(routed_tiny / "saved", "--elastic", "0.001") as (port, _):
        full = _usage_bits(port, {})
        assert full == pytest.approx(_usage_bits(port, {"avg_bits": high})) == pytest.approx(own)
        assert _metrics(port)["elastic_bits"] == pytest.approx(high)
    assert fast < full
    ceiling = (low + high) / 2
    with _serving(routed_tiny / "saved", "--elastic", "0.001", "--avg-bits", repr(ceiling)) as (port, _):
        capped = _usage_bits(port, {})
        assert capped == pytest.approx(_usage_bits(port, {"avg_bits": ceiling})) and capped < full
        assert _metrics(port)["elastic_bits"] == pytest.approx(ceiling)  # --avg-bits: the ceiling


def test_elastic_mode_needs_a_mobiquant_model(capsys):
    assert main(["serve", "smollm2-135m", "--port", str(_free_port()), "--elastic", "5"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]  # (loading the model may draw a progress bar)
    assert len(errors) == 1 and "--elastic needs a MoBiQuant model" in errors[0]
