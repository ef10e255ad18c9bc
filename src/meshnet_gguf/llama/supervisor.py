"""The llama-server child's supervisor: one owner task for its life, its states and its restarts.

States: starting -> loading -> ready; a crash after ready -> restarting (with
exponential backoff) -> loading -> ready; too many quick crashes -> failed;
stop() -> draining/stopped. Only `run()` changes the child; everyone else reads
`state`, `upstream()` and the log ring, or asks for `stop()`. The child process itself
(spawn, stop, reap, socket folder) is `child`; the restart loop (spawn, pump, backoff, stop)
is `child_loop`, which this class extends with hooks; the generations before `ready` are `warmup`.
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
from typing import NoReturn, Protocol

import anyio

from meshnet_gguf.common.http1_client import unix_socket_url
from meshnet_gguf.common.logs import LLAMA_LOGGER, llama_log_level
from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.node_part import BasePart
from meshnet_gguf.contract.protocol import NodeCapability, NodeState
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
    write_pidfile,
)
from meshnet_gguf.llama.child_loop import ChildLoop, Outcome, OutcomeRace, RestartPolicy
from meshnet_gguf.llama.runnable import BUILD_FOR_THIS_MACHINE_FIX
from meshnet_gguf.llama.upstream import UpstreamError
from meshnet_gguf.llama.speed_probe import SpeedProbePolicy, measure_speed
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
# The run probe refuses such a build before launch; this explains a crash it could not foresee
# (a kernel the tiny model did not reach).
ILLEGAL_INSTRUCTION_HINT = (
    "this llama-server build uses CPU instructions this processor lacks (it was compiled for a newer CPU). "
    f"Fix: {BUILD_FOR_THIS_MACHINE_FIX}; offloading every layer to a GPU also avoids the CPU kernels"
)
_ERROR_MARKERS = ("error", "failed", "fatal", "abort", "exception", "what():", "cannot", "unable")


@dataclass(frozen=True)
class SupervisorPolicy:
    # No defaults here: the node's settings (`common/settings.NodeSettings`) hold them, with their reasons.
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
    # The node's measurement of itself after the warm-up (None: it announces no speed figures).
    speed_probe: SpeedProbePolicy | None = None
    # The progress watchdog: llama-server's /slots shows each busy slot's prompt tokens processed
    # and tokens decoded; busy slots whose numbers stay still this long mean a batch that never
    # ends (a pool worker stopped, or its link cut, while /health still says 200). None: off.
    busy_stall_timeout_s: float | None = None

    @classmethod
    def from_settings(
        cls, settings: NodeSettings, warmup: WarmupPolicy | None, speed_probe: SpeedProbePolicy | None = None
    ) -> SupervisorPolicy:
        return cls(
            load_stall_timeout_s=settings.load_stall_timeout_s,
            health_poll_interval_s=settings.health_poll_interval_s,
            restart_backoff_initial_s=settings.restart_backoff_initial_s,
            restart_backoff_max_s=settings.restart_backoff_max_s,
            restart_stable_after_s=settings.restart_stable_after_s,
            max_quick_crashes=settings.max_quick_crashes,
            stop_timeout_s=settings.stop_timeout_s,
            warmup=warmup,
            speed_probe=speed_probe,
            # A single box has no worker to lose; with a pool, a stopped worker stalls generation silently.
            busy_stall_timeout_s=settings.busy_stall_timeout_s if settings.pool_workers else None,
        )

    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(
            backoff_initial_s=self.restart_backoff_initial_s,
            backoff_max_s=self.restart_backoff_max_s,
            stable_after_s=self.restart_stable_after_s,
            stop_timeout_s=self.stop_timeout_s,
            max_quick_crashes=self.max_quick_crashes,
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


class Supervisor(ChildLoop, BasePart):
    """A node part: `run()` owns the child (the `ChildLoop`); `close()` stops it (SIGTERM to its group, then SIGKILL)."""

    name = "llama-server"
    logger = log
    output_read_size = OUTPUT_READ_SIZE

    def __init__(
        self,
        spec: ChildSpec,
        policy: SupervisorPolicy,
        *,
        state_dir: Path | None = None,
        listeners: Sequence[ChildListener] = (),
        pool: PoolGate | None = None,
    ) -> None:
        super().__init__(policy.restart_policy())
        self.spec = spec
        self.pool = pool
        self.policy = policy
        self.state: NodeState = "starting"
        self.detail: str | None = None
        self.port: int | None = None
        self.socket_path: Path | None = socket_path_for(spec.binary, state_dir) if state_dir is not None else None
        self._socket_folder_checked = False
        self.warmup_s: float | None = None
        # What the running llama-server measured of itself before it served; a new child measures anew.
        self.capability: NodeCapability | None = None
        self.api_key = secrets.token_urlsafe(32)
        self.log_ring: deque[str] = deque(maxlen=LOG_RING_LINES)
        self._listeners = tuple(listeners)
        self._pidfile = state_dir / PIDFILE_NAME if state_dir else None
        self._ever_ready = False
        self._pool_unloaded: str | None = None
        self._http = RawUpstream(max_connections=1)

    # --- what others may read -------------------------------------------
    @property
    def base_url(self) -> str | None:
        if self.socket_path is not None:
            return unix_socket_url(str(self.socket_path)) if self._proc is not None else None
        return f"http://127.0.0.1:{self.port}" if self.port else None

    @property
    def listen_address(self) -> str:
        return str(self.socket_path) if self.socket_path is not None else f"127.0.0.1:{self.port}"

    @property
    def ready_since(self) -> float | None:
        """When the running llama-server became ready (monotonic); None while it is not."""
        return self.up_since

    def is_ready(self) -> bool:
        return self.state == "ready"

    def tail(self, lines: int = FAILURE_TAIL_LINES) -> list[str]:
        return list(self.log_ring)[-lines:]

    # --- the loop's hooks: one child's life ------------------------------------------
    async def before_loop(self) -> None:
        self._http = RawUpstream(max_connections=1)  # one per run(): after_run closes it
        await reap_stale_child_in_thread(self._pidfile, self.policy.stop_timeout_s)

    async def before_spawn(self) -> bool:
        return self.pool is None or await self._wait_for_pool()

    def command(self) -> tuple[list[str], dict[str, str]]:
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
        return argv, env

    def spawned(self, proc: asyncio.subprocess.Process) -> None:
        self._write_pidfile(proc.pid)
        self.capability = None
        self._set_state("loading", "loading model")

    async def watch(self, proc: asyncio.subprocess.Process) -> Outcome:
        """Load, warm up, serve: until the child ends, or should, or we are told to stop."""
        outcome = await self._wait_ready(proc)
        if outcome is Outcome.READY and self.pool is not None:
            outcome = self._check_pool_loaded()
        if outcome is Outcome.READY and self.policy.warmup is not None:
            outcome = await self._warm_up(proc, self.policy.warmup)
        if outcome is Outcome.READY and self.policy.speed_probe is not None:
            # Before ready, so never while serving: nothing but this measurement runs in llama-server.
            self.detail = "measuring its speed"
            assert self.base_url is not None
            outcome, self.capability = await measure_speed(
                proc, self._http, self.base_url, self.api_key, self._stop_requested, self.policy.speed_probe
            )
        if outcome is Outcome.READY:
            self._ever_ready = True
            self.up_since = time.monotonic()
            self._set_state("ready")
            log.info("llama-server ready on %s (pid %s)", self.listen_address, proc.pid)
            outcome = await self._serve(proc)
        if self._stop_requested.is_set():
            self._set_state("draining", "stopping llama-server")
        return outcome

    def stop_timeout_s(self, outcome: Outcome) -> float:
        # A lost worker took llama-server's state with it; a graceful stop would only let the
        # streams in flight hang on it: end it now, so they end with an error at once.
        return POOL_LOST_STOP_TIMEOUT_S if outcome is Outcome.POOL else self.policy.stop_timeout_s

    def child_ended(self) -> None:
        self._remove_pidfile()

    async def restart_at_once(self, outcome: Outcome, reason: str) -> bool:
        away = await self.pool.recheck() if self.pool is not None else None
        if away is None and outcome is not Outcome.POOL:
            return False
        # A worker went away: no crash of llama-server's to count; it is launched again,
        # without backoff, as soon as the pool is whole (the top of the loop waits for it).
        log.warning("llama-server %s: the pool is not whole (%s)", reason, away or "a worker was away")
        return True

    def fatal(self, outcome: Outcome) -> bool:
        # A worker skipped at load (it came back a moment late) is worth the usual restarts, even before ready.
        return not self._ever_ready and outcome is not Outcome.POOL_UNLOADED

    def fail(self, detail: str) -> NoReturn:
        self._set_state("failed", detail)
        raise ChildFailed(self._failure_message(detail))

    def restarting(self, reason: str, up_for_s: float) -> None:
        backoff = self.backoff.delay_s
        self._set_state("restarting", f"{reason}; restarting in {backoff:.0f} s")
        log.warning("llama-server %s; restart %d in %.1f s", reason, self.restarts + 1, backoff)

    async def after_run(self) -> None:
        await self._http.aclose()
        self._remove_pidfile()
        if self._socket_folder_checked:  # never unlink in a folder that failed the ownership check
            remove_socket(self.socket_path)  # the child has exited
        if self.state != "failed":
            self._set_state("stopped")

    def child_line(self, line: str) -> None:
        self.log_ring.append(line)
        child_log.log(llama_log_level(line), "%s", line)
        for listener in self._listeners:
            listener.child_line(line)

    async def _probe_health(self) -> bool:
        """One GET /health; True on 200. Never raises for a child that is not (yet) answering."""
        with anyio.move_on_after(HEALTH_REQUEST_TIMEOUT_S):
            try:
                response = await self._http.send("GET", f"{self.base_url}/health", {}, None)
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

    def _check_pool_loaded(self) -> Outcome:
        """Ready only with model buffers on every worker: llama-server skips an unreachable one silently."""
        assert self.pool is not None
        self._pool_unloaded = self.pool.unloaded()
        if self._pool_unloaded is not None:
            log.warning("%s", self._pool_unloaded)
            return Outcome.POOL_UNLOADED
        return Outcome.READY

    async def _warm_up(self, proc: asyncio.subprocess.Process, policy: WarmupPolicy) -> Outcome:
        self.detail = "warming up"
        started = time.monotonic()
        assert self.base_url is not None
        outcome = await warm_up(proc, self._http, self.base_url, self.api_key, self._stop_requested, policy)
        self.warmup_s = time.monotonic() - started
        if outcome is Outcome.READY:
            log.info("llama-server warmed up in %.2f s", self.warmup_s)
        return outcome

    async def _wait_ready(self, proc: asyncio.subprocess.Process) -> Outcome:
        while True:
            if self._stop_requested.is_set():
                return Outcome.STOPPING
            if proc.returncode is not None:
                return Outcome.EXITED
            if self.pool is not None and self.pool.missing() is not None:
                return Outcome.POOL
            silent_for = time.monotonic() - self.last_output
            if silent_for > self.policy.load_stall_timeout_s:
                return Outcome.STALLED
            if await self._probe_health():
                return Outcome.READY
            with anyio.move_on_after(self.policy.health_poll_interval_s):
                await self._stop_requested.wait()

    async def _serve(self, proc: asyncio.subprocess.Process) -> Outcome:
        """After ready: wait until the child exits, stops answering /health, makes no progress,
        loses a pool worker, or we are told to stop."""
        async with anyio.create_task_group() as tg:
            race = OutcomeRace(tg, Outcome.STOPPING)

            async def liveness() -> None:
                failures = 0
                while True:
                    await anyio.sleep(self.policy.liveness_interval_s)
                    ok = await self._probe_health()
                    failures = 0 if ok else failures + 1
                    if failures >= self.policy.liveness_failures:
                        race.end(Outcome.UNRESPONSIVE)
                        return

            async def progress() -> None:
                bound = self.policy.busy_stall_timeout_s
                assert bound is not None
                last: object = None
                still_since = time.monotonic()
                while True:
                    await anyio.sleep(self.policy.liveness_interval_s)
                    with anyio.move_on_after(bound):
                        seen = await self._slot_progress()
                    if seen is None or seen != last:
                        # Idle, or something moved: the stall clock starts again.
                        last, still_since = seen, time.monotonic()
                    elif time.monotonic() - still_since >= bound:
                        race.end(Outcome.STUCK)
                        return

            race.end_when(proc.wait, Outcome.EXITED)
            tg.start_soon(liveness)
            if self.pool is not None:
                race.end_when(self.pool.wait_broken, Outcome.POOL)
            # A stop leaves the outcome as it is: STOPPING unless a watcher named another first.
            race.end_when(self._stop_requested.wait, None)
            if self.policy.busy_stall_timeout_s is not None:
                tg.start_soon(progress)
        return race.outcome

    async def _slot_progress(self) -> object:
        """What the busy slots have done so far (per slot: its task, prompt tokens processed, tokens
        decoded), from GET /slots; None when no slot is busy or the answer cannot be read. A stopped
        pool worker freezes these numbers while /health still answers 200."""
        try:
            response = await self._http.send("GET", f"{self.base_url}/slots", {"authorization": f"Bearer {self.api_key}"}, None)
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

    # --- bookkeeping -----------------------------------------------------------
    def _set_state(self, state: NodeState, detail: str | None = None) -> None:
        changed = state != self.state
        self.state, self.detail = state, detail
        if changed:
            for listener in self._listeners:
                listener.child_state(state, detail, self.pid)

    def describe_end(self, outcome: Outcome, proc: asyncio.subprocess.Process) -> str:
        if outcome is Outcome.STALLED:
            return f"llama-server printed nothing for {self.policy.load_stall_timeout_s:.0f} s while loading"
        if outcome is Outcome.STUCK:
            return (
                f"llama-server made no progress for {self.policy.busy_stall_timeout_s:.0f} s "
                "with requests in flight (a pool worker stopped, or its link is down?)"
            )
        if outcome is Outcome.POOL:
            return f"llama-server ended: the pool is not whole ({self.pool.missing() if self.pool else ''})"
        if outcome is Outcome.POOL_UNLOADED:
            return self._pool_unloaded or "llama-server did not load onto every pool worker"
        if outcome is Outcome.UNRESPONSIVE:
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
