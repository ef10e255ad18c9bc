"""`meshnet-gguf dev mesh`: tracker, relay and one node as child processes, stopped together.

The node dials out to the relay and registers with it as its only way in, so
every request takes the path a node behind NAT gets: client -> tracker ->
relay -> (TLS inside the tunnel) -> node. Each child runs in its own session,
so Ctrl-C reaches only this process, which then stops the node (drain), the
relay and the tracker in that order, by PID, and exits 0.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from meshnet_gguf.common.ports import free_local_port, local_port_taken
from meshnet_gguf.common.private_files import private_dir
from meshnet_gguf.contract.protocol import WELL_KNOWN_PATH
from meshnet_gguf.reference.tracker.ledger import TRACKER_LEDGER_FILE

# Tracker and relay start in about a second; the margin covers a loaded machine.
SERVICE_START_TIMEOUT_S = 30.0
# The node may download and convert the demo model first (a few hundred MB, once).
NODE_READY_TIMEOUT_S = 900.0
# Quick routing for a demo: a node is routable about a second after it is ready.
MESH_HEARTBEAT_S = 2.0
MESH_HEALTH_POLL_S = 1.0
NODE_DRAIN_GRACE_S = 5.0
# SIGTERM -> SIGKILL: the node drains (above) and stops llama-server; the others stop at once.
NODE_STOP_TIMEOUT_S = NODE_DRAIN_GRACE_S + 15.0
SERVICE_STOP_TIMEOUT_S = 5.0
POLL_S = 0.2
ENROLMENT_SECRET_BYTES = 24
LOG_TAIL_CHARS = 3000
# Each piece's state dir under the mesh's (`--state-dir`, by default `<node state dir>/mesh`).
MESH_TRACKER_DIR, MESH_RELAY_DIR, MESH_NODE_DIR = "tracker", "relay", "node"


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return ""

    def stop(self, timeout_s: float) -> None:
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _MeshFailed(Exception):
    pass


def _start(name: str, args: Sequence[str], logs: Path, env: dict[str, str]) -> _Child:
    log_path = logs / f"{name}.log"
    with log_path.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshnet_gguf", *args], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **env}, start_new_session=True,
        )  # fmt: skip
    return _Child(name, proc, log_path)


def _wait_for(check: Callable[[], object], what: str, timeout_s: float, children: Sequence[_Child], stop: threading.Event) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        for child in children:
            if not child.alive():
                raise _MeshFailed(f"the {child.name} exited ({child.proc.returncode}) while waiting for {what}:\n{child.log_tail()}")
        try:
            found = check()
        except httpx.HTTPError:
            found = None
        if found:
            return found
        time.sleep(POLL_S)
    if stop.is_set():
        return None
    raise _MeshFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=2.0, trust_env=False)


def snippet(base_url: str, model: str) -> str:
    return f'''from openai import OpenAI
client = OpenAI(base_url="{base_url}", api_key="unused")
stream = client.chat.completions.create(model="{model}", stream=True, max_tokens=32,
                                        messages=[{{"role": "user", "content": "Say hello"}}])
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()'''


def run_mesh(
    *,
    model_args: Sequence[str],
    tracker_port: int,
    relay_port: int,
    state_dir: Path,
    download_dir: Path | None,
    echo: Callable[[str], None],
    before_start: Callable[[], str | None] = lambda: None,
) -> int:
    """`before_start` readies what the node needs (a llama-server that runs here) once the ports are known
    to be free; it returns a problem to print, or None."""
    # A taken port is said before anything starts (and before a temporary folder exists).
    for service, port, flag in (("tracker", tracker_port, "--tracker-port"), ("relay", relay_port, "--relay-port")):
        if port and local_port_taken(port):
            echo(f"error: port {port} (the {service}'s) is already in use: pass {flag} 0 for any free port, or another port")
            return 2
    problem = before_start()
    if problem is not None:
        echo(f"error: {problem}")
        return 2
    # Kept after exit (a demo's usage is worth reading afterwards); the next run in the same dir goes on
    # with the same keys and ledgers.
    root = private_dir(Path(state_dir))  # its logs and ledgers: the operator's only
    tracker_port = tracker_port or free_local_port()
    relay_port = relay_port or free_local_port()
    node_port = free_local_port()
    tracker_url = f"http://127.0.0.1:{tracker_port}"
    relay_url = f"http://127.0.0.1:{relay_port}"

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda s, f: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    children: list[_Child] = []
    code = 0
    try:
        echo(f"state (keys, ledgers, logs) in {root}, kept after exit (--state-dir for another)")
        # The node enrols with a secret made for this mesh, handed over in the environment (not argv).
        secret = secrets.token_urlsafe(ENROLMENT_SECRET_BYTES)
        children.append(_start("tracker", [
            "dev", "tracker", "--port", str(tracker_port), "--state-dir", str(root / MESH_TRACKER_DIR),
            "--heartbeat-interval", str(MESH_HEARTBEAT_S), "--health-poll-interval", str(MESH_HEALTH_POLL_S),
        ], root, {"MESHNET_TRACKER_ENROLMENT_SECRET": secret}))  # fmt: skip
        _wait_for(lambda: _get(tracker_url + "/health").status_code == 200, "the tracker", SERVICE_START_TIMEOUT_S, children, stop)
        if stop.is_set():
            return 0
        tracker_key = _get(tracker_url + WELL_KNOWN_PATH).json()["public_key"]
        # The relay honours CONNECTs from this tracker only, and keeps tunnels only for nodes it admits.
        children.append(
            _start(
                "relay",
                ["dev", "relay", "--port", str(relay_port), "--trust-tracker-key", tracker_key, "--state-dir", str(root / MESH_RELAY_DIR)],
                root,
                {},
            )
        )
        _wait_for(lambda: _get(relay_url + "/health").status_code == 200, "the relay", SERVICE_START_TIMEOUT_S, children, stop)
        if stop.is_set():
            return 0
        node_args = [
            "serve", *model_args, "--port", str(node_port), "--state-dir", str(root / MESH_NODE_DIR),
            "--tracker", tracker_url, "--tracker-public-key", tracker_key, "--relay", relay_url,
            "--drain-grace", str(NODE_DRAIN_GRACE_S),
        ]  # fmt: skip
        if download_dir is not None:
            node_args += ["--download-dir", str(download_dir)]
        children.append(_start("node", node_args, root, {"MESHNET_ENROLMENT_SECRET": secret}))
        echo("waiting for the node (the first --demo run downloads and prepares the model)...")

        def served_model() -> str | None:
            data = _get(tracker_url + "/v1/models").json().get("data", [])
            return data[0]["id"] if data else None

        model = _wait_for(served_model, "the node to be routable", NODE_READY_TIMEOUT_S, children, stop)
        if stop.is_set():
            return 0
        base_url = f"{tracker_url}/v1"
        echo("")
        echo(f"mesh ready: tracker {tracker_url}, relay {relay_url}, node reachable only through the relay")
        echo(f"OpenAI base URL: {base_url}   model: {model}")
        echo(f"tracker page: {tracker_url}/   node page (this machine only): http://127.0.0.1:{node_port}/")
        echo("")
        echo(snippet(base_url, str(model)))
        echo("")
        echo("Ctrl-C stops the node, the relay and the tracker.")
        while not stop.is_set():
            for child in children:
                if not child.alive():
                    raise _MeshFailed(f"the {child.name} exited ({child.proc.returncode}):\n{child.log_tail()}")
            stop.wait(POLL_S)
    except _MeshFailed as exc:
        echo(f"error: {exc}")
        code = 1
    finally:
        # The node first, so it drains and deregisters while tracker and relay still listen.
        for child in reversed(children):
            child.stop(NODE_STOP_TIMEOUT_S if child.name == "node" else SERVICE_STOP_TIMEOUT_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    echo(f"mesh {'stopped' if code == 0 else 'failed'}; its state is kept in {root}:")
    for line in kept_state_lines(root):
        echo(f"  {line}")
    return code


def kept_state_lines(root: Path) -> list[str]:
    """Where a stopped mesh's usage and logs are, and the commands that read them."""
    return [
        f"the node's usage: meshnet-gguf usage --state-dir {root / MESH_NODE_DIR}",
        f"the tracker's ledger: {root / MESH_TRACKER_DIR / TRACKER_LEDGER_FILE} (GET /v1/usage while it runs)",
        f"logs: {root}/*.log",
    ]


__all__ = ["run_mesh", "snippet"]
