"""One supervised child's restart loop: spawn, pump its output, watch it, end it, back off, again.

`ChildLoop.run()` owns the loop; a subclass supplies what varies through hooks (what to
spawn, what to do with each line, how to watch a running child, what an end means), as
uvicorn's `BaseReload` owns the reload loop and `StatReload` supplies one method. The
llama-server `supervisor` and the pool's `rpc_worker` are the two subclasses.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import anyio
from anyio.abc import TaskGroup

from meshnet_gguf.llama.child import ChildFailed, signal_group, spawn, terminate

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    """How one stage of a child's life ended: loading, warming up, or serving."""

    READY = "ready"  # loaded (and warmed up): not an end, the child goes on to serve
    STOPPING = "stopping"  # a stop was asked for
    EXITED = "exited"  # the process exited (its return code says how)
    POOL = "pool"  # a pool worker went away: llama-server cannot go on without it
    POOL_UNLOADED = "pool-unloaded"  # loaded, but with no model buffer on some pool worker (skipped at load)
    STALLED = "stalled"  # printed nothing for the load stall bound while loading
    UNRESPONSIVE = "unresponsive"  # after ready, /health failed too many times in a row
    STUCK = "stuck"  # requests in flight made no progress for the busy stall bound


class OutcomeRace:
    """Watchers of a child run side by side in a task group; the first to name an outcome ends them
    all. `outcome` holds `default` until a watcher ends the race."""

    def __init__(self, tg: TaskGroup, default: Outcome) -> None:
        self._tg = tg
        self.outcome = default

    def end(self, outcome: Outcome | None = None) -> None:
        """Stop every watcher; `outcome` replaces the current one unless None."""
        if outcome is not None:
            self.outcome = outcome
        self._tg.cancel_scope.cancel()

    def end_when(self, wait: Callable[[], Awaitable[object]], outcome: Outcome | None) -> None:
        """Start a watcher that ends the race once `wait()` returns, with `outcome` unless None."""

        async def watch() -> None:
            await wait()
            self.end(outcome)

        self._tg.start_soon(watch)


@dataclass(frozen=True)
class RestartPolicy:
    """Restarts wait `backoff_initial_s`, doubling to `backoff_max_s`; a child up for `stable_after_s`
    starts the backoff (and the count of quick crashes) anew. More than `max_quick_crashes` quick
    crashes in a row give up (None: never)."""

    backoff_initial_s: float
    backoff_max_s: float
    stable_after_s: float
    stop_timeout_s: float  # SIGTERM -> SIGKILL grace
    max_quick_crashes: int | None = None


