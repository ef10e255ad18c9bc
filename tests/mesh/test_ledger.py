"""The usage ledger: one row per request id, an outbox that empties only on acknowledgement,
totals for `meshnet-gguf usage`, and durability across reopening."""

from __future__ import annotations

import asyncio

import contextlib
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from meshnet_gguf.contract.protocol import FinishReason, UsageRecord
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.ledger import LEDGER_FILE, RowState, UsageLedger

pytestmark = pytest.mark.anyio
# A disk this slow to sync must never hold the event loop (far above what a loaded machine's scheduler delays a wake-up).
SLOW_WRITE_S = 0.2
SLOW_WRITES = 4
# How long another process holds the ledger's write lock in the test that takes it.
LOCK_HELD_S = 0.3


def record(rid: str, prompt: int = 3, completion: int = 5, finish: FinishReason = "stop", started: float = 1000.0) -> UsageRecord:
    return UsageRecord(
        request_id=rid, route="/v1/chat/completions", model="tiny", status=200, stream=True,
        prompt_tokens=prompt, completion_tokens=completion, finish_reason=finish, started_at=started,
    )  # fmt: skip


@pytest.fixture
def identity(tmp_path: Path) -> NodeIdentity:
    return NodeIdentity.load_or_create(tmp_path / "id")


@pytest.fixture
def ledger(tmp_path: Path):
    led = UsageLedger.in_state_dir(tmp_path)
    yield led
    led.close()


async def add(ledger: UsageLedger, identity: NodeIdentity, rec: UsageRecord) -> bool:
    return await ledger.add(rec, identity.sign_receipt(rec))


async def test_one_row_per_request_id_first_wins(ledger: UsageLedger, identity: NodeIdentity) -> None:
    assert await add(ledger, identity, record("r1", completion=5))
    assert not await add(ledger, identity, record("r1", completion=99))
    [entry] = await ledger.entries()
    assert entry.record.completion_tokens == 5
    assert entry.outbox_state == "pending"


async def test_receipt_must_belong_to_its_record(ledger: UsageLedger, identity: NodeIdentity) -> None:
    with pytest.raises(ValueError):
        await ledger.add(record("r1"), identity.sign_receipt(record("r2")))


async def test_outbox_oldest_first_until_acknowledged(ledger: UsageLedger, identity: NodeIdentity) -> None:
    for i in range(5):
        await add(ledger, identity, record(f"r{i}"))
    batch = await ledger.pending(3)
    assert [r.request_id for r in batch] == ["r0", "r1", "r2"]
    assert await ledger.mark_reported(["r0", "r1"]) == 2
    assert await ledger.mark_reported(["r0"]) == 0  # already reported: no change
    assert await ledger.mark_rejected([("r2", "bad_signature: nope")]) == 1
    assert [r.request_id for r in await ledger.pending(10)] == ["r3", "r4"]
    states = {e.record.request_id: e.outbox_state for e in await ledger.entries()}
    assert states == {"r0": "reported", "r1": "reported", "r2": "rejected", "r3": "pending", "r4": "pending"}
    assert [e.record.request_id for e in await ledger.entries(pending_only=True)] == ["r4", "r3"]


async def test_totals_count_tokens_and_outbox(ledger: UsageLedger, identity: NodeIdentity) -> None:
    await add(ledger, identity, record("a", 10, 20))
    await add(ledger, identity, record("b", 1, 2, finish="cancelled"))
    await add(ledger, identity, record("c", 4, 0, finish="error"))
    await ledger.mark_reported(["a"])
    totals = await ledger.totals()
    assert (totals.usage.requests, totals.usage.prompt_tokens, totals.usage.completion_tokens) == (3, 15, 22)
    assert (totals.usage.cancelled, totals.usage.errors) == (1, 1)
    assert (totals.reported, totals.pending, totals.rejected) == (1, 2, 0)


async def test_many_concurrent_writers_lose_nothing(ledger: UsageLedger, identity: NodeIdentity) -> None:
    async with anyio.create_task_group() as tg:
        for i in range(100):
            tg.start_soon(add, ledger, identity, record(f"r{i}"))
    assert (await ledger.totals()).usage.requests == 100


