"""Tracker, relay and node as child processes for the relay's end-to-end tests (stopped by PID only)."""

from __future__ import annotations

import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.contract.protocol import WELL_KNOWN_PATH
from meshnet_gguf.mesh.ledger import LEDGER_FILE, RowState

WAIT_S = 30.0
HEARTBEAT_S = 1.0
HEALTH_POLL_S = 0.5


def wait_for(condition: Callable[[], object], what: str, logs: Sequence[Path] = (), timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    tails = "\n".join(f"----- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


class ServiceProcess:
    """`python -m meshnet_gguf <args>` in its own session, with its log in `workdir`."""

    def __init__(self, name: str, args: Sequence[str], workdir: Path, *, port: int, host: str = "127.0.0.1",
                 prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.name, self.args, self.workdir, self.port, self.host, self.prefix = name, list(args), workdir, port, host, list(prefix)
        self.env = {**os.environ, **(env or {})}
        self.url = f"http://{host}:{port}"
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServiceProcess:
        argv = [*self.prefix, sys.executable, "-m", "meshnet_gguf", *self.args]
        self.proc = subprocess.Popen(argv, stdout=self.log_path.open("ab"), stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        wait_for(self._up, f"{self.name} on {self.url}", [self.log_path])
        return self

    def _up(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
        return httpx.get(self.url + "/health", timeout=1, trust_env=False).status_code == 200

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def tracker_process(workdir: Path, host: str = "127.0.0.1", *, allow_private: bool = False) -> ServiceProcess:
    """The reference tracker; nodes enrol with `node_env(tracker)`."""
    port = free_local_port()
    secret = secrets.token_urlsafe(16)
    return ServiceProcess("tracker", [
        "dev", "tracker", "--host", host, "--port", str(port), "--state-dir", str(workdir / "tracker"),
        "--heartbeat-interval", str(HEARTBEAT_S), "--health-poll-interval", str(HEALTH_POLL_S),
        *(["--allow-private"] if allow_private else []),
    ], workdir, port=port, host=host, env={"MESHNET_TRACKER_ENROLMENT_SECRET": secret})  # fmt: skip


def node_env(tracker: ServiceProcess) -> dict[str, str]:
    """What a node needs to enrol at `tracker` (in the environment: argv is visible to other users)."""
    return {"MESHNET_ENROLMENT_SECRET": tracker.env["MESHNET_TRACKER_ENROLMENT_SECRET"]}


def relay_process(
    workdir: Path,
    tracker: ServiceProcess,
    host: str = "127.0.0.1",
    port: int | None = None,
    name: str = "relay",
    ping_interval_s: float = 2.0,
) -> ServiceProcess:
    """The reference relay, trusting `tracker` (already started) and no one else; `name` its log and state dir."""
    port = port or free_local_port()
    return ServiceProcess(name, [
        "dev", "relay", "--host", host, "--port", str(port), "--ping-interval", str(ping_interval_s),
        "--trust-tracker-key", tracker_key(tracker),
        "--state-dir", str(workdir / name),
    ], workdir, port=port, host=host)  # fmt: skip


def tracker_key(tracker: ServiceProcess) -> str:
    return httpx.get(tracker.url + WELL_KNOWN_PATH, trust_env=False).json()["public_key"]


def models(tracker: ServiceProcess) -> list[str]:
    return [m["id"] for m in httpx.get(tracker.url + "/v1/models", timeout=2, trust_env=False).json()["data"]]


def tracker_usage(tracker: ServiceProcess) -> list[dict[str, Any]]:
    return httpx.get(tracker.url + "/v1/usage?limit=10000", trust_env=False).json()


def node_ledger(state_dir: Path) -> dict[str, dict[str, Any]]:
    """request id -> {reported, settled, prompt, completion}, read without taking part in the node's writes.

    A row is opened before its request is forwarded and settled when the request ends."""
    if not (state_dir / LEDGER_FILE).exists():
        return {}
    return {
        row["request_id"]: {
            "reported": row["reported_at"] is not None, "settled": row["state"] == RowState.SETTLED,
            "prompt": row["prompt"], "completion": row["completion"], "rejected": row["rejected"],
        }
        for row in ledger_rows(state_dir)
    }  # fmt: skip


# What `ledger_rows` reads of each usage row: name -> SQL expression.
LEDGER_COLUMNS = {
    "request_id": "request_id", "state": "state", "prompt": "prompt_tokens", "completion": "completion_tokens",
    "finish_reason": "finish_reason", "has_receipt": "receipt != ''", "has_body": "prompt_body IS NOT NULL",
    "reported_at": "reported_at", "rejected": "rejected",
}  # fmt: skip


def billed_rows(ledger: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`node_ledger`'s rows less those the tracker refused as never routed: a tracker killed before its forwarded row
    was synced delivered nothing of that request and bills it to nobody (protocol §6, rule 5). Any other refusal
    fails here."""
    refused = {rid: r["rejected"] for rid, r in ledger.items() if r["rejected"]}
    assert all("unknown_request" in reason or "never routed" in reason for reason in refused.values()), refused
    return {rid: r for rid, r in ledger.items() if rid not in refused}


def ledger_rows(state_dir: Path) -> list[dict[str, Any]]:
    """The node's usage rows as {name in LEDGER_COLUMNS: value}, read without taking part in the node's writes."""
    db = sqlite3.connect(f"file:{state_dir / LEDGER_FILE}?mode=ro", uri=True)
    try:
        rows = db.execute(f"SELECT {', '.join(LEDGER_COLUMNS.values())} FROM usage").fetchall()
    finally:
        db.close()
    return [dict(zip(LEDGER_COLUMNS, row)) for row in rows]


def process_memory_contains(pid: int, needle: bytes) -> bool:
    """Scan every readable mapping of a (child) process for `needle`: a memory dump without the file."""
    found = False
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            addresses, perms = line.split()[:2]
            if not perms.startswith("r"):
                continue
            start, end = (int(x, 16) for x in addresses.split("-"))
            try:
                mem.seek(start)
                chunk = mem.read(end - start)
            except (OSError, OverflowError, ValueError):
                continue
            if needle in chunk:
                found = True
                break
    return found
