"""The node's watch over its LAN pool: each worker's status endpoint read on a fixed interval, and
the supervisor told when the pool is no longer whole (hold: end llama-server, serve nothing) and
when it is whole again (launch llama-server at once).

llama-server alone handles a lost worker badly: it aborts mid-request, or (idle) keeps answering
/health 200 until the next request kills it, and a worker unreachable at launch is skipped
silently, so the model lands on the others. The monitor is the node's own word on the pool; the
supervisor asks it before every launch and after every exit, and reads llama-server's log at
ready to see model buffers on every worker.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from meshnet_gguf.contract.node_part import BasePart
from meshnet_gguf.contract.protocol import HealthReport, NodeState, PoolHealth, PoolWorkerHealth, PoolWorkerState
from meshnet_gguf.llama.rpc_worker import protocol_major

log = logging.getLogger(__name__)

# Reads a worker's status endpoint (its URL); raises on any failure to get a JSON answer.
StatusReader = Callable[[str], Awaitable[dict[str, Any]]]
# What a worker may say its RPC protocol is (ggml's MAJOR.MINOR.PATCH): anything else is not copied into /health.
RPC_PROTOCOL_PATTERN = re.compile(r"[0-9]{1,4}(\.[0-9]{1,4}){0,2}")
# A worker's state as its status says it ("running", "restarting", ...): words only, short, or it is not repeated.
WORKER_STATE_PATTERN = re.compile(r"[a-z][a-z _-]{0,31}")


@dataclass(frozen=True)
class WatchedWorker:
    name: str  # what /health shows: "worker 1", never the address
    endpoint: str  # HOST:PORT as llama-server's --rpc names it; logs and the buffer check only
    status_url: str
    assigned_bytes: int
    protocol: str | None  # what the check before launch saw: a worker back on another major is still away


@dataclass
class _Seen:
    state: PoolWorkerState = "up"  # the check before launch found it serving
    protocol: str | None = None
    last_ok: float | None = None
    problem: str | None = None


def model_buffer_line(endpoint: str) -> re.Pattern[str]:
    """llama-server's load line for weights on one RPC server: devices are numbered per server, so
    the line is read by endpoint (`RPC0[127.0.0.1:50052] model buffer size = ...`)."""
    return re.compile(rf"RPC\d+\[{re.escape(endpoint)}\] model buffer size")


class PoolMonitor(BasePart):
    """A node part: polls every worker each `interval_s`; `missing()` says why the pool is not whole."""

    name = "pool monitor"

    def __init__(
        self,
        workers: Sequence[WatchedWorker],
        read_status: StatusReader,
        *,
        interval_s: float,
        timeout_s: float,
        total_bytes: int = 0,
        plan: str | None = None,
        close_reader: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.workers = tuple(workers)
        self._read = read_status
        self._close_reader = close_reader
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.total_bytes = total_bytes
        self.plan = plan
        now = time.monotonic()
        self._seen = {w.name: _Seen(protocol=w.protocol, last_ok=now) for w in self.workers}
        self._changed = anyio.Event()
        self._buffer_lines = [(w, model_buffer_line(w.endpoint)) for w in self.workers]
        self._loaded: set[str] = set()

    # --- what the supervisor asks --------------------------------------------
    def missing(self) -> str | None:
        """Why the pool is not whole (the workers away and why), or None when every worker is up."""
        away = [f"{w.name} is away ({self._seen[w.name].problem})" for w in self.workers if self._seen[w.name].state == "away"]
        return "; ".join(away) or None

    async def recheck(self) -> str | None:
        """Poll every worker now (not at the next tick) and answer `missing()`."""
        await self._poll_all()
        return self.missing()

    async def wait_whole(self) -> None:
        while self.missing() is not None:
            await self._changed.wait()

    async def wait_broken(self) -> None:
        while self.missing() is None:
            await self._changed.wait()

    def unloaded(self) -> str | None:
        """Which workers this llama-server's log showed no model buffer on (a worker skipped at load), or None."""
        absent = [w.name for w in self.workers if w.name not in self._loaded]
        return f"llama-server put no model buffer on {', '.join(absent)}" if absent else None

    # --- a listener of the supervisor: llama-server's load lines ----------------------
    def child_line(self, line: str) -> None:
        for worker, pattern in self._buffer_lines:
            if pattern.search(line):
                self._loaded.add(worker.name)

    def child_state(self, state: NodeState, detail: str | None, pid: int | None) -> None:
        if state == "loading":  # a new llama-server: what the last one loaded says nothing
            self._loaded.clear()

    # --- the part ----------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await anyio.sleep(self.interval_s)
            await self._poll_all()

    async def close(self) -> None:
        if self._close_reader is not None:
            await self._close_reader()

    def health(self, report: HealthReport) -> HealthReport:
        now = time.monotonic()
        workers = [
            PoolWorkerHealth(
                name=w.name,
                state=seen.state,
                protocol=seen.protocol,
                assigned_bytes=w.assigned_bytes,
                last_heartbeat_s=None if seen.last_ok is None else round(now - seen.last_ok, 1),
                problem=seen.problem,
            )  # fmt: skip
            for w in self.workers
            for seen in (self._seen[w.name],)
        ]
        pool = PoolHealth(workers=workers, total_bytes=self.total_bytes, plan=self.plan)
        return report.model_copy(update={"pool": pool})

    # --- polling -------------------------------------------------------------------
    async def _poll_all(self) -> None:
        before = self.missing()
        async with anyio.create_task_group() as tg:
            for worker in self.workers:
                tg.start_soon(self._poll, worker)
        after = self.missing()
        if (before is None) != (after is None):
            if after is None:
                log.info("pool whole again: every worker is up")
            else:
                log.warning("pool not whole: %s", after)
            changed, self._changed = self._changed, anyio.Event()
            changed.set()

    async def _poll(self, worker: WatchedWorker) -> None:
        seen = self._seen[worker.name]
        problem: str | None = None
        try:
            with anyio.fail_after(self.timeout_s):
                status = await self._read(worker.status_url)
        except Exception as exc:  # noqa: BLE001 - any failure to read it means the same: away
            problem = f"status unreachable: {type(exc).__name__}"
        else:
            problem = _status_problem(worker, status)
            if problem is None:
                seen.protocol = status["protocol"]
        if problem is None:
            if seen.state != "up":
                log.info("pool %s (%s) is back", worker.name, worker.endpoint)
            seen.state, seen.problem, seen.last_ok = "up", None, time.monotonic()
        else:
            if seen.state != "away":
                log.warning("pool %s (%s) is away: %s", worker.name, worker.endpoint, problem)
            seen.state, seen.problem = "away", problem


