"""The proxy's behaviour through a real node process in front of the fake llama-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from node_process import free_port

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@pytest.fixture
def fake_node(start_node, fake_llama_path: Path, tiny_gguf: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Start a node serving the tiny model through the fake llama-server; returns (node, request log)."""

    def start(*extra: str, **fake_env: str):  # type: ignore[no-untyped-def]
        request_log = tmp_path / "requests.jsonl"
        env = {"FAKE_LLAMA_REQUEST_LOG": str(request_log), **fake_env}
        node = start_node("--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path), *extra, env=env)
        return node, request_log

    return start
    return node, request_log


def forwarded(request_log: Path) -> list[dict]:
    if not request_log.exists():
        return []
    return [json.loads(line) for line in request_log.read_text().splitlines()]


@pytest.fixture
def direct_fake(fake_llama_path: Path):  # type: ignore[no-untyped-def]
    """Start the fake llama-server on its own, no key: what the node's upstream sends, byte for byte."""
    procs: list[subprocess.Popen] = []

    def start(alias: str, **fake_env: str) -> str:
        port = free_port()
        argv = [str(fake_llama_path), "--port", str(port), "--alias", alias]
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, env={**os.environ, **fake_env}))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        return url

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=5)


def test_stream_bytes_pass_through_unchanged_plus_one_usage_comment(fake_node, direct_fake) -> None:  # type: ignore[no-untyped-def]
    node, request_log = fake_node(FAKE_LLAMA_PING_EVERY="2")
    node.wait_ready()
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    direct_url = direct_fake(httpx.get(node.url + "/health").json()["model"], FAKE_LLAMA_PING_EVERY="2")
    with httpx.Client() as client:
        direct = client.post(direct_url + "/v1/chat/completions", json=body).content
        via = client.post(node.url + "/v1/chat/completions", json=body, headers={"x-request-id": "abc-123"})
    assert via.status_code == 200
    assert via.headers["content-type"].startswith("text/event-stream")
    assert via.headers["cache-control"] == "no-cache"
    assert via.headers["x-accel-buffering"] == "no"
    assert "content-encoding" not in via.headers
    assert via.headers["x-meshnet-request-id"] == "abc-123"
    head, _, tail = via.content.partition(b": meshnet-usage ")
    usage_line, _, rest = tail.partition(b"\n\n")
    assert head + rest == direct  # everything else byte-identical, keep-alive pings included
    assert b": ping\n\n" in via.content
    assert rest == b"data: [DONE]\n\n"
    usage = json.loads(usage_line)
    assert usage == {"request_id": "abc-123", "prompt_tokens": 7, "cached_tokens": 2, "completion_tokens": 5, "finish_reason": "length"}


