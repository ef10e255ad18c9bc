"""The reference tracker's SQLite ledger: routes it issued, what it counted, receipts nodes sent,
and the public key of every node that ever registered (so receipts verify after a tracker restart).

Like the node's ledger it runs the stdlib sqlite3 in worker threads; it is a
separate schema because the tracker shares only the wire contract with nodes.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import anyio

from meshnet_gguf.contract.protocol import TrackerUsage, UsageAgreement, UsageCounts, UsageRecord

TRACKER_LEDGER_FILE = "tracker.sqlite3"
BUSY_TIMEOUT_S = 10.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id     TEXT PRIMARY KEY,
    public_key  TEXT NOT NULL,
    first_seen  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS forwarded (
    request_id        TEXT PRIMARY KEY,
    node_id           TEXT NOT NULL,
    model             TEXT NOT NULL,
    path              TEXT NOT NULL,
    stream            INTEGER NOT NULL,
    issued_at         REAL NOT NULL,
    status            INTEGER,
    outcome           TEXT NOT NULL DEFAULT 'in_flight',
    prompt_tokens     INTEGER,
    completion_tokens INTEGER,
    finished_at       REAL,
    max_tokens        INTEGER,
    choices           INTEGER NOT NULL DEFAULT 1,
    body_bytes        INTEGER NOT NULL DEFAULT 0,
    flagged           INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS receipts (
    request_id        TEXT PRIMARY KEY,
    node_id           TEXT NOT NULL,
    received_at       REAL NOT NULL,
    prompt_tokens     INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    finish_reason     TEXT NOT NULL,
    record_json       TEXT NOT NULL,
    token             TEXT NOT NULL
);
"""

# Columns added after the first schema; a ledger from an older run gets them on open.
_ADDED_COLUMNS = {
    "max_tokens": "INTEGER",
    "choices": "INTEGER NOT NULL DEFAULT 1",
    "body_bytes": "INTEGER NOT NULL DEFAULT 0",
    "flagged": "INTEGER NOT NULL DEFAULT 0",
}

# An honest node and the tracker read the same llama-server usage, so they agree exactly on a
# finished request; a request cut short may differ by the token in flight. Beyond this, flag it.
RECEIPT_TOLERANCE_TOKENS = 2
RECEIPT_TOLERANCE_FRACTION = 0.02

Outcome = Literal["in_flight", "complete", "cancelled", "upstream_error", "refused", "timed_out"]
T = TypeVar("T")


@dataclass(frozen=True)
class ForwardedRequest:
    request_id: str
    node_id: str
    model: str
    path: str
    max_tokens: int | None
    choices: int
    body_bytes: int


class TrackerLedger:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        with self._lock:
            _rename_old_table(self._db)
            self._db.executescript(_SCHEMA)
            have = {row[1] for row in self._db.execute("PRAGMA table_info(forwarded)")}
            for column, kind in _ADDED_COLUMNS.items():
                if column not in have:
                    self._db.execute(f"ALTER TABLE forwarded ADD COLUMN {column} {kind}")

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await anyio.to_thread.run_sync(fn, *args)

    def _write(self, sql: str, params: tuple[object, ...]) -> int:
        with self._lock:
            return self._db.execute(sql, params).rowcount

    def _read(self, sql: str, params: tuple[object, ...]) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    # --- nodes ------------------------------------------------------------
    async def remember_node(self, node_id: str, public_key: str) -> None:
        await self._run(
            self._write,
            "INSERT OR IGNORE INTO nodes (node_id, public_key, first_seen) VALUES (?, ?, ?)",
            (node_id, public_key, time.time()),
        )

    async def node_key(self, node_id: str) -> str | None:
        rows = await self._run(self._read, "SELECT public_key FROM nodes WHERE node_id = ?", (node_id,))
        return rows[0][0] if rows else None

    # --- forwarded requests -----------------------------------------------
    async def open_request(
        self,
        request_id: str,
        node_id: str,
        model: str,
        path: str,
        stream: bool,
        *,
        max_tokens: int | None = None,
        choices: int = 1,
        body_bytes: int = 0,
    ) -> None:
        """Written before the request is forwarded: any receipt for it is then recognisable, and
        checkable against what the route allowed (token cap, choices, body size)."""
        await self._run(
            self._write,
            "INSERT INTO forwarded (request_id, node_id, model, path, stream, issued_at, max_tokens, choices, body_bytes)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (request_id, node_id, model, path, int(stream), time.time(), max_tokens, choices, body_bytes),
        )

    async def finish_request(self, request_id: str, status: int | None, outcome: Outcome, counts: UsageCounts | None) -> None:
        counts = counts or UsageCounts()
        await self._run(
            self._write,
            "UPDATE forwarded SET status = ?, outcome = ?, prompt_tokens = ?, completion_tokens = ?, finished_at = ?"
            " WHERE request_id = ?",
            (status, outcome, counts.prompt_tokens, counts.completion_tokens, time.time(), request_id),
        )

    async def forwarded(self, request_id: str) -> ForwardedRequest | None:
        rows = await self._run(
            self._read,
            "SELECT request_id, node_id, model, path, max_tokens, choices, body_bytes FROM forwarded WHERE request_id = ?",
            (request_id,),
        )
        return ForwardedRequest(*rows[0]) if rows else None

    async def mark_flagged(self, request_id: str) -> bool:
        """True the first time a request is flagged (so a node's flag count counts it once)."""
        changed = await self._run(self._write, "UPDATE forwarded SET flagged = 1 WHERE request_id = ? AND flagged = 0", (request_id,))
        return changed == 1

    async def flags_by_node(self) -> dict[str, int]:
        rows = await self._run(self._read, "SELECT node_id, count(*) FROM forwarded WHERE flagged = 1 GROUP BY node_id", ())
        return {node_id: count for node_id, count in rows}

    # --- receipts -----------------------------------------------------------
    async def store_receipt(self, node_id: str, record: UsageRecord, token: str) -> bool:
        """False when a receipt for this request id is already stored (a resend): the first one stands."""
        inserted = await self._run(
            self._write,
            "INSERT OR IGNORE INTO receipts (request_id, node_id, received_at, prompt_tokens, completion_tokens,"
            " finish_reason, record_json, token) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                record.request_id,
                node_id,
                time.time(),
                record.prompt_tokens,
                record.completion_tokens,
                record.finish_reason,
                record.model_dump_json(),
                token,
            ),
        )
        return inserted == 1

    # --- reading ------------------------------------------------------------
    async def usage(self, request_id: str) -> TrackerUsage | None:
        found = await self.usage_list(request_id=request_id)
        return found[0] if found else None

    async def usage_list(self, *, request_id: str | None = None, limit: int = 100) -> list[TrackerUsage]:
        where, params = ("WHERE r.request_id = ?", (request_id,)) if request_id else ("", ())
        rows = await self._run(
            self._read,
            "SELECT r.request_id, r.node_id, r.model, r.stream, r.status, r.outcome, r.prompt_tokens,"
            " r.completion_tokens, c.prompt_tokens, c.completion_tokens, c.finish_reason, c.request_id IS NOT NULL"
            f" FROM forwarded r LEFT JOIN receipts c ON c.request_id = r.request_id {where}"
            " ORDER BY r.issued_at DESC LIMIT ?",
            (*params, limit),
        )
        return [_usage_row(row) for row in rows]