def _status_problem(worker: WatchedWorker, status: object) -> str | None:
    """Why `status` (a worker's status answer) says it is not serving the pool's protocol; None when it is."""
    if not isinstance(status, dict):
        return "status unreadable: not a JSON object"
    protocol, state = status.get("protocol"), status.get("state")
    if state != "running" or protocol is None:
        said = state if isinstance(state, str) and WORKER_STATE_PATTERN.fullmatch(state) else "not serving"
        return f"ggml-rpc-server {said}"
    if not isinstance(protocol, str) or not RPC_PROTOCOL_PATTERN.fullmatch(protocol):
        return "status unreadable: no RPC protocol version in it"
    if worker.protocol is not None and protocol_major(protocol) != protocol_major(worker.protocol):
        return f"speaks RPC protocol {protocol}, the pool {worker.protocol}"
    return None


def http_status_reader(token: Callable[[], str], client_timeout_s: float) -> tuple[StatusReader, Callable[[], Awaitable[None]]]:
    """Reads status endpoints with a fresh token from the node's key each time; and the close for its client."""
    import httpx

    client = httpx.AsyncClient(timeout=client_timeout_s, trust_env=False)

    async def read(url: str) -> dict[str, Any]:
        answer = await client.get(url, headers={"authorization": f"Bearer {token()}"})
        answer.raise_for_status()
        body = answer.json()
        if not isinstance(body, dict):
            raise ValueError("status is not a JSON object")
        return body

    return read, client.aclose
