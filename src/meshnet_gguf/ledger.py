"""The node's usage ledger: one SQLite row per request id, with its signed receipt and outbox state.

The ledger owns the database; everyone else asks through `UsageLedger`. Each
call runs the stdlib `sqlite3` in a worker thread (`anyio.to_thread`), so the
event loop never waits on the disk, and a call, once started, completes even
if its caller is cancelled: a row is written whole or not at all.

A row is *pending* until the tracker acknowledges it (`reported_at` set) or
refuses it for good (`rejected` set). Pending rows are the outbox; they live
in the database, so a kill -9 or an hours-long tracker outage loses nothing.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import anyio

from meshnet_gguf.protocol import UsageReceipt, UsageRecord, UsageTotals

LEDGER_FILE = "usage.sqlite3"
# Another process (`meshnet-gguf usage`, a backup) may hold a lock briefly; wait rather than fail.
BUSY_TIMEOUT_S = 10.0
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id        TEXT PRIMARY KEY,
    recorded_at       REAL NOT NULL,
    started_at        REAL NOT NULL,
    model             TEXT NOT NULL,
    route             TEXT NOT NULL,
    status            INTEGER NOT NULL,
    stream            INTEGER NOT NULL,
    prompt_tokens     INTEGER NOT NULL,
    cached_tokens     INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    finish_reason     TEXT NOT NULL,
    record_json       TEXT NOT NULL,
    receipt           TEXT NOT NULL,
    reported_at       REAL,
    rejected          TEXT
);
CREATE INDEX IF NOT EXISTS usage_started ON usage (started_at);
CREATE INDEX IF NOT EXISTS usage_outbox ON usage (recorded_at) WHERE reported_at IS NULL AND rejected IS NULL;
"""

T = TypeVar("T")


@dataclass(frozen=True)
class LedgerEntry:
    record: UsageRecord
    receipt: UsageReceipt
    recorded_at: float
    reported_at: float | None
    rejected: str | None

    @property
    def outbox_state(self) -> str:
        if self.rejected:
            return "rejected"
        return "reported" if self.reported_at is not None else "pending"


@dataclass(frozen=True)
class LedgerTotals:
    usage: UsageTotals
    reported: int
    pending: int
    rejected: int