class RestartBackoff:
    """The backoff and the count of quick crashes of one loop."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.delay_s = policy.backoff_initial_s
        self.quick_crashes = 0

    def reset(self) -> None:
        self.delay_s, self.quick_crashes = self.policy.backoff_initial_s, 0

    def crashed(self, up_for_s: float) -> bool:
        """Count a crash after `up_for_s` of stable life; False once there were too many quick ones."""
        if up_for_s >= self.policy.stable_after_s:
            self.reset()
        self.quick_crashes += 1
        limit = self.policy.max_quick_crashes
        return limit is None or self.quick_crashes <= limit

    async def wait(self, stop: anyio.Event) -> None:
        """Sleep the current delay (a stop cuts it short), then double it up to the bound."""
        with anyio.move_on_after(self.delay_s):
            await stop.wait()
        self.delay_s = min(self.delay_s * 2, self.policy.backoff_max_s)


class ChildLoop:
    """Owns one child process until `stop()`: `run()` spawns it, pumps its output lines to
    `child_line`, waits on `watch`, ends it, and starts it again after a backoff. Raises
    `ChildFailed` when the subclass or the quick-crash bound gives up."""

    name = "child"  # in log lines
    logger = log  # a subclass logs its child's launches under its own name
    output_read_size = 4096

    def __init__(self, policy: RestartPolicy) -> None:
        self.restart_policy = policy
        self.backoff = RestartBackoff(policy)
        self.restarts = 0
        self.pid: int | None = None
        self.up_since: float | None = None  # when the running child counted as up; None: not up
        self.last_output = time.monotonic()  # any byte of output counts as life
        self._proc: asyncio.subprocess.Process | None = None
        self._stop_requested = anyio.Event()
        self._stopped = anyio.Event()

    # --- hooks ------------------------------------------------------------------------
    async def before_loop(self) -> None:
        """Once, before the first spawn."""

    async def before_spawn(self) -> bool:
        """Before each spawn; False ends the loop (a stop arrived while waiting)."""
        return True

    def command(self) -> tuple[Sequence[str], dict[str, str]]:
        """argv and environment of the next child."""
        raise NotImplementedError

    def spawned(self, proc: asyncio.subprocess.Process) -> None:
        """The child is running."""

    def child_line(self, line: str) -> None:
        """One non-blank line of the child's output."""

    async def watch(self, proc: asyncio.subprocess.Process) -> Outcome:
        """Until the child should end; the default waits for it to exit or for a stop."""
        async with anyio.create_task_group() as tg:
            race = OutcomeRace(tg, Outcome.STOPPING)
            race.end_when(proc.wait, Outcome.EXITED)
            race.end_when(self._stop_requested.wait, Outcome.STOPPING)
        return race.outcome

    def stop_timeout_s(self, outcome: Outcome) -> float:
        """The SIGTERM -> SIGKILL grace for a child that ended this way."""
        return self.restart_policy.stop_timeout_s

    def child_ended(self) -> None:
        """The child has exited and been reaped."""

    def describe_end(self, outcome: Outcome, proc: asyncio.subprocess.Process) -> str:
        """Why the child ended, for logs and states."""
        return f"{self.name} exited with code {proc.returncode}"

    async def restart_at_once(self, outcome: Outcome, reason: str) -> bool:
        """True: no crash of the child's (start again without backoff, and reset it)."""
        return False

    def fatal(self, outcome: Outcome) -> bool:
        """True: give up without a restart."""
        return False

    def fail(self, detail: str) -> NoReturn:
        """Give up: raise ChildFailed."""
        raise ChildFailed(detail)

    def restarting(self, reason: str, up_for_s: float) -> None:
        """The child ended and is started again after `self.backoff.delay_s`."""

    async def after_run(self) -> None:
        """Once, after the loop and its last child ended (also on failure); shielded from cancellation."""

    # --- the loop --------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self.before_loop()
            while not self._stop_requested.is_set():
                if not await self.before_spawn():
                    return
                argv, env = self.command()
                self.logger.info("launching %s", " ".join(argv))
                self.last_output = time.monotonic()
                proc = await spawn(argv, env)
                self._proc, self.pid = proc, proc.pid
                self.spawned(proc)
                async with anyio.create_task_group() as readers:
                    readers.start_soon(self._pump_output, proc)
                    outcome = await self.watch(proc)
                    up_for = time.monotonic() - self.up_since if self.up_since is not None else 0.0
                    self.up_since = None
                    await self._terminate(proc, self.stop_timeout_s(outcome))
                    readers.cancel_scope.cancel()
                if self._stop_requested.is_set():
                    return
                reason = self.describe_end(outcome, proc)
                if await self.restart_at_once(outcome, reason):
                    self.backoff.reset()
                else:
                    if self.fatal(outcome):
                        self.fail(reason)
                    if not self.backoff.crashed(up_for):
                        self.fail(f"{reason}; gave up after {self.backoff.quick_crashes - 1} quick restarts")
                    self.restarting(reason, up_for)
                    await self.backoff.wait(self._stop_requested)
                self.restarts += 1
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    if self._proc is not None and self._proc.returncode is None:
                        await self._terminate(self._proc)
                    await self.after_run()
            finally:
                self._stopped.set()

    async def stop(self) -> None:
        """Ask the loop to end its child (SIGTERM to its group, then SIGKILL) and wait until it has."""
        self._stop_requested.set()
        await self._stopped.wait()

    async def close(self) -> None:
        """`stop()`, under the name a node part's closing step has."""
        await self.stop()

    def kill_now(self) -> int | None:
        """Stop without the SIGTERM grace: SIGKILL to the child's group at once (an operator who asked twice;
        llama-server with a stream in flight lets SIGTERM wait the whole grace). The loop still reaps it
        and does not start another. The child's pid, or None when none was running."""
        self._stop_requested.set()
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return None
        signal_group(proc.pid, signal.SIGKILL)
        return proc.pid

    async def _terminate(self, proc: asyncio.subprocess.Process, stop_timeout_s: float | None = None) -> None:
        timeout = self.restart_policy.stop_timeout_s if stop_timeout_s is None else stop_timeout_s
        await terminate(proc, timeout, self.name)
        self.child_ended()

    async def _pump_output(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        partial = b""
        while chunk := await proc.stdout.read(self.output_read_size):
            # Any byte counts as life: big loads print progress dots without newlines.
            self.last_output = time.monotonic()
            partial += chunk
            *lines, partial = partial.split(b"\n")
            for raw in lines:
                self._line(raw.decode("utf-8", "replace").rstrip("\r"))
        if partial:
            self._line(partial.decode("utf-8", "replace"))

    def _line(self, line: str) -> None:
        if line.strip():
            self.child_line(line)
