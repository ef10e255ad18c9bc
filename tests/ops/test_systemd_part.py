"""A real node under a real NOTIFY_SOCKET: readiness, watchdog, load status, /metrics, logs, drain."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

MESSAGES = [{"role": "user", "content": "Say hello."}]


class NotifySocket:
    """What systemd would hold: an AF_UNIX datagram socket, its messages collected with arrival times."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[tuple[float, list[str]]] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode().split("\n")))

    def lines(self) -> list[str]:
        return [line for _, message in list(self.messages) for line in message]

    def first(self, prefix: str) -> float | None:
        for at, message in list(self.messages):
            if any(line.startswith(prefix) for line in message):
                return at
        return None

    def wait_for(self, prefix: str, timeout: float = 60) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            at = self.first(prefix)
            if at is not None:
                return at
            time.sleep(0.02)
        raise AssertionError(f"no {prefix!r} from the node; got {self.lines()}")

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        self._sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    sock = NotifySocket(tmp_path / "notify.sock")
    yield sock
    sock.close()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.real_llama
def test_systemd_sees_the_truth_metrics_count_real_tokens_and_drain_completes_streams(  # type: ignore[no-untyped-def]
    real_llama, tiny_gguf: Path, start_node, notify_socket: NotifySocket
) -> None:
    node = start_node(
        "--gguf", str(tiny_gguf), "--ctx-size", "4096", "--parallel", "2", "--llama-arg=--metrics",
        "--log-format", "json",
        # No warm-up: its tokens are llama-server's (in its counters) but no one's bill, and this
        # test compares the two counts (tests/llama/test_warmup.py covers the warm-up). DEBUG: llama-server's
        # routine lines are logged there, and this test checks they are tagged.
        env={
            "NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "600000",
            "MESHNET_WARMUP": "false", "MESHNET_LOG_LEVEL": "DEBUG",
        },  # fmt: skip
    )  # fmt: skip

    # READY only once llama-server answers; STATUS lines came before it.
    ready_at = notify_socket.wait_for("READY=1")
    health = node.health()
    assert health is not None and health.status_code == 200
    lines = notify_socket.lines()
    before_ready = [line for at, msg in notify_socket.messages if at < ready_at for line in msg]
    assert any(line.startswith("STATUS=loading") for line in before_ready)
    assert any(line.startswith("EXTEND_TIMEOUT_USEC=") for line in before_ready)
    assert lines.count("READY=1") == 1
    # The watchdog is fed from the node's loop: every 0.3 s here (half of WATCHDOG_USEC).
    time.sleep(1.0)
    assert notify_socket.lines().count("WATCHDOG=1") >= 2
    # llama-server does not inherit the notify socket: only the node speaks for the service.
    child = node.llama_pid()
    assert child is not None
    child_env = psutil.Process(child).environ()
    assert "NOTIFY_SOCKET" not in child_env
    # Read while llama-server lives: after the drain it is gone and its environment with it.
    internal_key = child_env["LLAMA_API_KEY"]
    assert len(internal_key) >= 16

    # Real requests through the node, then /metrics.
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused")
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8)
    chunks = list(
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, stream=True, stream_options={"include_usage": True})
    )
    streamed_usage = chunks[-1].usage
    assert answer.usage is not None and streamed_usage is not None
    assert (
        httpx.post(node.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    )
    metrics = httpx.get(node.url + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    s = _samples(metrics.text)
    chat = (("route", "/v1/chat/completions"),)
    assert s[("meshnet_requests_total", (*chat, ("status", "200")))] == 2
    assert s[("meshnet_requests_total", (*chat, ("status", "400")))] == 1
    assert s[("meshnet_completion_tokens_total", chat)] == answer.usage.completion_tokens + streamed_usage.completion_tokens
    assert s[("meshnet_prompt_tokens_total", chat)] == answer.usage.prompt_tokens + streamed_usage.prompt_tokens
    # A first token is timed when it reaches the client: a random tiny model's streamed bytes may never make a
    # whole UTF-8 character, and llama-server then streams no content at all.
    streamed_content = any(c.choices and c.choices[0].delta.content for c in chunks)
    assert s[("meshnet_time_to_first_token_seconds_count", ())] == 1 + streamed_content
    assert s[("meshnet_supervisor_state", (("state", "ready"),))] == 1
    assert s[("meshnet_slots_total", ())] == 2
    # llama-server's own counters, renamed, agree with ours.
    assert s[("meshnet_llamacpp_up", ())] == 1
    assert s[("meshnet_llamacpp_tokens_predicted_total", ())] == s[("meshnet_completion_tokens_total", chat)]

    # Drain under live streams: in-flight ones finish, new ones get 503, exit 0, STOPPING=1 sent.
    bodies: list[bytes] = []
    first_bytes = threading.Barrier(3)

    def stream() -> None:
        # ignore_eos: the random model must not end early, or nothing is left in flight to drain.
        request = {"messages": MESSAGES, "max_tokens": 1200, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", node.url + "/v1/chat/completions", json=request) as r:
            received = b""
            for n, chunk in enumerate(r.iter_raw()):
                received += chunk
                if n == 0:
                    first_bytes.wait(timeout=30)
            bodies.append(received)

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for thread in threads:
        thread.start()
    first_bytes.wait(timeout=30)
    node.signal(signal.SIGTERM)
    notify_socket.wait_for("STOPPING=1", timeout=10)
    refused = httpx.post(node.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["retry-after"]
    for thread in threads:
        thread.join(timeout=60)
    assert node.wait_exit() == 0
    assert len(bodies) == 2 and all(body.endswith(b"data: [DONE]\n\n") for body in bodies), [b[-400:] for b in bodies]

    # JSON log lines: llama-server's tagged, the internal key nowhere.
    records = [json.loads(line) for line in node.log_text().splitlines() if line.startswith("{")]
    assert any(r["source"] == "llama-server" for r in records)
    assert any(r["logger"] == "meshnet_gguf.ops.systemd_part" and "loading" in r["msg"] for r in records)
    assert internal_key not in node.log_text()


def test_health_shows_load_progress_and_elapsed_time_while_loading(  # type: ignore[no-untyped-def]
    fake_llama_path: Path, tiny_gguf: Path, start_node
) -> None:
    node = start_node(
        "--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path), env={"FAKE_LLAMA_LOAD_S": "4"}
    )  # fmt: skip
    first = node.wait_state("loading", timeout=30)
    time.sleep(1.2)
    later = node.health()
    assert later is not None and later.status_code == 503
    report = later.json()
    assert report["state"] == "loading"
    assert report["detail"].startswith("loading model: reading model metadata")
    elapsed = [float(r["detail"].rsplit(", ", 1)[1].removesuffix(" s")) for r in (first, report)]
    assert elapsed[1] > elapsed[0]
    metrics = _samples(httpx.get(node.url + "/metrics").text)
    assert metrics[("meshnet_supervisor_state", (("state", "loading"),))] == 1
    node.wait_ready()
    assert node.health().json()["load_progress"] is None  # type: ignore[union-attr]


def test_streams_still_running_when_the_drain_grace_runs_out_are_cut_with_an_error_event(  # type: ignore[no-untyped-def]
    fake_llama_path: Path, tiny_gguf: Path, start_node
) -> None:
    grace_s = 1.0
    # 400 tokens at 50 ms: twenty seconds of answer, far longer than the grace.
    node = start_node(
        "--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path), "--drain-grace", str(grace_s),
        env={"FAKE_LLAMA_TOKENS": "400", "FAKE_LLAMA_TOKEN_DELAY_S": "0.05"},
    )  # fmt: skip
    node.wait_ready()
    child = node.llama_pid()
    received: list[bytes] = []
    first_token = threading.Event()

    def stream() -> None:
        request = {"messages": MESSAGES, "max_tokens": 400, "stream": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", node.url + "/v1/chat/completions", json=request) as r:
            for chunk in r.iter_raw():
                received.append(chunk)
                first_token.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_token.wait(timeout=30)
    signalled_at = time.monotonic()
    node.signal(signal.SIGTERM)
    assert node.wait_exit(timeout=grace_s + 30) == 0
    exited_after = time.monotonic() - signalled_at
    reader.join(timeout=10)
    assert not reader.is_alive()
    # The grace was given in full, and not much more: the stream was cut, not waited for.
    assert grace_s <= exited_after < grace_s + 8, exited_after
    body = b"".join(received)
    events = [e for e in body.split(b"\n\n") if e]
    assert 0 < body.count(b'"content":"x"') < 400
    assert events[-3].startswith(b'data: {"error"') and events[-1] == b"data: [DONE]"
    assert json.loads(events[-2].split(b" ", 2)[2])["finish_reason"] == "error"
    assert "drain grace over" in node.log_text()
    assert child is not None and (not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE)