class UsageLedger:
    """SQLite (WAL) ledger at `path`. Safe to share between tasks and threads of one process."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection, serialised by a lock: SQLite allows one writer anyway, and the
        # lock lets any worker thread use it (check_same_thread=False).
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a receipt is money; a row the proxy was told is written must survive a power cut too.
        self._db.execute("PRAGMA synchronous=FULL")
        with self._lock:
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @classmethod
    def in_state_dir(cls, state_dir: Path) -> UsageLedger:
        return cls(Path(state_dir) / LEDGER_FILE)

    # --- async API (what the node uses) -------------------------------------------
    async def add(self, record: UsageRecord, receipt: UsageReceipt) -> bool:
        """Store a request's usage; False when its request id is already there (the first row wins)."""
        return await self._run(self.add_sync, record, receipt)

    async def pending(self, limit: int) -> list[UsageReceipt]:
        """Oldest receipts not yet acknowledged nor rejected."""
        return await self._run(self.pending_sync, limit)

    async def mark_reported(self, request_ids: Iterable[str], at: float | None = None) -> int:
        return await self._run(self.mark_reported_sync, list(request_ids), at)

    async def mark_rejected(self, rejections: Iterable[tuple[str, str]]) -> int:
        """`(request_id, reason)` pairs the tracker refused for good; they leave the outbox."""
        return await self._run(self.mark_rejected_sync, list(rejections))

    async def entries(self, limit: int = 50, pending_only: bool = False) -> list[LedgerEntry]:
        return await self._run(self.entries_sync, limit, pending_only)

    async def totals(self) -> LedgerTotals:
        return await self._run(self.totals_sync)

    async def request_ids_since(self, started_after: float) -> list[tuple[str, float]]:
        return await self._run(self.request_ids_since_sync, started_after)

    async def aclose(self) -> None:
        await self._run(self.close)

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await anyio.to_thread.run_sync(fn, *args)

    # --- sync API (worker threads, the CLI) --------------------------------------
    def add_sync(self, record: UsageRecord, receipt: UsageReceipt) -> bool:
        if receipt.request_id != record.request_id:
            raise ValueError(f"receipt {receipt.request_id} does not belong to record {record.request_id}")
        with self._lock:
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO usage (request_id, recorded_at, started_at, model, route, status, stream,"
                " prompt_tokens, cached_tokens, completion_tokens, finish_reason, record_json, receipt)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.request_id,
                    time.time(),
                    record.started_at,
                    record.model,
                    record.route,
                    record.status,
                    int(record.stream),
                    record.prompt_tokens,
                    record.cached_tokens,
                    record.completion_tokens,
                    record.finish_reason,
                    record.model_dump_json(),
                    receipt.token,
                ),
            )
            return cursor.rowcount == 1

    def outbox_depth_sync(self) -> int:
        """Receipts recorded but not yet acknowledged or rejected by the tracker."""
        with self._lock:
            (count,) = self._db.execute(
                "SELECT COUNT(*) FROM usage WHERE reported_at IS NULL AND rejected IS NULL"
            ).fetchone()
        return int(count)

    def pending_sync(self, limit: int) -> list[UsageReceipt]:
        with self._lock:
            rows = self._db.execute(
                "SELECT request_id, receipt FROM usage WHERE reported_at IS NULL AND rejected IS NULL"
                " ORDER BY recorded_at, rowid LIMIT ?",
                (limit,),
            ).fetchall()
        return [UsageReceipt(request_id=rid, token=token) for rid, token in rows]

    def mark_reported_sync(self, request_ids: list[str], at: float | None = None) -> int:
        stamp = time.time() if at is None else at
        with self._lock:
            cursor = self._db.executemany(
                "UPDATE usage SET reported_at = ? WHERE request_id = ? AND reported_at IS NULL",
                [(stamp, rid) for rid in request_ids],
            )
            return cursor.rowcount

    def mark_rejected_sync(self, rejections: list[tuple[str, str]]) -> int:
        with self._lock:
            cursor = self._db.executemany(
                "UPDATE usage SET rejected = ? WHERE request_id = ? AND reported_at IS NULL",
                [(reason, rid) for rid, reason in rejections],
            )
            return cursor.rowcount

    def entries_sync(self, limit: int = 50, pending_only: bool = False) -> list[LedgerEntry]:
        where = "WHERE reported_at IS NULL AND rejected IS NULL" if pending_only else ""
        with self._lock:
            rows = self._db.execute(
                f"SELECT record_json, request_id, receipt, recorded_at, reported_at, rejected FROM usage {where}"
                " ORDER BY recorded_at DESC, rowid DESC LIMIT ?",
                (limit,),
            ).fetchall()
        return [
            LedgerEntry(
                record=UsageRecord.model_validate_json(record_json),
                receipt=UsageReceipt(request_id=rid, token=token),
                recorded_at=recorded_at,
                reported_at=reported_at,
                rejected=rejected,
            )
            for record_json, rid, token, recorded_at, reported_at, rejected in rows
        ]

    def totals_sync(self) -> LedgerTotals:
        with self._lock:
            row = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0),"
                " COALESCE(SUM(completion_tokens), 0),"
                " COALESCE(SUM(finish_reason = 'error'), 0), COALESCE(SUM(finish_reason = 'cancelled'), 0),"
                " COALESCE(SUM(reported_at IS NOT NULL), 0), COALESCE(SUM(rejected IS NOT NULL), 0)"
                " FROM usage"
            ).fetchone()
        count, prompt, cached, completion, errors, cancelled, reported, rejected = row
        return LedgerTotals(
            usage=UsageTotals(
                requests=count,
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=completion,
                errors=errors,
                cancelled=cancelled,
            ),
            reported=reported,
            pending=count - reported - rejected,
            rejected=rejected,
        )

    def request_ids_since_sync(self, started_after: float) -> list[tuple[str, float]]:
        """(request id, started_at) of requests admitted after a time: seeds the replay cache on restart."""
        with self._lock:
            return self._db.execute(
                "SELECT request_id, started_at FROM usage WHERE started_at > ?", (started_after,)
            ).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()
