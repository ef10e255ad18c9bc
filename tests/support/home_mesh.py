"""Tracker and relay on the far side of a home router's NAT, nodes behind it, a client on its own link.

Built on `home_network.HomeNetwork`. The tracker and the relay run in this namespace on the WAN
address; every node runs in the home namespace (`ip netns exec`, so its PID is the node's own) in front
of the fake llama-server; the client's requests go out from the client namespace, so both the node's
link and the client's can be slowed and made lossy. Every process is stopped by PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.llama.child import PIDFILE_NAME, reap_stale_child
from support.home_network import HomeNetwork
from support.relay_processes import ServiceProcess, node_env, node_ledger, relay_process, tracker_key, tracker_process, wait_for

# A node in front of the fake llama-server is ready in about a second; a loaded 2-core machine may take ten.
NODE_READY_S = 60.0
# SIGTERM to a node, then SIGKILL: its drain grace is 2 s.
NODE_STOP_S = 20.0
# One client request's whole life; streams in these tests last a few seconds.
REQUEST_TIMEOUT_S = 60.0


@dataclass
class StreamResult:
    """What one client saw of a streamed request: the body's bytes, its parsed events, and how it ended."""

    status: int
    body: bytes
    request_id: str | None
    content: str = ""
    done: bool = False  # `data: [DONE]` arrived
    error_event: dict[str, Any] | None = None  # an OpenAI-style `data: {"error": ...}` event
    transport_error: str | None = None  # the connection broke with no error event
    first_byte_s: float | None = None
    first_token_s: float | None = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error_event is None and self.transport_error is None


def parse_events(body: bytes) -> tuple[str, bool, dict[str, Any] | None]:
    """(content, saw [DONE], the error event) of an SSE body."""
    content, done, error = [], False, None
    for line in body.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            done = True
            continue
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if isinstance(event, dict) and "error" in event:
            error = event["error"]
        for choice in event.get("choices") or []:
            content.append((choice.get("delta") or {}).get("content") or "")
    return "".join(content), done, error


