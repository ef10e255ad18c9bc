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
import stat
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import anyio
import psutil

from meshnet_gguf.common.logs import LLAMA_LOGGER, llama_log_level
from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.common.settings import LLAMA_STOP_TIMEOUT_S, NodeSettings
from meshnet_gguf.contract.node_part import BasePart
from meshnet_gguf.contract.protocol import NodeState
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.upstream import RawUpstream, UpstreamError, unix_socket_url

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
# llama-server listens on a UNIX socket in this private folder of the state dir, so only
# this user can reach it (a loopback port can be raced for, and reached, by any local user).
SOCKET_DIR_NAME = "run"
SOCKET_NAME = "llama-server.sock"
SOCKET_DIR_MODE = 0o700
# sun_path holds 108 bytes with its terminating NUL; a longer path falls back to loopback TCP.
MAX_SOCKET_PATH_BYTES = 107
# A build that can listen on a UNIX socket says so in its --host help line.
_UNIX_SOCKET_HELP_MARK = "unix socket"
# The warm-up's prompt is this word repeated: about one token per word with a subword
# vocabulary (a byte-level toy vocabulary makes it a few tokens per word).
WARMUP_WORD = " the"
# Marks the warm-up's requests, so llama-server's log (and a test's fake) can tell them from clients'.
WARMUP_HEADER = "x-meshnet-warmup"
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


@dataclass(frozen=True)
class WarmupPolicy:
    """Generations run after load and before `ready`, so the first real request does not pay
    for first-use work: GPU kernels built per shape on first use, the chat template's first
    rendering, model pages read in from the mmap. One streamed chat completion per prompt
    length, each `max_tokens` long."""

    prompt_words: tuple[int, ...] = (16,)
    max_tokens: int = 4
    timeout_s: float = 180.0


