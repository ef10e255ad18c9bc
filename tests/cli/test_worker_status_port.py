"""The pool worker's status port, played as an attacker against the real `meshnet-gguf worker` (a stand-in
ggml-rpc-server beside the fake llama-server): it listens on the node's guarded listener, so a huge
request head gets 431 and costs the worker no memory, and unfinished requests are cut at the node's
head timeout; a wildcard spelt as IPv4-mapped IPv6 is refused without --force."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.common.ports import free_local_port_pair
from meshnet_gguf.contract.signing import public_key_text
from meshnet_gguf.llama.rpc_status import STATUS_PATH
from meshnet_gguf.serving.http_server import MAX_REQUEST_HEAD_BYTES, REQUEST_HEAD_TIMEOUT_S

FAKE_LLAMA = Path(__file__).parents[1] / "support" / "fake_llama_server.py"
# What ggml-rpc-server prints at start, then it waits to be stopped.
FAKE_RPC_SERVER = """import signal, sys, time
print("Starting RPC server v5.0.0", flush=True)
print("  endpoint       : 127.0.0.1:1", flush=True)
print("Devices:", flush=True)
print("  CPU: stand-in (1024 MiB, 1000 MiB free)", flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(3600)
"""
WORKER_START_S = 60.0
STOP_S = 15.0
# The head the issue found read whole by a plain server (its memory grew by 147 MiB).
HUGE_HEAD_BYTES = 96 * 2**20
# Memory the worker may gain while refusing it: socket buffers and the allocator's slack, far below the head.
MEMORY_ALLOWANCE_BYTES = 24 * 2**20
UNFINISHED_REQUESTS = 40
# The listener checks its head timer on the event loop; a loaded test box adds a little.
CUT_SLACK_S = 3.0


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`meshnet-gguf worker` on loopback, its RPC server a stand-in; stopped by its PID at the end."""
    root = tmp_path_factory.mktemp("worker")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    llama = _executable(bin_dir / "llama-server", f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_LLAMA}" "$@"\n')
    rpc_script = root / "fake_rpc_server.py"
    rpc_script.write_text(FAKE_RPC_SERVER)
    _executable(bin_dir / "ggml-rpc-server", f'#!/bin/sh\nexec "{sys.executable}" "{rpc_script}" "$@"\n')
    port = free_local_port_pair()
    node_key = public_key_text(Ed25519PrivateKey.generate().public_key())
    argv = [
        sys.executable, "-m", "meshnet_gguf", "worker", "--host", "127.0.0.1", "--port", str(port), "--node-key", node_key,
        "--llama-server", str(llama), "--no-build", "--no-cache",
    ]  # fmt: skip
    env = {**os.environ, "XDG_CACHE_HOME": str(root / "cache")}
    log_path = root / "worker.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + WORKER_START_S
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port + 1}{STATUS_PATH}", timeout=1).status_code == 401:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield proc, port + 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _rss(proc: subprocess.Popen[bytes]) -> int:
    return int(psutil.Process(proc.pid).memory_info().rss)


def _send_head(port: int, head_line_bytes: int) -> tuple[int, bytes]:
    """Send a request whose one header line is this long; (bytes the worker let through, its answer)."""
    chunk = b"a" * 2**20
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(b"GET " + STATUS_PATH.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            while sent < head_line_bytes:
                sent += sock.send(chunk[: head_line_bytes - sent])
            sock.sendall(b"\r\n\r\n")
        except OSError:
            pass  # the worker closed the connection: what it refused, it does not read
        try:
            return sent, sock.recv(65536)
        except OSError:
            return sent, b""


def test_a_huge_request_head_gets_431_and_costs_the_worker_no_memory(worker: tuple[subprocess.Popen[bytes], int]) -> None:
    proc, port = worker
    sent, answer = _send_head(port, 4 * MAX_REQUEST_HEAD_BYTES)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    before = _rss(proc)
    sent, _ = _send_head(port, HUGE_HEAD_BYTES)
    grown = _rss(proc) - before
    assert grown < MEMORY_ALLOWANCE_BYTES, f"the worker grew by {grown / 2**20:.0f} MiB reading a {sent / 2**20:.0f} MiB head"
    assert sent < HUGE_HEAD_BYTES, "the worker read the whole head"
    assert httpx.get(f"http://127.0.0.1:{port}{STATUS_PATH}", timeout=5).status_code == 401  # still serving


def test_unfinished_requests_are_cut_at_the_nodes_head_timeout(worker: tuple[subprocess.Popen[bytes], int]) -> None:
    _, port = worker
    unfinished = [socket.create_connection(("127.0.0.1", port), timeout=REQUEST_HEAD_TIMEOUT_S + CUT_SLACK_S * 2)
                  for _ in range(UNFINISHED_REQUESTS)]  # fmt: skip
    started = time.monotonic()
    try:
        for sock in unfinished:
            sock.sendall(b"GET " + STATUS_PATH.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
        for sock in unfinished:
            answer = b""
            while chunk := sock.recv(65536):  # until the worker closes it
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert time.monotonic() - started < REQUEST_HEAD_TIMEOUT_S + CUT_SLACK_S
    finally:
        for sock in unfinished:
            sock.close()


def test_every_refusal_of_the_status_port_is_openai_error_json(worker: tuple[subprocess.Popen[bytes], int]) -> None:
    """The worker's port answers as every door of the node does: no token, a forged one, another path or method
    (before, a missing path was Starlette's plain-text 404 and a refused token `{"error": "..."}`)."""
    _, port = worker
    base = f"http://127.0.0.1:{port}"
    forged = public_key_text(Ed25519PrivateKey.generate().public_key())  # not a token at all
    for answer, status, code in [
        (httpx.get(base + STATUS_PATH, timeout=5), 401, "invalid_status_token"),
        (httpx.get(base + STATUS_PATH, headers={"authorization": f"Bearer {forged}"}, timeout=5), 401, "invalid_status_token"),
        (httpx.get(base + "/metrics", timeout=5), 404, "not_found"),
        # Another method meets the row's guard first: without the token, the path shows nothing more.
        (httpx.post(base + STATUS_PATH, timeout=5), 401, "invalid_status_token"),
    ]:
        assert answer.status_code == status and answer.headers["content-type"] == "application/json", answer.text
        error = answer.json()["error"]
        assert error["code"] == code and error["message"] and "type" in error, error


@pytest.mark.parametrize("host", ["::ffff:0.0.0.0", "0:0:0:0:0:ffff:0:0"])
def test_the_mapped_ipv4_wildcard_is_refused_without_force(host: str, tmp_path: Path) -> None:
    node_key = public_key_text(Ed25519PrivateKey.generate().public_key())
    argv = [sys.executable, "-m", "meshnet_gguf", "worker", "--host", host, "--node-key", node_key, "--no-build"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert done.returncode == 2 and "every interface" in done.stderr and "--force" in done.stderr, done.stderr


def test_sigterm_stops_the_status_port_and_the_rpc_server(worker: tuple[subprocess.Popen[bytes], int]) -> None:
    """The listener leaves signals to the worker (as to the node): SIGTERM still ends both, cleanly. Runs last."""
    proc, port = worker
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the stand-in ggml-rpc-server is running"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(STOP_S) == 0
    _, alive = psutil.wait_procs(children, timeout=STOP_S)
    assert not alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}{STATUS_PATH}", timeout=2)
