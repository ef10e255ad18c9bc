"""The node's usage ledger: one SQLite row per request id, with its signed receipt and outbox state.

The ledger owns the database; everyone else asks through `UsageLedger`. The database is a
`common/sqlite_store.SqliteStore`: each call runs the stdlib `sqlite3` on the ledger's own
thread, so the event loop never waits on the disk, and a call, once started, completes even
if its caller is cancelled: a row is written whole or not at all.

A row is *opened* (`state` OPEN, no receipt yet) as the request is
forwarded, and synced before the answer's first byte leaves the node, with what is known then: until when the route that paid for it
stays valid, and the request's body (`prompt_body`), from which its prompt can be
counted. That row is what refuses a replayed route after a restart, and what bills
a request the node was killed in the middle of. The prompt is counted beside the
generation; the count is *noted* in the row (and the body dropped) before the
answer's first byte leaves the node. That write need not reach the platter: were it
lost, the body is still on disk and is counted again. The row is *settled*
(`state` SETTLED, receipt set) when the request ends, or, for a row a crash left
open, when the node starts again: at once when its count is in the row, else once
llama-server can count the body. A request that ended without its prompt counted
(llama-server went away between forwarding and the count) is *parked* (`state`
PARKED, its final record in, its body kept) until llama-server counts the body.

A settled row is *pending* until the tracker acknowledges it (`reported_at` set)
or refuses it for good (`rejected` set). Pending rows are the outbox; they live
in the database, so a kill -9 or an hours-long tracker outage loses nothing.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from meshnet_gguf.common.sqlite_store import SqliteStore
from meshnet_gguf.contract.protocol import UsageReceipt, UsageRecord, UsageTotals

LEDGER_FILE = "usage.sqlite3"
SCHEMA_VERSION = 4


class RowState(IntEnum):
    """Where a request's row stands: the `state` column (integers on disk, as schema 3's `in_flight` held them)."""

    SETTLED = 0  # the request ended: receipt set, in the outbox until reported or rejected
    OPEN = 1  # written before forwarding: no receipt yet
    PARKED = 2  # ended before its prompt was counted: final record in, body kept until it is


# A new ledger's table; an older one is brought to it by `_upgrade`.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id        TEXT PRIMARY KEY,
    recorded_at       REAL NOT NULL,
    started_at        REAL NOT NULL,
    model             TEXT NOT NULL,
    path              TEXT NOT NULL,
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
"""
# Renamed in schema 4, old name -> new: `route` held the request's HTTP path (beside
# `route_expires_at`, the signed route's), and `in_flight` held three states, not a flag.
_RENAMED_V4 = {"route": "path", "in_flight": "state"}
# Added in schemas 2 and 3 (an older ledger gains them in place; schema 1's rows are all settled).
_COLUMNS_V2 = {
    "state": f"INTEGER NOT NULL DEFAULT {RowState.SETTLED:d}",
    "route_expires_at": "REAL",
    # The request body of an open row whose prompt is not counted yet; NULL once counted or settled.
    "prompt_body": "BLOB",
}
_OUTBOX = f"reported_at IS NULL AND rejected IS NULL AND state = {RowState.SETTLED:d}"
# The partial indexes' conditions are the queries' own, so the planner uses them.
_INDEXES = f"""
DROP INDEX IF EXISTS usage_outbox;
DROP INDEX IF EXISTS usage_outbox2;
DROP INDEX IF EXISTS usage_in_flight;
CREATE INDEX IF NOT EXISTS usage_pending ON usage (recorded_at) WHERE {_OUTBOX};
CREATE INDEX IF NOT EXISTS usage_open ON usage (started_at) WHERE state = {RowState.OPEN:d};
CREATE INDEX IF NOT EXISTS usage_route_expiry ON usage (route_expires_at) WHERE route_expires_at IS NOT NULL;
"""
# The open row, written (synced) while the request is forwarded, before its answer's first byte leaves.
_OPEN_ROW = (
    "INSERT OR IGNORE INTO usage (request_id, recorded_at, started_at, model, path, status, stream,"
    " prompt_tokens, cached_tokens, completion_tokens, finish_reason, record_json, receipt,"
    " state, route_expires_at, prompt_body)"
    f" VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, '', {RowState.OPEN:d}, ?, ?)"
)
_OPEN = f"state = {RowState.OPEN:d}"
_SETTLED = f"state = {RowState.SETTLED:d}"


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
        # What the node served and earned: its owner's only, every row synced (a receipt is money).
        self._store = SqliteStore(self.path, thread_name="usage-ledger", create=_create)

    @classmethod
    def in_state_dir(cls, state_dir: Path) -> UsageLedger:
        return cls(Path(state_dir) / LEDGER_FILE)

    # --- async API (what the node uses) -------------------------------------------
    def open_request_soon(
        self, record: UsageRecord, route_expires_at: float | None, prompt_body: bytes | None = None
    ) -> asyncio.Future[bool]:
        """Hand the open row to the writer thread at the loop's next turn (once the caller has sent the request on)
        and return at once: the future is done (True, or False when the id is already there) once the row is synced.

        The request is forwarded meanwhile (protocol §6, rule 1): the row is written beside
        llama-server's prefill rather than before it, and only the answer's first byte waits for
        the future. On the thread, not the loop: a synced write on the loop would hold the forward
        (and every other stream) for the whole sync."""
        return self._store.submit(self.open_request_sync, record, route_expires_at, prompt_body, at_next_turn=True)

    async def open_request(self, record: UsageRecord, route_expires_at: float | None, prompt_body: bytes | None = None) -> bool:
        """`open_request_soon`, awaited: the row is on disk when this returns."""
        return await self.open_request_soon(record, route_expires_at, prompt_body)

    async def note_prompt(self, request_id: str, prompt_tokens: int) -> bool:
        """The prompt's count, into its open row (whose body is then dropped)."""
        return await self._store.run(self.note_prompt_sync, request_id, prompt_tokens)

    async def add(self, record: UsageRecord, receipt: UsageReceipt) -> bool:
        """Store a request's usage; False when its request id is already there (the first row wins)."""
        return await self._store.run(self.add_sync, record, receipt)

    async def pending(self, limit: int) -> list[UsageReceipt]:
        """Oldest receipts not yet acknowledged nor rejected."""
        return await self._store.run(self.pending_sync, limit)

    async def mark_reported(self, request_ids: Iterable[str], at: float | None = None) -> int:
        return await self._store.run(self.mark_reported_sync, list(request_ids), at)

    async def mark_rejected(self, rejections: Iterable[tuple[str, str]]) -> int:
        """`(request_id, reason)` pairs the tracker refused for good; they leave the outbox."""
        return await self._store.run(self.mark_rejected_sync, list(rejections))

    async def entries(self, limit: int = 50, pending_only: bool = False) -> list[LedgerEntry]:
        return await self._store.run(self.entries_sync, limit, pending_only)

    async def totals(self) -> LedgerTotals:
        return await self._store.run(self.totals_sync)

    async def request_ids_since(self, started_after: float) -> list[tuple[str, float]]:
        return await self._store.run(self.request_ids_since_sync, started_after)

    async def aclose(self) -> None:
        await self._store.aclose()

    # --- sync API (worker threads, the CLI) --------------------------------------
    def open_request_sync(self, record: UsageRecord, route_expires_at: float | None, prompt_body: bytes | None = None) -> bool:
        with self._store.lock:
            return self._store.db.execute(_OPEN_ROW, (*_record_columns(record), route_expires_at, prompt_body)).rowcount == 1

    def note_prompt_sync(self, request_id: str, prompt_tokens: int) -> bool:
        """Not synced to the platter (see the module doc): the body stays durable until a synced write follows."""
        with self._store.lock:
            row = self._store.db.execute(f"SELECT record_json FROM usage WHERE request_id = ? AND {_OPEN}", (request_id,)).fetchone()
            if row is None:
                return False
            record = UsageRecord.model_validate_json(row[0]).model_copy(update={"prompt_tokens": prompt_tokens})
            self._store.db.execute("PRAGMA synchronous=NORMAL")
            try:
                cursor = self._store.db.execute(
                    f"UPDATE usage SET prompt_tokens = ?, record_json = ?, prompt_body = NULL WHERE request_id = ? AND {_OPEN}",
                    (prompt_tokens, record.model_dump_json(), request_id),
                )
            finally:
                self._store.db.execute("PRAGMA synchronous=FULL")
            return cursor.rowcount == 1

    def open_counted_sync(self) -> list[UsageRecord]:
        """Records of requests opened but never settled whose prompt count is in the row: a previous run
        died while they ran."""
        with self._store.lock:
            rows = self._store.db.execute(
                f"SELECT record_json FROM usage WHERE {_OPEN} AND prompt_body IS NULL ORDER BY started_at"
            ).fetchall()
        return [UsageRecord.model_validate_json(r[0]) for r in rows]

    def awaiting_count_sync(self) -> list[tuple[UsageRecord, bytes]]:
        """Rows (open or parked) a previous run left before their prompt was counted: each record with its request body."""
        with self._store.lock:
            rows = self._store.db.execute(
                f"SELECT record_json, prompt_body FROM usage WHERE NOT {_SETTLED} AND prompt_body IS NOT NULL ORDER BY started_at"
            ).fetchall()
        return [(UsageRecord.model_validate_json(record_json), bytes(body)) for record_json, body in rows]

    async def park(self, record: UsageRecord) -> bytes | None:
        """A request ended before its prompt was counted: keep its row (final record in) with its
        body, to be settled once counted. Returns the body; None when the row has none (counted)."""
        return await self._store.run(self.park_sync, record)

    def park_sync(self, record: UsageRecord) -> bytes | None:
        with self._store.lock:
            row = self._store.db.execute(
                f"SELECT prompt_body FROM usage WHERE request_id = ? AND {_OPEN} AND prompt_body IS NOT NULL",
                (record.request_id,),
            ).fetchone()
            if row is None:
                return None
            self._store.db.execute(
                f"UPDATE usage SET record_json = ?, status = ?, completion_tokens = ?, finish_reason = ?, state = {RowState.PARKED:d}"
                f" WHERE request_id = ? AND {_OPEN}",
                (record.model_dump_json(), record.status, record.completion_tokens, record.finish_reason, record.request_id),
            )
            return bytes(row[0])

    def add_sync(self, record: UsageRecord, receipt: UsageReceipt) -> bool:
        """Settle a request: its open row if it has one, else a new row. False when it is already settled."""
        if receipt.request_id != record.request_id:
            raise ValueError(f"receipt {receipt.request_id} does not belong to record {record.request_id}")
        with self._store.lock:
            cursor = self._store.db.execute(
                "UPDATE usage SET recorded_at = ?, started_at = ?, model = ?, path = ?, status = ?, stream = ?,"
                " prompt_tokens = ?, cached_tokens = ?, completion_tokens = ?, finish_reason = ?, record_json = ?,"
                f" receipt = ?, {_SETTLED}, prompt_body = NULL WHERE request_id = ? AND NOT {_SETTLED}",
                (*_record_columns(record)[1:], receipt.token, record.request_id),
            )
            if cursor.rowcount == 1:
                return True
            cursor = self._store.db.execute(
                "INSERT OR IGNORE INTO usage (request_id, recorded_at, started_at, model, path, status, stream,"
                " prompt_tokens, cached_tokens, completion_tokens, finish_reason, record_json, receipt)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (*_record_columns(record), receipt.token),
            )
            return cursor.rowcount == 1

    def outbox_depth_sync(self) -> int:
        """Receipts recorded but not yet acknowledged or rejected by the tracker."""
        with self._store.lock:
            (count,) = self._store.db.execute(f"SELECT COUNT(*) FROM usage WHERE {_OUTBOX}").fetchone()
        return int(count)

    def pending_sync(self, limit: int) -> list[UsageReceipt]:
        with self._store.lock:
            rows = self._store.db.execute(
                f"SELECT request_id, receipt FROM usage WHERE {_OUTBOX} ORDER BY recorded_at, rowid LIMIT ?",
                (limit,),
            ).fetchall()
        return [UsageReceipt(request_id=rid, token=token) for rid, token in rows]

    def mark_reported_sync(self, request_ids: list[str], at: float | None = None) -> int:
        stamp = time.time() if at is None else at
        with self._store.lock:
            cursor = self._store.db.executemany(
                "UPDATE usage SET reported_at = ? WHERE request_id = ? AND reported_at IS NULL",
                [(stamp, rid) for rid in request_ids],
            )
            return cursor.rowcount

    def mark_rejected_sync(self, rejections: list[tuple[str, str]]) -> int:
        with self._store.lock:
            cursor = self._store.db.executemany(
                "UPDATE usage SET rejected = ? WHERE request_id = ? AND reported_at IS NULL",
                [(reason, rid) for rid, reason in rejections],
            )
            return cursor.rowcount

    def entries_sync(self, limit: int = 50, pending_only: bool = False) -> list[LedgerEntry]:
        where = f"WHERE {_OUTBOX}" if pending_only else f"WHERE {_SETTLED}"
        with self._store.lock:
            rows = self._store.db.execute(
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
        with self._store.lock:
            row = self._store.db.execute(
                "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0),"
                " COALESCE(SUM(completion_tokens), 0),"
                " COALESCE(SUM(finish_reason = 'error'), 0), COALESCE(SUM(finish_reason = 'cancelled'), 0),"
                " COALESCE(SUM(reported_at IS NOT NULL), 0), COALESCE(SUM(rejected IS NOT NULL), 0)"
                f" FROM usage WHERE {_SETTLED}"
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
        """(request id, started_at) of requests admitted after a time."""
        with self._store.lock:
            return self._store.db.execute("SELECT request_id, started_at FROM usage WHERE started_at > ?", (started_after,)).fetchall()

    def unexpired_routes_sync(self, now: float) -> list[tuple[str, float]]:
        """(request id, route expiry) of every route that could still be presented: seeds the
        replay cache on restart. Rows are opened before forwarding, so this holds every
        route ever forwarded, including the ones a crash cut short."""
        with self._store.lock:
            return self._store.db.execute("SELECT request_id, route_expires_at FROM usage WHERE route_expires_at > ?", (now,)).fetchall()

    def close(self) -> None:
        self._store.close()


def _create(db: sqlite3.Connection) -> None:
    db.executescript(_SCHEMA)
    _upgrade(db)
    db.executescript(_INDEXES)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")


def _upgrade(db: sqlite3.Connection) -> None:
    """Bring a ledger an older version made to this schema, in place, its rows kept."""
    present = {row[1] for row in db.execute("PRAGMA table_info(usage)")}
    for old, new in _RENAMED_V4.items():
        if old in present and new not in present:
            db.execute(f"ALTER TABLE usage RENAME COLUMN {old} TO {new}")
    present = {row[1] for row in db.execute("PRAGMA table_info(usage)")}
    for column, decl in _COLUMNS_V2.items():
        if column not in present:
            db.execute(f"ALTER TABLE usage ADD COLUMN {column} {decl}")


def _record_columns(record: UsageRecord) -> tuple[object, ...]:
    """(request_id, recorded_at, started_at, model, path, status, stream, prompt, cached, completion,
    finish_reason, record_json), in the table's column order (the record's `route` is its HTTP path)."""
    return (
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
    )