# On a GPU each prompt size picks other kernels (vector kernels for a few tokens; small,
# medium and large matrix tiles above, each aligned or not): one prompt per size class.
# Measured on an H200 (Vulkan): ~10 s the first time on a machine, while the driver builds
# its pipelines; ~0.2 s once its on-disk pipeline cache holds them. Largest first: the slot
# keeps the last prompt, and llama-server copies a slot's old prompt out to its RAM cache
# before reusing the slot, so a large last prompt cost the first user request ~40 ms.
GPU_WARMUP = WarmupPolicy(prompt_words=(600, 150, 40, 12, 2), max_tokens=8)
CPU_WARMUP = WarmupPolicy()


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
    warmup: WarmupPolicy | None = CPU_WARMUP

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
        )


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
        self.socket_path: Path | None = _socket_path(spec.binary, state_dir) if state_dir is not None else None
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
            if self.state != "failed":
                self._set_state("stopped")
            self._stopped.set()

    async def _run(self) -> None:
        reap_stale_child(self._pidfile, self.policy.stop_timeout_s)
        backoff = self.policy.restart_backoff_initial_s
        quick_crashes = 0
        ever_ready = False
        http = RawUpstream(max_connections=1)
        try:
            while not self._stop_requested.is_set():
                proc = await self._spawn()
                async with anyio.create_task_group() as readers:
                    readers.start_soon(self._pump_output, proc)
                    outcome = await self._wait_ready(proc, http)
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
        finally:
            await http.aclose()

    # --- one child's life -------------------------------------------------
    async def _spawn(self) -> asyncio.subprocess.Process:
        if self.socket_path is not None:
            _prepare_socket_dir(self.socket_path)
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

    async def _warm_up(self, proc: asyncio.subprocess.Process, http: RawUpstream, policy: WarmupPolicy) -> str:
        """Run the warm-up generations; "ready" when done (or when they cannot run), else why not."""
        self.detail = "warming up"
        started = time.monotonic()
        outcome = "ready"
        async with anyio.create_task_group() as tg:
            # Whichever ends first ends the warm-up: the child exiting, a stop, or the generations.

            async def exited() -> None:
                nonlocal outcome
                await proc.wait()
                outcome = "exited"
                tg.cancel_scope.cancel()

            async def stop() -> None:
                nonlocal outcome
                await self._stop_requested.wait()
                outcome = "stopping"
                tg.cancel_scope.cancel()

            async def generate() -> None:
                with anyio.move_on_after(policy.timeout_s) as deadline:
                    for words in policy.prompt_words:
                        await self._warmup_request(http, words, policy.max_tokens)
                if deadline.cancelled_caught:
                    log.warning("llama-server warm-up took over %.0f s; reporting ready without it", policy.timeout_s)
                tg.cancel_scope.cancel()

            tg.start_soon(exited)
            tg.start_soon(stop)
            tg.start_soon(generate)
        self.warmup_s = time.monotonic() - started
        if outcome == "ready":
            log.info("llama-server warmed up in %.2f s", self.warmup_s)
        return outcome

    async def _warmup_request(self, http: RawUpstream, words: int, max_tokens: int) -> None:
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": WARMUP_WORD * words}],
                "max_tokens": max_tokens,
                "stream": True,
                "temperature": 0,
                # The warm-up must not leave its prompt behind as a cache hit for a real request.
                "cache_prompt": False,
            }
        ).encode()
        headers = {"authorization": f"Bearer {self.api_key}", "content-type": "application/json", WARMUP_HEADER: "1"}
        try:
            response = await http.send("POST", f"{self.base_url}/v1/chat/completions", headers, body)
            try:
                answer = await response.read()
            finally:
                await response.aclose()
        except UpstreamError as exc:
            log.info("llama-server warm-up request failed (%s); going on", exc)
            return
        if response.status != 200:
            # An embedding-only model, say: nothing to warm through this route.
            log.info("llama-server warm-up answered %s (%s); going on", response.status, answer[:200])

    async def _wait_ready(self, proc: asyncio.subprocess.Process, http: RawUpstream) -> str:
        while True:
            if self._stop_requested.is_set():
                return "stopping"
            if proc.returncode is not None:
                return "exited"
            silent_for = time.monotonic() - self._last_activity
            if silent_for > self.policy.load_stall_timeout_s:
                return "stalled"
            if await self._probe_health(http):
                return "ready"
            with anyio.move_on_after(self.policy.health_poll_interval_s):
                await self._stop_requested.wait()

    async def _watch(self, proc: asyncio.subprocess.Process, http: RawUpstream) -> str:
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
                    ok = await self._probe_health(http)
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


def supports_unix_socket(binary: BinaryInfo) -> bool:
    """Whether this llama-server build can listen on a UNIX socket (`--host PATH.sock`)."""
    return _UNIX_SOCKET_HELP_MARK in binary.help_text.lower()


def _socket_path(binary: BinaryInfo, state_dir: Path | None) -> Path | None:
    """Where llama-server should listen, or None for loopback TCP (no state dir, an older
    build, or a path too long for a socket address)."""
    if state_dir is None or not supports_unix_socket(binary):
        return None
    path = Path(state_dir).absolute() / SOCKET_DIR_NAME / SOCKET_NAME
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        log.info("state dir path too long for a UNIX socket; llama-server listens on loopback TCP")
        return None
    return path


def _prepare_socket_dir(socket_path: Path) -> None:
    """Make the socket's folder ours alone, and remove a socket a killed run left behind
    (llama-server cannot bind over it). Refuses a folder someone else could have planted."""
    folder = socket_path.parent
    folder.mkdir(mode=SOCKET_DIR_MODE, parents=True, exist_ok=True)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ChildFailed(f"{folder} is not a folder owned by this user; refusing to put llama-server's socket there")
    if info.st_mode & 0o077:
        os.chmod(folder, SOCKET_DIR_MODE)
    socket_path.unlink(missing_ok=True)


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
