"""The supervisor against the fake llama-server (fault paths) and the real one (serving, orphans)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import psutil
import pytest

from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.child import (
    API_KEY_ENV,
    PIDFILE_NAME,
    ChildFailed,
    ChildSpec,
    reap_stale_child,
    reap_stale_child_in_thread,
)
from meshnet_gguf.llama.supervisor import Supervisor, SupervisorPolicy
from support.supervisor_policies import FAST

pytestmark = pytest.mark.anyio


class StateLog:
    """A child listener that keeps what the supervisor told it."""

    def __init__(self) -> None:
        self.states: list[str] = []
        self.pids: list[int | None] = []
        self.times: list[float] = []  # time.monotonic() of each state

    def child_line(self, line: str) -> None:
        pass

    def child_state(self, state: str, detail: str | None, pid: int | None) -> None:
        self.states.append(state)
        self.pids.append(pid)
        self.times.append(time.monotonic())

    def durations(self, state: str) -> list[float]:
        """How long each stay in `state` lasted (until the next state)."""
        return [self.times[i + 1] - self.times[i] for i, s in enumerate(self.states[:-1]) if s == state]


# The event loop's clock may read a sleep a hair short of what was asked.
BACKOFF_SLACK_S = 0.01


def make(binary: BinaryInfo, tmp_path: Path, policy: SupervisorPolicy = FAST, listener: StateLog | None = None, **env: str) -> Supervisor:
    return Supervisor(
        ChildSpec(binary, ["--model", "m.gguf", "--alias", "m"], env),
        policy,
        state_dir=tmp_path,
        listeners=[listener] if listener else [],
    )


async def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.02)


async def test_becomes_ready_after_loading_and_stops_cleanly(fake_llama: BinaryInfo, tmp_path: Path) -> None:
    listener = StateLog()
    sup = make(fake_llama, tmp_path, listener=listener, FAKE_LLAMA_LOAD_S="0.6")
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        await wait_for(lambda: sup.state == "loading")
        started = time.monotonic()
        await wait_for(sup.is_ready)
        assert time.monotonic() - started >= 0.4  # waited for /health 200, not for the port
        pid = sup.pid
        assert pid and (tmp_path / PIDFILE_NAME).exists()
        # The internal key reaches the child by environment, never argv.
        proc = psutil.Process(pid)
        assert sup.api_key not in " ".join(proc.cmdline())
        assert proc.environ().get(API_KEY_ENV) == sup.api_key
        assert all(sup.api_key not in line for line in sup.log_ring)
        await sup.stop()
    assert sup.state == "stopped"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not (tmp_path / PIDFILE_NAME).exists()
    # The initial state is "starting", so the first change a listener hears is "loading".
    assert listener.states == ["loading", "ready", "draining", "stopped"]
    assert listener.pids[0] == pid


async def test_exit_before_ready_fails_with_the_child_error_lines(fake_llama: BinaryInfo, tmp_path: Path) -> None:
    sup = make(fake_llama, tmp_path, FAKE_LLAMA_EXIT_ON_START="3")
    with pytest.raises(ChildFailed) as err:
        await sup.run()
    assert "exited with code 3" in str(err.value)
    assert "error loading model: fake failure requested" in str(err.value)
    assert sup.state == "failed"


async def test_silent_load_trips_the_stall_timer(fake_llama: BinaryInfo, tmp_path: Path) -> None:
    policy = SupervisorPolicy(**{**FAST.__dict__, "load_stall_timeout_s": 0.8})
    sup = make(fake_llama, tmp_path, policy, FAKE_LLAMA_LOAD_S="30", FAKE_LLAMA_SILENT_LOAD="1")
    started = time.monotonic()
    with pytest.raises(ChildFailed, match="printed nothing for 1 s"):
        await sup.run()
    assert time.monotonic() - started < 10


async def test_log_activity_keeps_a_long_load_alive(fake_llama: BinaryInfo, tmp_path: Path) -> None:
    # Loading takes 3x the stall timeout but prints all along: not a stall.
    policy = SupervisorPolicy(**{**FAST.__dict__, "load_stall_timeout_s": 0.6})
    sup = make(fake_llama, tmp_path, policy, FAKE_LLAMA_LOAD_S="1.8")
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        await wait_for(sup.is_ready)
        await sup.stop()


async def test_crash_after_ready_restarts_with_backoff_then_gives_up(fake_llama: BinaryInfo, tmp_path: Path) -> None:
    states = StateLog()
    sup = make(fake_llama, tmp_path, listener=states)
    failure: list[BaseException] = []

    async def run() -> None:
        try:
            await sup.run()
        except ChildFailed as exc:
            failure.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        for expected_restarts in range(FAST.max_quick_crashes + 1):
            await wait_for(lambda: sup.is_ready() and sup.restarts == expected_restarts)
            os.kill(sup.pid, signal.SIGKILL)
            await wait_for(lambda: sup.state != "ready")
        await wait_for(lambda: sup.state == "failed")
    assert failure and "gave up after 2 quick restarts" in str(failure[0])
    # Backoff doubles: 0.2 s, then 0.4 s between the crash and the next start. Timed from the supervisor's own
    # states (a load on the box only lengthens a wait; the child's start-up time is not in it).
    backoffs = states.durations("restarting")
    initial = FAST.restart_backoff_initial_s
    assert len(backoffs) == FAST.max_quick_crashes, states.states
    assert backoffs[0] >= initial - BACKOFF_SLACK_S and backoffs[1] >= 2 * initial - BACKOFF_SLACK_S, backoffs


async def test_unresponsive_child_is_restarted(fake_llama: BinaryInfo, tmp_path: Path) -> None:
    sup = make(fake_llama, tmp_path, FAKE_LLAMA_HANG_AFTER_S="0.5")
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        await wait_for(lambda: sup.state in ("restarting", "failed"), timeout=15)
        assert "stopped answering /health" in (sup.detail or "")
        await sup.stop()


async def test_sigterm_ignored_then_sigkill(tmp_path: Path) -> None:
    script = tmp_path / "stubborn.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n")
    import asyncio

    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), start_new_session=True)
    await anyio.sleep(0.3)
    policy = SupervisorPolicy(**{**FAST.__dict__, "stop_timeout_s": 0.5})
    supervisor = Supervisor(ChildSpec.__new__(ChildSpec), policy)
    started = time.monotonic()
    await supervisor._terminate(proc)  # the stop path on a child that ignores SIGTERM
    assert proc.returncode == -signal.SIGKILL
    assert 0.4 < time.monotonic() - started < 5


def test_stale_child_from_pidfile_is_ended_but_a_recycled_pid_is_not(tmp_path: Path) -> None:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pidfile = tmp_path / PIDFILE_NAME
    try:
        # A pidfile whose start time does not match: the pid belongs to someone else now.
        pidfile.write_text(json.dumps({"pid": victim.pid, "create_time": 1.0}))
        assert reap_stale_child(pidfile) is False
        assert victim.poll() is None and not pidfile.exists()
        pidfile.write_text(json.dumps({"pid": victim.pid, "create_time": psutil.Process(victim.pid).create_time()}))
        assert reap_stale_child(pidfile) is True
        assert victim.wait(timeout=5) is not None
    finally:
        if victim.poll() is None:
            victim.kill()


async def test_the_stale_child_reap_leaves_the_event_loop_free(tmp_path: Path) -> None:
    # A leftover that ignores SIGTERM makes the reaper wait its whole grace before SIGKILL:
    # the node's event loop must keep running meanwhile (the reaper waits in a worker thread).
    ignore_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    victim = subprocess.Popen([sys.executable, "-c", ignore_term], stdout=subprocess.PIPE)
    try:
        assert victim.stdout is not None and victim.stdout.readline()
        pidfile = tmp_path / PIDFILE_NAME
        pidfile.write_text(json.dumps({"pid": victim.pid, "create_time": psutil.Process(victim.pid).create_time()}))
        ticks = 0
        reaping = True

        async def tick() -> None:
            nonlocal ticks
            while reaping:
                await anyio.sleep(0.02)
                ticks += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            assert await reap_stale_child_in_thread(pidfile, timeout_s=0.5) is True
            reaping = False
        assert victim.wait(timeout=5) is not None  # psutil reaped it: Popen sees no status of its own
        assert ticks >= 5, f"the event loop ran {ticks} times while the reaper waited"
    finally:
        if victim.poll() is None:
            victim.kill()


def test_no_orphan_survives_kill_9_of_the_node(start_node, fake_llama_path: Path, tiny_gguf: Path) -> None:  # type: ignore[no-untyped-def]
    node = start_node("--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path))
    node.wait_ready()
    child = node.llama_pid()
    assert child and psutil.pid_exists(child)
    node.signal(signal.SIGKILL)
    node.wait_exit()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.05)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_restart_after_kill_9_reaps_the_stale_child_by_pidfile(start_node, fake_llama_path: Path, tiny_gguf: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Simulate a child that outlived its node (e.g. a platform without parent-death signals):
    # started through a shell that exits, so like a real orphan it is not our child.
    launcher = subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -c "import time; time.sleep(60)" >/dev/null 2>&1 & echo $!'],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    stale = psutil.Process(int(launcher.stdout))
    state = tmp_path / "state"
    state.mkdir()
    (state / PIDFILE_NAME).write_text(json.dumps({"pid": stale.pid, "create_time": stale.create_time()}))
    node = start_node("--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path))
    node.wait_ready()
    psutil.wait_procs([stale], timeout=5)
    assert not stale.is_running() or stale.status() == psutil.STATUS_ZOMBIE
    assert "left by an earlier run" in node.log_text()
    with httpx.Client() as client:
        assert client.get(node.url + "/health").status_code == 200
