"""The supervisor and its pool: llama-server runs only while every worker is up, is ended when one goes
away (no crash counted, however often), and comes back by itself, without backoff, when the pool is whole."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anyio
import pytest

from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.child import ChildSpec
from meshnet_gguf.llama.supervisor import Supervisor
from support.supervisor_policies import QUICK

pytestmark = pytest.mark.anyio
# Two quick crashes would fail the node: losing a worker three times must not.
POLICY = dataclasses.replace(QUICK, warmup=None, max_quick_crashes=2, restart_backoff_initial_s=30.0, restart_backoff_max_s=30.0)


class Gate:
    """A pool whose wholeness the test decides (what `PoolMonitor` says from the workers' status)."""

    def __init__(self, away: str | None) -> None:
        self.away = away
        self.loaded: str | None = None
        self._changed = anyio.Event()

    def set(self, away: str | None) -> None:
        self.away = away
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    def missing(self) -> str | None:
        return self.away

    async def recheck(self) -> str | None:
        return self.away

    async def wait_whole(self) -> None:
        while self.away is not None:
            await self._changed.wait()

    async def wait_broken(self) -> None:
        while self.away is None:
            await self._changed.wait()

    def unloaded(self) -> str | None:
        return self.loaded


async def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.02)


async def test_held_while_away_ended_when_a_worker_goes_and_relaunched_when_whole(fake_llama: BinaryInfo, tmp_path: Path) -> None:
    gate = Gate("worker 2 is away (status unreachable)")
    sup = Supervisor(ChildSpec(fake_llama, ["--model", "m.gguf", "--alias", "m"]), POLICY, state_dir=tmp_path, pool=gate)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        await anyio.sleep(0.5)
        assert sup.pid is None and sup.state == "starting" and "waiting for the pool: worker 2 is away" in (sup.detail or "")
        gate.set(None)
        await wait_for(lambda: sup.state == "ready")
        for lost in range(3):  # more losses than quick crashes allowed, each relaunched at once (no 30 s backoff)
            pid = sup.pid
            gate.set("worker 1 is away (status unreachable)")
            await wait_for(lambda: sup.state == "restarting" and "waiting for the pool" in (sup.detail or ""), timeout=5)
            gate.set(None)
            await wait_for(lambda: sup.state == "ready" and sup.pid != pid, timeout=5)
        assert sup.restarts == 3
        await sup.stop()
        tg.cancel_scope.cancel()


async def test_a_worker_without_model_buffers_is_not_ready(fake_llama: BinaryInfo, tmp_path: Path) -> None:
    gate = Gate(None)
    gate.loaded = "llama-server put no model buffer on worker 2"
    sup = Supervisor(ChildSpec(fake_llama, ["--model", "m.gguf", "--alias", "m"]), POLICY, state_dir=tmp_path, pool=gate)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        await wait_for(lambda: sup.state == "restarting" and "no model buffer on worker 2" in (sup.detail or ""))
        assert sup.ready_since is None
        await sup.stop()
        tg.cancel_scope.cancel()