def test_usage_is_always_asked_of_llama_but_only_shown_when_the_client_asked(fake_node) -> None:  # type: ignore[no-untyped-def]
    node, request_log = fake_node()
    node.wait_ready()
    with httpx.Client() as client:
        plain = client.post(node.url + "/v1/chat/completions", json={**CHAT, "stream": True}).content
    assert forwarded(request_log)[-1]["body"]["stream_options"] == {"include_usage": True}
    assert b'"choices":[]' not in plain  # the usage-only chunk was dropped
    assert b": meshnet-usage " in plain and plain.endswith(b"data: [DONE]\n\n")
    # The official SDK streams it without noticing the comment.
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused")
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=5, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "xxxxx"
    with_usage = list(
        client.chat.completions.create(
            model="tiny", messages=CHAT["messages"], max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 4


def test_non_streamed_answers_carry_usage_headers(fake_node) -> None:  # type: ignore[no-untyped-def]
    node, _ = fake_node()
    node.wait_ready()
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=CHAT["messages"], max_tokens=3)
    assert raw.headers["x-meshnet-usage-prompt-tokens"] == "7"
    assert raw.headers["x-meshnet-usage-completion-tokens"] == "3"
    assert raw.headers["x-meshnet-request-id"].startswith("req-")
    assert raw.parse().choices[0].message.content == "xxx"
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text == "xx"
    assert client.embeddings.create(model="tiny", input="hi").data[0].embedding == [0.1, 0.2]
    assert [m.id for m in client.models.list()] == [httpx.get(node.url + "/health").json()["model"]]
    health = httpx.get(node.url + "/health").json()
    assert health["usage"]["requests"] == 3 and health["usage"]["completion_tokens"] == 5


def test_bad_input_never_reaches_llama_server(fake_node) -> None:  # type: ignore[no-untyped-def]
    node, request_log = fake_node()
    node.wait_ready()
    with httpx.Client(base_url=node.url) as client:
        cases = {
            "too large": client.post("/v1/chat/completions", content=b"{" + b" " * 9_000_000 + b"}"),
            "invalid json": client.post("/v1/chat/completions", content=b"{nope"),
            "not an object": client.post("/v1/chat/completions", json=[1, 2]),
            "no messages": client.post("/v1/chat/completions", json={"max_tokens": 3}),
            "no prompt": client.post("/v1/completions", json={"messages": []}),
            "unknown route": client.post("/v1/nope", json=CHAT),
            "wrong method": client.get("/v1/chat/completions"),
        }
    expected = {"too large": 413, "unknown route": 404, "wrong method": 405}
    for name, response in cases.items():
        assert response.status_code == expected.get(name, 400), name
        error = response.json()["error"]
        assert error["message"] and error["type"], name
    assert forwarded(request_log) == []


def test_all_slots_busy_answers_503_with_retry_after(fake_node) -> None:  # type: ignore[no-untyped-def]
    node, _ = fake_node("--parallel", "1", FAKE_LLAMA_TOKEN_DELAY_S="0.05", FAKE_LLAMA_TOKENS="40")
    node.wait_ready()
    with httpx.Client(base_url=node.url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 40, "stream": True}) as first:
            chunks = first.iter_bytes()  # keep a reference: a dropped iterator closes the response
            next(chunks)
            assert httpx.get(node.url + "/health").json()["slots_busy"] == 1
            second = client.post("/v1/chat/completions", json=CHAT)
            assert second.status_code == 503
            assert second.headers["retry-after"] == "2"
            assert "slots" in second.json()["error"]["message"]
            rest = b"".join(chunks)
        assert rest.endswith(b"data: [DONE]\n\n")
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_loading_node_answers_503_and_health_says_why(fake_node) -> None:  # type: ignore[no-untyped-def]
    node, request_log = fake_node(FAKE_LLAMA_LOAD_S="4")
    node.wait_state("loading")
    health = httpx.get(node.url + "/health")
    assert health.status_code == 503 and health.headers["retry-after"]
    response = httpx.post(node.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 503 and "not ready" in response.json()["error"]["message"]
    assert forwarded(request_log) == []
    node.wait_ready()


def test_llama_dying_mid_stream_ends_the_client_stream_with_an_error_event(fake_node) -> None:  # type: ignore[no-untyped-def]
    node, _ = fake_node(
        FAKE_LLAMA_DIE_AFTER="3", FAKE_LLAMA_TOKEN_DELAY_S="0.05", FAKE_LLAMA_TOKENS="50"
    )
    node.wait_ready()
    with httpx.Client(timeout=10) as client:
        started = time.monotonic()
        body = client.post(node.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 50, "stream": True}).content
        took = time.monotonic() - started
    assert took < 1.5  # three 50 ms tokens, then the end within a second of the death
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert events[-3].startswith(b'data: {"error"')
    assert json.loads(events[-2].split(b" ", 2)[2])["finish_reason"] == "error"
    node.wait_state("restarting", timeout=5)
    node.wait_ready(timeout=10)


def test_api_key_guards_a_standalone_node(fake_node) -> None:  # type: ignore[no-untyped-def]
    node, request_log = fake_node("--api-key", "sesame")
    node.wait_ready()
    assert httpx.post(node.url + "/v1/chat/completions", json=CHAT).status_code == 401
    assert forwarded(request_log) == []
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="sesame")
    assert client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=2).choices[0].message.content == "xx"


def test_sigterm_drains_in_flight_streams_refuses_new_ones_and_exits_0(fake_node) -> None:  # type: ignore[no-untyped-def]
    node, _ = fake_node(FAKE_LLAMA_TOKEN_DELAY_S="0.05", FAKE_LLAMA_TOKENS="30")
    node.wait_ready()
    child = node.llama_pid()
    bodies: list[bytes] = []

    def stream() -> None:
        with httpx.Client(timeout=30) as client:
            bodies.append(client.post(node.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 30, "stream": True}).content)

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.4)
    node.signal(signal.SIGTERM)
    time.sleep(0.2)
    refused = httpx.post(node.url + "/v1/chat/completions", json=CHAT)
    assert refused.status_code == 503 and refused.headers["retry-after"]
    health = httpx.get(node.url + "/health")
    assert health.status_code == 503 and health.json()["state"] == "draining"
    for t in threads:
        t.join(timeout=30)
    assert node.wait_exit() == 0
    assert len(bodies) == 2 and all(b.endswith(b"data: [DONE]\n\n") and b.count(b'"content":"x"') == 30 for b in bodies)
    import psutil

    assert child and (not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE)


def test_cli_reports_setup_errors_clearly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = subprocess.run(
        [sys.executable, "-m", "meshnet_gguf", "serve", "--gguf", str(tmp_path / "missing.gguf"), "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "missing.gguf" in done.stderr and "Traceback" not in done.stderr


def test_a_cut_short_stream_counts_only_real_tokens() -> None:
    # Without llama-server's usage chunk (client gone, child died) the node counts content
    # events; the opening role delta and the empty closing chunk are not tokens.
    from meshnet_gguf.metering import _carries_a_token

    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}\n\n'
    token = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
    closing = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
    text = b'data: {"choices":[{"index":0,"text":"ab","finish_reason":null}]}\n\n'
    empty_text = b'data: {"choices":[{"index":0,"text":"","finish_reason":"stop"}]}\n\n'
    tool = b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n'
    assert [_carries_a_token(e) for e in (role, token, closing, text, empty_text, tool)] == [
        False, True, False, True, False, True,
    ]  # fmt: skip
