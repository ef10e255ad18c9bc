"""The ledgers' writer thread: calls run in order, errors come back to their caller, and a caller
cancelled mid-call still waits for its call to finish (a row is written whole or not at all)."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from meshnet_gguf.common.serial_worker import SerialWorker

pytestmark = pytest.mark.anyio


async def test_calls_run_in_order_on_one_thread() -> None:
    worker = SerialWorker("test")
    seen: list[tuple[int, int]] = []

    def note(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * 2

    async with anyio.create_task_group() as tg:
        for i in range(50):
            tg.start_soon(worker.run, note, i)
    assert [i for i, _ in seen] == list(range(50))
    assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()
    assert await worker.run(note, 21) == 42
    worker.stop()


async def test_a_call_deferred_to_the_next_turn_starts_only_after_the_caller_yields_and_keeps_its_place() -> None:
    # The node's route path hands its ledger row over this way, after the request went upstream: the thread must
    # not take the GIL before the caller's next await, and a call made after it in the same turn must not overtake it.
    worker = SerialWorker("test")
    seen: list[str] = []
    started = threading.Event()

    def note(name: str) -> str:
        started.set()
        seen.append(name)
        return name

    await worker.run(note, "warm")  # the thread exists and waits
    started.clear()
    deferred = worker.submit(note, "row", at_next_turn=True)
    time.sleep(0.05)  # still this turn: the thread has not been handed the call
    assert not started.is_set() and seen == ["warm"]
    later = worker.submit(note, "after")  # an immediate call in the same turn hands the deferred one over first
    assert (await deferred, await later) == ("row", "after") and seen == ["warm", "row", "after"]
    alone = worker.submit(note, "alone", at_next_turn=True)
    assert await alone == "alone"  # handed over at the next turn by itself
    worker.stop()


async def test_an_error_reaches_its_caller_and_the_worker_goes_on() -> None:
    worker = SerialWorker("test")

    def fail() -> None:
        raise ValueError("disk full")

    with pytest.raises(ValueError, match="disk full"):
        await worker.run(fail)
    assert await worker.run(lambda: "still here") == "still here"
    worker.stop()


async def test_a_cancelled_caller_waits_for_its_call_to_finish() -> None:
    worker = SerialWorker("test")
    finished = threading.Event()

    def slow_write() -> None:
        time.sleep(0.3)
        finished.set()

    with anyio.move_on_after(0.05) as scope:
        await worker.run(slow_write)
    # The deadline passed mid-call, yet the caller came back only once the write was done.
    assert scope.cancel_called and finished.is_set()
    worker.stop()