class HomeNode:
    """`meshnet-gguf serve --relay` in the home namespace, in front of the fake llama-server."""

    def __init__(self, mesh: HomeMesh, name: str, gguf: Path, fake_llama: Path, env: dict[str, str]) -> None:
        self.mesh, self.name = mesh, name
        self.workdir = mesh.workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.workdir / "state"
        self.port = free_local_port()  # a port on the home namespace's own loopback, free there as here
        self.log_path = self.workdir / "node.log"
        self.argv = [
            *mesh.net.exec_prefix(mesh.net.home), sys.executable, "-m", "meshnet_gguf", "serve",
            "--gguf", str(gguf), "--llama-server", str(fake_llama), "--port", str(self.port),
            "--state-dir", str(self.state_dir), "--download-dir", str(self.workdir / "models"),
            "--tracker", mesh.tracker.url, "--tracker-public-key", mesh.tracker_key, "--relay", mesh.relay.url,
            "--parallel", "4", "--drain-grace", "2",
        ]  # fmt: skip
        self.env = {**os.environ, **node_env(mesh.tracker), **env}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> HomeNode:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health(self) -> dict[str, Any] | None:
        """The node's /health, asked on the home namespace's loopback (nothing else can reach it)."""
        with self.mesh.net.in_namespace(self.mesh.net.home):
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2, trust_env=False).json()
            except (httpx.HTTPError, ValueError):
                return None

    def relay_link(self) -> dict[str, Any] | None:
        health = self.health()
        return None if health is None else health.get("relay")

    def wait_ready(self, timeout: float = NODE_READY_S) -> None:
        def ready() -> bool:
            if not self.alive():
                raise AssertionError(f"{self.name} exited:\n{self.log_path.read_text(errors='replace')[-3000:]}")
            health = self.health()
            return health is not None and health.get("state") == "ready" and (health.get("relay") or {}).get("state") == "attached"

        wait_for(ready, f"{self.name} ready and attached", [self.log_path], timeout)

    def llama_pid(self) -> int | None:
        try:
            return int(json.loads((self.state_dir / PIDFILE_NAME).read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    def kill(self) -> None:
        """SIGKILL by PID; its llama-server follows (parent-death signal), and is reaped by pidfile besides."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(NODE_STOP_S)
        reap_stale_child(self.state_dir / PIDFILE_NAME)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(NODE_STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(NODE_STOP_S)
        reap_stale_child(self.state_dir / PIDFILE_NAME)

    def ledger(self) -> dict[str, dict[str, Any]]:
        return node_ledger(self.state_dir)


@dataclass
class HomeMesh:
    net: HomeNetwork
    workdir: Path
    tracker: ServiceProcess
    relay: ServiceProcess
    tracker_key: str
    model: str
    nodes: list[HomeNode] = field(default_factory=list)

    def logs(self) -> list[Path]:
        return [self.tracker.log_path, self.relay.log_path, *(n.log_path for n in self.nodes)]

    def add_node(self, gguf: Path, fake_llama: Path, env: dict[str, str], name: str | None = None) -> HomeNode:
        node = HomeNode(self, name or f"node{len(self.nodes)}", gguf, fake_llama, env).start()
        self.nodes.append(node)
        return node

    def routable_nodes(self, heard_since: float | None = None) -> int:
        """Nodes the tracker routes to now; with `heard_since` (a `time.monotonic()`), only those it heard from since."""
        try:
            entries = httpx.get(self.tracker.url + "/v1/nodes", timeout=2, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            return 0
        silent_at_most = None if heard_since is None else time.monotonic() - heard_since
        return sum(1 for e in entries if e["routable"] and (silent_at_most is None or e["last_seen_s_ago"] < silent_at_most))

    def wait_routable(self, count: int, timeout: float = NODE_READY_S, heard_since: float | None = None) -> None:
        wait_for(lambda: self.routable_nodes(heard_since) >= count, f"{count} node(s) routable", self.logs(), timeout)

    def usage(self) -> list[dict[str, Any]]:
        return httpx.get(self.tracker.url + "/v1/usage?limit=10000", timeout=10, trust_env=False).json()

    def stream(self, max_tokens: int, *, on_event: Callable[[int], None] | None = None, timeout: float = REQUEST_TIMEOUT_S,
               client: httpx.Client | None = None) -> StreamResult:  # fmt: skip
        """One streamed chat completion from the client's namespace, read to its end (or its break)."""
        body = {"model": self.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens, "stream": True}
        started = time.monotonic()
        chunks: list[bytes] = []
        result = StreamResult(status=0, body=b"", request_id=None)
        with self.net.in_client_namespace():
            own = client is None
            http = client or httpx.Client(timeout=httpx.Timeout(timeout, connect=10), trust_env=False)
            try:
                with http.stream("POST", self.tracker.url + "/v1/chat/completions", json=body) as response:
                    result.status = response.status_code
                    result.request_id = response.headers.get("x-meshnet-request-id")
                    events = 0
                    for chunk in response.iter_raw():
                        now = time.monotonic() - started
                        if result.first_byte_s is None:
                            result.first_byte_s = now
                        if result.first_token_s is None and b'"content"' in chunk:
                            result.first_token_s = now
                        chunks.append(chunk)
                        if on_event is not None:
                            new = chunk.count(b"\n\n")
                            for n in range(events + 1, events + new + 1):
                                on_event(n)
                            events += new
            except httpx.HTTPError as exc:
                result.transport_error = f"{type(exc).__name__}: {exc}"
            finally:
                if own:
                    http.close()
        result.body = b"".join(chunks)
        result.content, result.done, result.error_event = parse_events(result.body)
        result.elapsed_s = time.monotonic() - started
        return result

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self.relay.close()
        self.tracker.close()


@dataclass
class MeshOptions:
    nat_idle_timeout_s: int | None = None
    relay_ping_interval_s: float = 10.0


def start_home_mesh(workdir: Path, model: str, options: MeshOptions | None = None) -> Iterator[HomeMesh]:
    """A generator for a fixture: the network, the tracker and the relay up (no node yet); all gone after."""
    options = options or MeshOptions()
    net = HomeNetwork(workdir, nat_idle_timeout_s=options.nat_idle_timeout_s)
    try:
        tracker = tracker_process(workdir, host=net.host_ip, allow_private=True)
        relay: ServiceProcess | None = None
        try:
            tracker.start()
            relay = relay_process(workdir, tracker, host=net.host_ip, ping_interval_s=options.relay_ping_interval_s)
            relay.start()
            mesh = HomeMesh(net, workdir, tracker, relay, tracker_key(tracker), model)
            try:
                yield mesh
            finally:
                mesh.close()
        finally:
            if relay is not None:
                relay.close()
            tracker.close()
    finally:
        net.close()


def print_logs(mesh: HomeMesh) -> None:
    """pytest shows this only for a failed test: every process's log tail."""
    for log in mesh.logs():
        if log.exists():
            print(f"----- {log.parent.name}/{log.name}\n{log.read_text(errors='replace')[-4000:]}")
