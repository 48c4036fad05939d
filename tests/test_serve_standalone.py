"""`bitquilt serve` on a standalone export (`bitquilt export --to standalone`): a real server process in the
standalone runtime's batch (bitquilt.runtime.standalone.batch), called with the openai client as on a saved model
(tests/test_serve.py, whose helpers these are), batched as alone, a MoBiQuant export routed per request, and a
damaged export refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
from test_serve import (
    KEY,
    LONG,
    PROMPT,
    STORY,
    _free_port,
    _metrics,
    _post,
    _serving,
    _stream_usage,
    _texts,
    _together,
    openai,
)

from bitquilt.cli import main
from bitquilt.runtime.standalone.model import FILE, StandaloneModel


@pytest.fixture(scope="module")
def export_server(exported_smollm):
    """(port, served model name) of `bitquilt serve` on the RTN W4 export of smollm2-135m, three sequences at once."""
    with _serving(exported_smollm / "out", "--api-key", KEY, "--max-batch", "3", "--max-queue", "4") as (port, _):
        yield port, "out"


@pytest.fixture(scope="module")
def export_client(export_server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{export_server[0]}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_an_export_answers_completions_and_chats_streamed_or_not(export_server, export_client, exported_smollm,
                                                                 capsys):
    name = export_server[1]
    whole = export_client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
    assert main(["generate", str(exported_smollm / "out"), "--prompt", PROMPT, "--max-new-tokens", "8", "--json"]) == 0
    generated = json.loads(capsys.readouterr().out)["completion"]
    assert whole.choices[0].text == generated and "Paris" in generated and whole.model == name
    assert whole.usage.prompt_tokens == 5 and whole.usage.completion_tokens == 8
    chunks = list(export_client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0,
                                                   stream=True))
    assert "".join(c.choices[0].text for c in chunks) == generated and chunks[-1].choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = export_client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    chunks = list(export_client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                                        stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content

    def sample(seed: int) -> str:
        return export_client.completions.create(model=name, prompt=PROMPT, max_tokens=10, temperature=1.0,
                                                top_p=0.9, seed=seed).choices[0].text

    assert sample(7) == sample(7) and len({sample(7), sample(8), sample(9)}) > 1


def test_each_sequence_of_an_exports_batch_gets_the_greedy_tokens_it_gets_alone(export_server):
    port = export_server[0]
    bodies = [{"prompt": prompt, "max_tokens": n, "temperature": 0}
              for prompt, n in ((PROMPT, 40), (STORY, 30), (LONG, 30), ("def fibonacci(n):", 20))]
    alone = [_post(port, "/v1/completions", body) for body in bodies]
    together, most = _together(port, bodies, stagger=0.05)  # the fourth waits for a free place among three
    assert most >= 2 and _texts(together) == _texts(alone)
    assert [a["usage"] for _, a in together] == [a["usage"] for _, a in alone]
    assert _metrics(port)["active_sequences"] == 0


def test_a_request_routes_a_mobiquant_export_at_its_own_avg_bits(routed_tiny):
    """avg_bits per request in one batch, the server's --avg-bits for the others, out of range a 400, and --elastic
    at a target no stream reaches holds the highest bits."""
    low, high = StandaloneModel(routed_tiny / "out").routed_range()
    settings = (low + 0.2 * (high - low), high - 0.2 * (high - low))
    with _serving(routed_tiny / "out", "--max-batch", "2", "--avg-bits", repr(settings[1])) as (port, _):
        bodies = [{"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "avg_bits": b} for b in settings]
        answers, _ = _together(port, bodies, stagger=0.0)
        used = [a[1]["usage"]["avg_bits"] for a in answers]
        assert used[0] < used[1] and all(b == pytest.approx(s, abs=0.35) for b, s in zip(used, settings))
        assert _stream_usage(port, bodies[0])["avg_bits"] == pytest.approx(used[0])
        plain = _post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})[1]
        assert plain["usage"]["avg_bits"] == pytest.approx(used[1])  # the server's --avg-bits
        status, answer = _post(port, "/v1/completions", {"prompt": PROMPT, "avg_bits": high + 1})
        assert status == 400 and answer["error"]["param"] == "avg_bits" and "routed range" in answer["error"]["message"]
    with _serving(routed_tiny / "out", "--elastic", "0.001") as (port, _):
        full = _post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})[1]
        assert _metrics(port)["elastic_bits"] == pytest.approx(high) and full["usage"]["avg_bits"] > used[0]


@pytest.mark.parametrize("flags, damage, message", [
    ([], "truncate", "standalone.safetensors"),
    (["--avg-bits", "99"], None, "routed range"),
    (["--engine", "lean"], None, "standalone runtime only"),
])
def test_a_damaged_export_or_a_bad_flag_is_one_line_and_exit_2(routed_tiny, tmp_path, capsys, flags, damage,
                                                               message):
    export = tmp_path / "out"
    shutil.copytree(routed_tiny / "out", export)
    if damage:
        data = (export / FILE).read_bytes()
        (export / FILE).write_bytes(data[:len(data) // 2])
    assert main(["serve", str(export), "--port", str(_free_port()), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