async def test_rows_survive_reopening_and_use_wal(tmp_path: Path, identity: NodeIdentity) -> None:
    led = UsageLedger.in_state_dir(tmp_path)
    await add(led, identity, record("kept"))
    await led.aclose()
    again = UsageLedger.in_state_dir(tmp_path)
    try:
        assert [r.request_id for r in await again.pending(10)] == ["kept"]
    finally:
        again.close()
    mode = sqlite3.connect(tmp_path / LEDGER_FILE).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


async def test_recent_request_ids_for_the_replay_cache(ledger: UsageLedger, identity: NodeIdentity) -> None:
    await add(ledger, identity, record("old", started=100.0))
    await add(ledger, identity, record("new", started=200.0))
    assert await ledger.request_ids_since(150.0) == [("new", 200.0)]


class LoopWatch:
    """How long the event loop stood still at most: a task that sleeps 1 ms at a time, timed."""

    longest_stall_s = 0.0
    TICK_S = 0.001

    async def run(self) -> None:
        while True:
            before = time.perf_counter()
            await anyio.sleep(self.TICK_S)
            self.longest_stall_s = max(self.longest_stall_s, time.perf_counter() - before)


@contextlib.asynccontextmanager
async def loop_watch() -> AsyncIterator[LoopWatch]:
    watch = LoopWatch()
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch.run)
        yield watch
        # A last write made on the loop with no await after it: the watch wakes late only now.
        await anyio.sleep(5 * watch.TICK_S)
        tg.cancel_scope.cancel()


async def test_a_slow_disk_never_holds_the_event_loop_for_the_row_before_forwarding(tmp_path: Path) -> None:
    """The row a routed request waits for is written on the event loop only while synced writes are
    quick; on a disk that takes 200 ms a write, every one goes to the writer thread and the loop
    (every other stream of the node) keeps running meanwhile."""
    ledger = UsageLedger(tmp_path / LEDGER_FILE)

    def slow_disk(write):  # type: ignore[no-untyped-def]
        def slowly(*args: object) -> bool:
            time.sleep(SLOW_WRITE_S)
            return write(*args)

        return slowly

    ledger.open_request_sync = slow_disk(ledger.open_request_sync)  # type: ignore[method-assign]
    try:
        async with loop_watch() as watch:
            for i in range(SLOW_WRITES):
                await anyio.sleep(0.005)  # the watch is asleep in the loop when each write starts
                assert await ledger.open_request(record(f"req-slow-{i}"), 2000.0, b"{}")
        assert watch.longest_stall_s < SLOW_WRITE_S / 2, f"the loop stood still {watch.longest_stall_s * 1000:.1f} ms"
        assert len(await ledger.request_ids_since(0)) == SLOW_WRITES
    finally:
        await ledger.aclose()


async def test_the_open_row_is_handed_to_the_writer_thread_at_once_and_it_is_on_disk(tmp_path: Path) -> None:
    """`open_request_soon` queues the row before it returns (the request is forwarded meanwhile) and
    the row is synced on the writer thread, never on the loop; each is durable and read back by a
    fresh connection, as a restarted node would."""
    ledger = UsageLedger(tmp_path / LEDGER_FILE)
    threads: list[str] = []
    on_thread = ledger.open_request_sync

    def noted(*args: object) -> bool:
        threads.append(threading.current_thread().name)
        return on_thread(*args)

    ledger.open_request_sync = noted  # type: ignore[method-assign]
    try:
        written = [ledger.open_request_soon(record(f"req-quick-{i}"), 2000.0, b"{}") for i in range(5)]
        assert all(await asyncio.gather(*written))
        assert not await ledger.open_request(record("req-quick-0"), 2000.0, b"{}")  # the id is used up
    finally:
        await ledger.aclose()
    assert threads == ["usage-ledger"] * 6, threads
    with sqlite3.connect(tmp_path / LEDGER_FILE) as db:
        assert db.execute(f"SELECT COUNT(*) FROM usage WHERE state = {RowState.OPEN:d}").fetchone()[0] == 5


