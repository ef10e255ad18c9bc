"""The node's watch over its pool: a worker whose status cannot be read, that is not serving, or that
came back on another RPC protocol is away; the supervisor's waits follow; /health names workers, never addresses."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from meshnet_gguf.contract.protocol import HealthReport
from meshnet_gguf.llama.pool_monitor import PoolMonitor, WatchedWorker

pytestmark = pytest.mark.anyio

FIRST = WatchedWorker("worker 1", "10.0.0.2:50052", "http://10.0.0.2:50053/status", 60 * 10**9, "3.0.0")
SECOND = WatchedWorker("worker 2", "10.0.0.3:50052", "http://10.0.0.3:50053/status", 40 * 10**9, "3.0.0")


class Statuses:
    """What each status URL answers; an exception stands for an unreachable worker."""

    def __init__(self) -> None:
        self.answers: dict[str, dict[str, Any] | Exception] = {
            FIRST.status_url: {"state": "running", "protocol": "3.0.0"},
            SECOND.status_url: {"state": "running", "protocol": "3.0.0"},
        }

    async def read(self, url: str) -> dict[str, Any]:
        answer = self.answers[url]
        if isinstance(answer, Exception):
            raise answer
        return answer


def monitor(statuses: Statuses) -> PoolMonitor:
    return PoolMonitor([FIRST, SECOND], statuses.read, interval_s=0.01, timeout_s=1.0, total_bytes=100 * 10**9, plan="RPC0 (worker 1)")


async def test_a_whole_pool_is_whole_and_health_names_workers_without_addresses() -> None:
    pool = monitor(Statuses())
    assert await pool.recheck() is None
    report = pool.health(HealthReport(state="ready"))
    assert report.pool is not None and [w.state for w in report.pool.workers] == ["up", "up"]
    assert report.pool.workers[0].assigned_bytes == 60 * 10**9 and report.pool.total_bytes == 100 * 10**9
    text = report.model_dump_json()
    assert "10.0.0.2" not in text and "10.0.0.3" not in text and "50053" not in text


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (ConnectionRefusedError("refused"), "status unreachable"),
        ({"state": "restarting", "protocol": None}, "ggml-rpc-server restarting"),
        ({"state": "running", "protocol": "4.0.0"}, "speaks RPC protocol 4.0.0, the pool 3.0.0"),
        # A worker whose status says nonsense is away too, and nothing of it reaches /health: the monitor keeps polling.
        ({"state": "running", "protocol": 3}, "no RPC protocol version"),
        ({"state": "running", "protocol": "3.0.0<script>" + "x" * 100_000}, "no RPC protocol version"),
        ({"state": "<b>" * 1000, "protocol": "3.0.0"}, "ggml-rpc-server not serving"),
        (["running", "3.0.0"], "not a JSON object"),
    ],
)
async def test_a_worker_unreachable_not_serving_or_on_another_protocol_is_away(answer: object, why: str) -> None:
    statuses = Statuses()
    pool = monitor(statuses)
    statuses.answers[SECOND.status_url] = answer  # type: ignore[assignment]
    missing = await pool.recheck()
    assert missing is not None and "worker 2 is away" in missing and why in missing and "worker 1" not in missing
    report = pool.health(HealthReport(state="restarting"))
    assert report.pool is not None and [w.state for w in report.pool.workers] == ["up", "away"]
    assert report.pool.workers[1].protocol == "3.0.0" and len(report.model_dump_json()) < 2_000  # the last good word only


async def test_the_waits_follow_the_pool_as_the_monitor_polls() -> None:
    statuses = Statuses()
    pool = monitor(statuses)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        statuses.answers[FIRST.status_url] = OSError("gone")
        with anyio.fail_after(2):
            await pool.wait_broken()
        statuses.answers[FIRST.status_url] = {"state": "running", "protocol": "3.1.0"}  # same major: welcome back
        with anyio.fail_after(2):
            await pool.wait_whole()
        tg.cancel_scope.cancel()
    assert pool.missing() is None


async def test_loaded_means_a_model_buffer_on_every_worker_in_this_llama_servers_log() -> None:
    pool = monitor(Statuses())
    pool.child_state("loading", None, 1)
    pool.child_line("load_tensors: RPC0[10.0.0.2:50052] model buffer size = 1200.00 MiB")
    assert pool.unloaded() == "llama-server put no model buffer on worker 2"
    pool.child_line("load_tensors: RPC1[10.0.0.3:50052] model buffer size = 800.00 MiB")
    assert pool.unloaded() is None
    pool.child_state("loading", None, 2)  # the next llama-server must show its own
    assert pool.unloaded() == "llama-server put no model buffer on worker 1, worker 2"