def _rename_old_table(db: sqlite3.Connection) -> None:
    """Ledgers written before the table was named for what it holds (forwarded requests) keep their rows."""
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "relayed" in tables and "forwarded" not in tables:
        db.execute("ALTER TABLE relayed RENAME TO forwarded")


def _usage_row(row: tuple) -> TrackerUsage:
    rid, node_id, model, stream, status, outcome, t_prompt, t_completion, n_prompt, n_completion, finish, has_receipt = row
    tracker = UsageCounts(prompt_tokens=t_prompt, completion_tokens=t_completion)
    node = UsageCounts(prompt_tokens=n_prompt, completion_tokens=n_completion) if has_receipt else None
    return TrackerUsage(
        billed=billed(outcome, tracker, node),
        flagged=disagrees(tracker, node),
        request_id=rid,
        node_id=node_id,
        model=model,
        stream=bool(stream),
        status=status,
        outcome=outcome,
        tracker=tracker,
        node=node,
        node_finish_reason=finish if has_receipt else None,
        agreement=agreement(tracker, node),
    )


def billed(outcome: str, tracker: UsageCounts, node: UsageCounts | None) -> UsageCounts | None:
    """What the tracker bills: per field the smaller of its own count and the receipt.

    A figure the tracker could not count (the forward was cut before any count passed) comes from
    the receipt alone, which was already checked against what the route allowed. A request the
    node refused (an error status before any answer) bills nothing. None until both sides are in.
    """
    if outcome == "refused":
        return UsageCounts(prompt_tokens=0, completion_tokens=0)
    if node is None or outcome == "in_flight":
        return None

    def smaller(ours: int | None, theirs: int | None) -> int:
        return min(ours, theirs or 0) if ours is not None else (theirs or 0)

    return UsageCounts(
        prompt_tokens=smaller(tracker.prompt_tokens, node.prompt_tokens),
        completion_tokens=smaller(tracker.completion_tokens, node.completion_tokens),
    )


def disagrees(tracker: UsageCounts, node: UsageCounts | None) -> bool:
    """Tracker count and receipt differ by more than the tolerance on either figure."""
    if node is None:
        return False
    for ours, theirs in ((tracker.prompt_tokens, node.prompt_tokens), (tracker.completion_tokens, node.completion_tokens)):
        if ours is None or theirs is None:
            continue
        allowed = max(RECEIPT_TOLERANCE_TOKENS, RECEIPT_TOLERANCE_FRACTION * max(ours, theirs))
        if abs(ours - theirs) > allowed:
            return True
    return False


def agreement(tracker: UsageCounts, node: UsageCounts | None) -> UsageAgreement:
    if node is None:
        return "awaiting_receipt"
    if tracker.prompt_tokens is None or tracker.completion_tokens is None:
        return "unmetered"  # the forward was cut before any count passed; the receipt is the only figure
    same = (tracker.prompt_tokens, tracker.completion_tokens) == (node.prompt_tokens, node.completion_tokens)
    return "agree" if same else "mismatch"