@pytest.mark.parametrize("step", ["open", "settle"])
async def test_another_process_holding_the_ledger_never_holds_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, identity: NodeIdentity, step: str
) -> None:
    """`meshnet-gguf usage` (or a backup) holding SQLite's write lock while a routed request opens
    or settles its row: the row is not written on the loop (that would wait there, up to the busy
    timeout), it goes to the writer thread, which waits for the lock while every other task runs on."""
    path = tmp_path / LEDGER_FILE
    ledger = UsageLedger(path)
    assert await ledger.open_request(record("req-first"), 2000.0, b"{}")  # on the thread: the estimate starts pessimistic
    assert await ledger.open_request(record("req-while-locked"), 2000.0, b"{}")
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # another process's write transaction
    release = threading.Timer(LOCK_HELD_S, other.execute, args=("COMMIT",))
    try:
        async with loop_watch() as watch:
            await anyio.sleep(0.005)  # the watch is asleep in the loop when the write starts
            started = time.perf_counter()
            release.start()
            if step == "open":
                assert await ledger.open_request(record("req-while-locked-2"), 2000.0, b"{}")
            else:
                assert await add(ledger, identity, record("req-while-locked"))
            waited = time.perf_counter() - started
        assert waited >= LOCK_HELD_S * 0.9  # it did wait for the lock: on the thread
        assert watch.longest_stall_s < LOCK_HELD_S / 3, f"the loop stood still {watch.longest_stall_s * 1000:.0f} ms"
    finally:
        release.cancel()
        other.close()
        await ledger.aclose()
    with sqlite3.connect(path) as db:
        opened = db.execute(f"SELECT COUNT(*) FROM usage WHERE state = {RowState.OPEN:d}").fetchone()[0]
        settled = db.execute(f"SELECT COUNT(*) FROM usage WHERE state = {RowState.SETTLED:d} AND receipt != ''").fetchone()[0]
    assert (opened, settled) == ((3, 0) if step == "open" else (1, 1))


@pytest.mark.parametrize("which", ["node", "tracker"])
async def test_the_log_is_checkpointed_on_the_writer_thread_never_in_a_commit_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """SQLite checkpoints its write-ahead log inside whichever commit takes it past 1,000 pages
    (~10 ms here, far longer on a slow disk). A row committed on the event loop must never be that
    commit, so the connection must never checkpoint by itself: the writer thread does, and the log stays small."""
    from meshnet_gguf.common import sqlite_wal
    from meshnet_gguf.reference.tracker.ledger import TrackerLedger

    body = b'{"messages":[{"role":"user","content":"' + b"the quick brown fox " * 300 + b'"}]}'  # ~6 KB: two pages
    path = tmp_path / f"{which}.sqlite3"
    ledger = UsageLedger(path) if which == "node" else TrackerLedger(path)
    db = ledger._store.db
    assert db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0  # no commit checkpoints by itself
    threads: list[str] = []
    checkpoint = ledger._store.checkpoints.checkpoint_sync

    def noting_thread() -> None:
        threads.append(threading.current_thread().name)
        checkpoint()

    ledger._store.checkpoints.checkpoint_sync = noting_thread  # type: ignore[method-assign]
    writes = 6 * sqlite_wal.CHECKPOINT_EVERY_CALLS
    wal = tmp_path / f"{which}.sqlite3-wal"
    for i in range(writes):
        if isinstance(ledger, UsageLedger):
            assert await ledger.open_request(record(f"req-{i}"), 2000.0, body)
        else:
            await ledger.open_request(f"req-{i}", "node-a", "m", "/v1/chat/completions", True, body_bytes=len(body) + i)
        await anyio.sleep(0)  # as between two requests, the loop runs its other tasks
        if i == writes // 2:
            halfway = wal.stat().st_size
    await anyio.sleep(0.2)  # the last one handed over finishes
    assert len(threads) >= 4 and set(threads) == {ledger._store.worker._name}, threads
    # Left to grow, the log would hold every row and double from halfway to the end; checkpointed,
    # it is written again from its start and stays the size one period of rows needs.
    assert wal.stat().st_size < 1.3 * halfway, f"the log grew from {halfway} to {wal.stat().st_size} bytes"
    if isinstance(ledger, UsageLedger):
        await ledger.aclose()
        with sqlite3.connect(path) as reopened:
            assert reopened.execute("SELECT COUNT(*) FROM usage").fetchone()[0] == writes
    else:
        ledger.close()
