#!/usr/bin/env python3
"""Soak a real node: mixed traffic, abuse included, for a long time; RSS and open fds sampled.

    .venv/bin/python bench/soak_node.py --minutes 30

Starts `meshnet-gguf serve` (standalone) on a tiny generated F16 model with the real
llama-server, then runs worker threads that loop over: a streamed chat read to its end, a
non-streamed completion, a stream dropped after two events, a non-streamed request whose
client leaves early, and bad bodies (deep nesting, NaN, lone surrogates, n: 2, oversized).
A few slow-header sockets are opened and left hanging throughout. Every SAMPLE_S the node's
RSS and open file descriptors (and llama-server's RSS) are sampled. At the end it prints the
samples and the growth from the first sample after warm-up to the last, and exits 1 when RSS
grew by 10 % or more, or fds did not come back to their warm-up level. Everything listens on
127.0.0.1 and is stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.models.tiny_model import write_tiny_model

SAMPLE_S = 10.0
WARM_UP_FRACTION = 0.15
RSS_GROWTH_LIMIT = 0.10
SLOW_SOCKETS = 20
READY_TIMEOUT_S = 120.0
BAD_BODIES = [
    b'{"messages":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"messages":[{"role":"user","content":"hi"}],"temperature":NaN}',
    b'{"messages":[{"role":"user","content":"\\ud800"}]}',
    b'{"messages":[{"role":"user","content":"hi"}],"n":2}',
    b'{"prompt":["a","b"]}',
    b"\xff\xfe{",
]
CHAT = {"messages": [{"role": "user", "content": "Say something long."}], "max_tokens": 64, "ignore_eos": True}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--parallel", type=int, default=2)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="meshnet-soak-"))
    model = write_tiny_model(work / "tiny.gguf")
    port = free_local_port()
    url = f"http://127.0.0.1:{port}"
    log = (work / "node.log").open("wb")
    node = subprocess.Popen(
        [sys.executable, "-m", "meshnet_gguf", "serve", "--gguf", str(model), "--port", str(port), "--parallel", str(args.parallel),
         "--ctx-size", "4096", "--state-dir", str(work / "state"), "--download-dir", str(work / "models")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_ready(url, node)
        return soak(url, node, args)
    finally:
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(30)
        except subprocess.TimeoutExpired:
            node.kill()
        log.close()
        print(f"logs and state: {work}")


def wait_ready(url: str, node: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if node.poll() is not None:
            raise SystemExit(f"node exited with {node.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("node not ready")


def soak(url: str, node: subprocess.Popen[bytes], args: argparse.Namespace) -> int:
    stop = threading.Event()
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()

    def count(what: str) -> None:
        with lock:
            outcomes[what] += 1

    def worker(seed: int) -> None:
        i = seed
        with httpx.Client(base_url=url, timeout=60) as client:
            while not stop.is_set():
                i += 1
                try:
                    kind = i % 6
                    if kind == 0:
                        with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                            for _ in r.iter_bytes():
                                pass
                        count(f"stream {r.status_code}")
                    elif kind == 1:
                        r = client.post("/v1/completions", json={"prompt": "soak", "max_tokens": 32})
                        count(f"whole {r.status_code}")
                    elif kind == 2:
                        with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                            for n, _ in enumerate(r.iter_lines()):
                                if n == 2:
                                    break
                        count("dropped stream")
                    elif kind == 3:
                        try:
                            httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True}, timeout=0.05)
                        except httpx.TimeoutException:
                            pass
                        count("left early")
                    else:
                        body = BAD_BODIES[i % len(BAD_BODIES)]
                        r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
                        count(f"bad {r.status_code}")
                except httpx.HTTPError as exc:
                    count(f"error {type(exc).__name__}")
                    time.sleep(0.1)

    def slow_headers() -> None:
        # Hanging sockets, re-opened as the node closes them: they must not pile up in the node.
        while not stop.is_set():
            socks = []
            for _ in range(SLOW_SOCKETS):
                s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                socks.append(s)
            stop.wait(15)
            for s in socks:
                s.close()

    threads = [threading.Thread(target=worker, args=(k * 1000,), daemon=True) for k in range(args.workers)]
    threads.append(threading.Thread(target=slow_headers, daemon=True))
    for t in threads:
        t.start()
    proc = psutil.Process(node.pid)
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    duration = args.minutes * 60
    while time.monotonic() - started < duration:
        time.sleep(SAMPLE_S)
        children = proc.children(recursive=True)
        sample = {
            "t_s": round(time.monotonic() - started),
            "node_rss_mb": proc.memory_info().rss / 2**20,
            "node_fds": proc.num_fds(),
            "llama_rss_mb": sum(c.memory_info().rss for c in children) / 2**20,
            "requests": sum(outcomes.values()),
        }
        samples.append(sample)
        print(json.dumps({k: round(v, 1) for k, v in sample.items()}), flush=True)
    stop.set()
    for t in threads:
        t.join(60)
    time.sleep(SAMPLE_S)  # let the node close what it still holds
    settled_fds = proc.num_fds()
    health = httpx.get(url + "/health", timeout=5).json()
    warm = samples[max(0, int(len(samples) * WARM_UP_FRACTION) - 1)]
    last = samples[-1]
    growth = (last["node_rss_mb"] - warm["node_rss_mb"]) / warm["node_rss_mb"]
    print(f"outcomes: {dict(sorted(outcomes.items()))}")
    print(f"node RSS {warm['node_rss_mb']:.1f} MB after warm-up -> {last['node_rss_mb']:.1f} MB at the end ({growth:+.1%}); "
          f"peak {max(s['node_rss_mb'] for s in samples):.1f} MB")  # fmt: skip
    print(f"node fds: {warm['node_fds']:.0f} after warm-up, {min(s['node_fds'] for s in samples):.0f}-"
          f"{max(s['node_fds'] for s in samples):.0f} under load, {settled_fds} after the load stopped")  # fmt: skip
    print(f"health after: {health['state']}, {health['usage']['requests']} requests metered")
    ok = growth < RSS_GROWTH_LIMIT and settled_fds <= warm["node_fds"] and health["state"] == "ready"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
