"""Hardened edges, played as an attacker and as a careless client against the node's real front
(proxy + listener) in front of the fake llama-server: every bad body gets a 400 naming what is
wrong and never reaches llama-server; headers are bounded; who may send a body is settled
before it is read; a valid body is never turned invalid on its way upstream."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import httpx
import pytest

from meshnet_gguf.contract import bearer
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.protocol import ROUTE_HEADER
from meshnet_gguf.contract.strict_json import MAX_JSON_DEPTH, parse_json_object
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.child import child_environment
from meshnet_gguf.serving import access, http_server, routes
from meshnet_gguf.serving.request_validation import rewrite_top_level, validate_request
from support.billing_harness import LlamaChild, Tracker, serve_front

pytestmark = pytest.mark.anyio
JSON = {"content-type": "application/json"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
USER = '"messages":[{"role":"user","content":"hi"}]'


@pytest.fixture(scope="module")
def fake_upstream(fake_llama: BinaryInfo, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    request_log = tmp_path_factory.mktemp("fake-log") / "requests.jsonl"
    child = LlamaChild(fake_llama, tiny_gguf, env={"FAKE_LLAMA_REQUEST_LOG": str(request_log)})
    yield child, request_log
    child.close()


def generations(request_log: Path) -> list[dict]:
    """Inference requests llama-server received (its prompt-count calls are not generations)."""
    if not request_log.exists():
        return []
    return [json.loads(line) for line in request_log.read_text().splitlines()]


# Bodies llama-server answers with a 500 (measured on the bundled build), or that multiply work.
BAD_BODIES: dict[str, tuple[str, bytes, str]] = {
    "nested arrays": ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, "json_too_deep"),
    "nested in a key": ("/v1/chat/completions", b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "json_too_deep"),
    "just too deep": (
        "/v1/chat/completions",
        ("{" + USER + ',"x":' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}").encode(),
        "json_too_deep",
    ),
    "lone surrogate": ("/v1/chat/completions", b'{"messages":"\\ud800"}', "invalid_unicode"),
    "lone surrogate in content": ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"\\udc00x"}]}', "invalid_unicode"),
    "lone surrogate in a key": ("/v1/chat/completions", ("{" + USER + ',"\\ud800":1}').encode(), "invalid_unicode"),
    "NaN": ("/v1/chat/completions", ("{" + USER + ',"temperature":NaN}').encode(), "invalid_json"),
    "Infinity": ("/v1/chat/completions", ("{" + USER + ',"temperature":-Infinity}').encode(), "invalid_json"),
    "1e999": ("/v1/chat/completions", ("{" + USER + ',"temperature":1e999}').encode(), "invalid_json"),
    "huge integer": ("/v1/chat/completions", ("{" + USER + ',"seed":123456789012345678901234567890}').encode(), "invalid_json"),
    "UTF-8 surrogate bytes": ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"\xed\xa0\x80"}]}', "invalid_encoding"),
    "invalid UTF-8": ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"\xff"}]}', "invalid_encoding"),
    "UTF-16 body": ("/v1/chat/completions", json.dumps(CHAT).encode("utf-16"), "invalid_encoding"),
    "UTF-32 body": ("/v1/chat/completions", json.dumps(CHAT).encode("utf-32"), "invalid_encoding"),
    "duplicate key": ("/v1/chat/completions", ("{" + USER + ',"max_tokens":1,"max_tokens":9}').encode(), "duplicate_key"),
    "tools false": ("/v1/chat/completions", ("{" + USER + ',"tools":false}').encode(), "invalid_type"),
    "tools [[]]": ("/v1/chat/completions", ("{" + USER + ',"tools":[[]]}').encode(), "invalid_type"),
    "n 2": ("/v1/chat/completions", ("{" + USER + ',"n":2}').encode(), "multiple_completions_unsupported"),
    "n_cmpl 2": ("/v1/completions", b'{"prompt":"a","n_cmpl":2}', "multiple_completions_unsupported"),
    "n_cmpl chat": ("/v1/chat/completions", ("{" + USER + ',"n_cmpl":3}').encode(), "multiple_completions_unsupported"),
    "prompt list": ("/v1/completions", b'{"prompt":["a","b","c"]}', "multiple_prompts_unsupported"),
    "prompt token lists": ("/v1/completions", b'{"prompt":[[1,2],[3]]}', "multiple_prompts_unsupported"),
    "not an object": ("/v1/chat/completions", b"[1,2]", "invalid_json"),
    "trailing garbage": ("/v1/chat/completions", json.dumps(CHAT).encode() + b"x", "invalid_json"),
    "empty": ("/v1/chat/completions", b"", "invalid_json"),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_every_bad_body_is_a_400_that_says_why(name: str) -> None:
    path, body, code = BAD_BODIES[name]
    with pytest.raises(ApiError) as refused:
        validate_request(path, parse_json_object(body))
    assert (refused.value.status, refused.value.code) == (400, code)


async def test_bad_bodies_get_400_from_the_node_and_never_reach_llama_server(fake_upstream) -> None:  # type: ignore[no-untyped-def]
    child, request_log = fake_upstream
    before = len(generations(request_log))
    async with serve_front(child.url) as front, httpx.AsyncClient(base_url=front.url, timeout=30) as client:
        for name, (path, body, code) in BAD_BODIES.items():
            answer = await client.post(path, content=body, headers=JSON)
            assert answer.status_code == 400, (name, answer.text[:200])
            assert answer.json()["error"]["code"] == code, name
        # The node is healthy and serves the next request.
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert len(generations(request_log)) == before + 1


async def test_a_refused_body_does_not_use_up_its_route(fake_upstream, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    child, _ = fake_upstream
    tracker = Tracker()
    nested = b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with serve_front(child.url, tracker=tracker, state_dir=tmp_path) as front:
        assert front.gate is not None and front.identity is not None
        token = tracker.route(front.identity.node_id, "/v1/chat/completions", nested)
        async with httpx.AsyncClient(base_url=front.url, timeout=30) as client:
            answer = await client.post("/v1/chat/completions", content=nested, headers={**JSON, ROUTE_HEADER: token})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "json_too_deep"
        assert len(front.gate.replay_cache) == 0
        assert front.ledger is not None and front.ledger.entries_sync() == []


def test_rewriting_keeps_every_other_value_byte_for_byte() -> None:
    body = b'{ "messages" : [{"role":"user","content":"\\u00e9\\ud83d\\ude00"}], "temperature": 1.00000000000000000001, "top_p":1E-2, "max_tokens": 900 }'
    parse_json_object(body)
    out = rewrite_top_level(body, {"max_tokens": 16, "n_predict": 16})
    assert out == (
        b'{"messages":[{"role":"user","content":"\\u00e9\\ud83d\\ude00"}],"temperature":1.00000000000000000001,'
        b'"top_p":1E-2,"max_tokens":16,"n_predict":16}'
    )
    assert json.loads(out)["max_tokens"] == 16


async def test_the_route_cap_leaves_the_clients_numbers_as_written(fake_upstream, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    child, request_log = fake_upstream
    tracker = Tracker()
    # Python would re-serialise 1.7976931348623157e308 * 10 as Infinity; a valid big float must pass unchanged.
    body = ("{" + USER + ',"temperature":1.0e308,"top_p":0.1000000000000000055511151231257827,"max_tokens":500,"stream":true}').encode()
    async with serve_front(child.url, tracker=tracker, state_dir=tmp_path) as front:
        assert front.identity is not None
        token = tracker.route(front.identity.node_id, "/v1/chat/completions", body, max_tokens=4)
        async with httpx.AsyncClient(base_url=front.url, timeout=30) as client:
            answer = await client.post("/v1/chat/completions", content=body, headers={**JSON, ROUTE_HEADER: token})
    assert answer.status_code == 200
    raw = request_log.read_text().splitlines()[-1]
    sent = json.loads(raw)["body"]
    assert sent["max_tokens"] == 4 and sent["temperature"] == 1.0e308
    assert "stream_options" not in sent  # the client's stream is the client's: nothing added


async def test_key_and_route_are_checked_before_the_body_is_read(fake_upstream, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    child, _ = fake_upstream
    tracker = Tracker()
    promised = 5_000_000  # announced, never sent: a node that reads first would wait for it
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {promised}\r\n"
    async with serve_front(child.url, api_key="s3cret") as front:
        port = int(front.url.rsplit(":", 1)[1])
        reply = await _raw_exchange(port, (head + "Authorization: Bearer wrong\r\n\r\n{").encode())
        assert reply.startswith(b"HTTP/1.1 401")
    async with serve_front(child.url, tracker=tracker, state_dir=tmp_path) as front:
        port = int(front.url.rsplit(":", 1)[1])
        forged = Tracker().route("someone", "/v1/chat/completions", b"{}")
        reply = await _raw_exchange(port, (head + f"{ROUTE_HEADER}: {forged}\r\n\r\n{{").encode())
        assert reply.startswith(b"HTTP/1.1 401") and b"route_bad_signature" in reply


async def _raw_exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(data)
        with anyio.fail_after(timeout):
            return await stream.receive(65536)


def test_the_api_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = bearer.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(bearer.hmac, "compare_digest", spy)
    with pytest.raises(ApiError):
        access.check_api_key({"authorization": "Bearer s3cre"}, "s3cret")
    access.check_api_key({"authorization": "Bearer s3cret"}, "s3cret")
    assert len(calls) == 2


async def test_a_standalone_node_answers_only_its_own_host_names_and_json(fake_upstream) -> None:  # type: ignore[no-untyped-def]
    child, _ = fake_upstream
    async with serve_front(child.url, allowed_hosts=["node.lan"]) as front, httpx.AsyncClient(base_url=front.url, timeout=30) as client:
        port = front.url.rsplit(":", 1)[1]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", f"node.lan:{port}", "192.168.1.20:8080"):
            assert (await client.post("/v1/chat/completions", json=CHAT, headers={"host": host})).status_code == 200, host
        # DNS rebinding: a page on attacker.example whose name now resolves to 127.0.0.1.
        for host in (f"attacker.example:{port}", "localhost.attacker.example", ""):
            answer = await client.post("/v1/chat/completions", json=CHAT, headers={"host": host})
            assert answer.status_code == 403 and answer.json()["error"]["code"] == "host_not_allowed", host
        assert (await client.get("/v1/models", headers={"host": "attacker.example"})).status_code == 403
        # A cross-site form post cannot send application/json without a preflight this node never grants.
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {"content-type": content_type} if content_type else {}
            answer = await client.post("/v1/chat/completions", content=json.dumps(CHAT).encode(), headers=headers)
            assert answer.status_code == 415, content_type
        ok = await client.post(
            "/v1/chat/completions", content=json.dumps(CHAT).encode(), headers={"content-type": "application/json; charset=utf-8"}
        )
        assert ok.status_code == 200


async def test_oversized_request_heads_get_431(fake_upstream) -> None:  # type: ignore[no-untyped-def]
    child, _ = fake_upstream
    async with serve_front(child.url) as front:
        port = int(front.url.rsplit(":", 1)[1])
        big = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (1024 * 1024) + b"\r\n\r\n"
        reply = await _raw_exchange(port, big)
        assert reply.startswith(b"HTTP/1.1 431")
        # Refused before any app sees it, in the same OpenAI error JSON as every door behind the listener.
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "head_too_large"
        # Many headers, each small, add up the same way.
        many = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"b" * 100) for i in range(2000)) + b"\r\n"
        assert (await _raw_exchange(port, many)).startswith(b"HTTP/1.1 431")
        async with httpx.AsyncClient(base_url=front.url) as client:
            assert (await client.get("/health")).status_code == 200


async def test_slow_and_idle_connections_are_closed(fake_upstream, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    child, _ = fake_upstream
    monkeypatch.setattr(http_server, "REQUEST_HEAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(routes, "BODY_READ_TIMEOUT_S", 0.5)
    async with serve_front(child.url) as front:
        port = int(front.url.rsplit(":", 1)[1])
        started = time.monotonic()
        async with await anyio.connect_tcp("127.0.0.1", port) as slow_head:
            await slow_head.send(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
            with anyio.fail_after(5):
                reply = await slow_head.receive(65536)
            assert reply.startswith(b"HTTP/1.1 408")
        async with await anyio.connect_tcp("127.0.0.1", port) as idle:
            with anyio.fail_after(5):
                with pytest.raises(anyio.EndOfStream):
                    await idle.receive(65536)  # closed without a word
        assert time.monotonic() - started < 4
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        reply = await _raw_exchange(port, head)
        assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout" in reply


def test_llama_server_does_not_inherit_the_nodes_settings() -> None:
    inherited = {"PATH": "/bin", "MESHNET_ENROLMENT_SECRET": "s", "MESHNET_API_KEY": "k", "meshnet_tracker": "t", "HOME": "/h"}
    env = child_environment(inherited, {"LLAMA_ARG_X": "1"})
    assert env == {"PATH": "/bin", "HOME": "/h", "LLAMA_ARG_X": "1"}


def test_supervisor_spawns_llama_server_without_meshnet_variables(
    fake_llama: BinaryInfo, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real spawn path: the fake llama-server writes down the environment it was given."""
    from meshnet_gguf.common.settings import NodeSettings
    from meshnet_gguf.llama.child import ChildSpec
    from meshnet_gguf.llama.supervisor import Supervisor, SupervisorPolicy
    from meshnet_gguf.llama.warmup import CPU_WARMUP

    policy = SupervisorPolicy.from_settings(NodeSettings(), CPU_WARMUP)

    dump = tmp_path / "env.json"
    monkeypatch.setenv("MESHNET_ENROLMENT_SECRET", "do-not-leak")
    monkeypatch.setenv("FAKE_LLAMA_ENV_DUMP", str(dump))
    spec = ChildSpec(binary=fake_llama, args=["-m", str(tiny_gguf)])
    supervisor = Supervisor(spec, policy, state_dir=tmp_path)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(supervisor.run)
            with anyio.fail_after(20):
                # The fake writes the file in place: wait until it holds a whole JSON document.
                while not _whole_json(dump):
                    await anyio.sleep(0.05)
            await supervisor.stop()
            tg.cancel_scope.cancel()

    anyio.run(main)
    env = json.loads(dump.read_text())
    assert "LLAMA_API_KEY" in env and not [k for k in env if k.upper().startswith("MESHNET_")]


def test_the_listener_socket_lets_asyncio_turn_nagle_off() -> None:
    """asyncio sets TCP_NODELAY only on accepted sockets whose protocol number says TCP; with 0, every
    non-streamed answer (head and body written apart) waited ~40 ms for the client's delayed ACK."""
    import socket

    sock = http_server.bind_listener("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def _whole_json(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True
