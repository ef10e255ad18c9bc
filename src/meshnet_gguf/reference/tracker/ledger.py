"""The reference tracker's SQLite ledger: routes it issued, what it counted, receipts nodes sent,
and the public key of every node that ever registered (so receipts verify after a tracker restart).

Like the node's ledger it is a `common/sqlite_store.SqliteStore` (the stdlib sqlite3 on its own
writer thread); it is a separate schema because the tracker shares only the wire contract with nodes.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from meshnet_gguf.common.sqlite_store import SqliteStore
from meshnet_gguf.contract.protocol import TrackerUsage, UsageAgreement, UsageCounts, UsageRecord

TRACKER_LEDGER_FILE = "tracker.sqlite3"
# The flag reason of a request answered by a node that later failed an audit (proof of model).
UNPROVEN_REASON = "model_unproven"

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
    flagged           INTEGER NOT NULL DEFAULT 0,
    prompt_ceiling    INTEGER,
    completion_ceiling INTEGER
);
-- Why a request was flagged, where a reason other than its own counts applies (`model_unproven`).
CREATE TABLE IF NOT EXISTS flag_reasons (
    request_id TEXT PRIMARY KEY,
    reason     TEXT NOT NULL
);
-- Proof of model: every decided audit (passed or failed; a no_verdict proves nothing and is not kept), so a
-- restarted tracker keeps each node's history, its counts, and a failed node unroutable.
CREATE TABLE IF NOT EXISTS audits (
    audit_id    TEXT PRIMARY KEY,
    node_id     TEXT NOT NULL,
    model       TEXT NOT NULL,
    outcome     TEXT NOT NULL,
    reason      TEXT NOT NULL,
    margin_nats REAL NOT NULL,
    issued_at   REAL NOT NULL,
    decided_at  REAL NOT NULL,
    -- The whole-answer figures a greedy audit carried (contract/model_proof.AnswerGaps), as the tracker counted them
    -- in the node's CUSUM: read back in order when the tracker starts, so a restart does not reset a node's drift.
    drift_gap_nats REAL NOT NULL DEFAULT 0,
    drift_tokens   INTEGER NOT NULL DEFAULT 0,
    -- The same over the values its evidence committed (contract/model_proof.VALUE_DRIFT): the node's other CUSUM.
    value_gap_nats REAL NOT NULL DEFAULT 0,
    value_tokens   INTEGER NOT NULL DEFAULT 0,
    value_weights  TEXT NOT NULL DEFAULT 'quantized'
);
CREATE INDEX IF NOT EXISTS audits_by_node ON audits (node_id, decided_at);
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
# Columns added to `audits` after it first shipped (proof of quant): a ledger written before gets them, zero.
_ADDED_AUDIT_COLUMNS = {
    "drift_gap_nats": "REAL NOT NULL DEFAULT 0",
    "drift_tokens": "INTEGER NOT NULL DEFAULT 0",
    "value_gap_nats": "REAL NOT NULL DEFAULT 0",
    "value_tokens": "INTEGER NOT NULL DEFAULT 0",
    "value_weights": "TEXT NOT NULL DEFAULT 'quantized'",
}
_ADDED_COLUMNS = {
    "max_tokens": "INTEGER",
    "choices": "INTEGER NOT NULL DEFAULT 1",
    "body_bytes": "INTEGER NOT NULL DEFAULT 0",
    "flagged": "INTEGER NOT NULL DEFAULT 0",
    "prompt_ceiling": "INTEGER",
    "completion_ceiling": "INTEGER",
}

Outcome = Literal["in_flight", "complete", "cancelled", "upstream_error", "refused", "timed_out", "interrupted"]


# Written (synced) while a request is forwarded, before its answer's first byte reaches the client.
_OPEN_FORWARDED = (
    "INSERT INTO forwarded (request_id, node_id, model, path, stream, issued_at, max_tokens, choices, body_bytes,"
    " prompt_ceiling) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


@dataclass(frozen=True)
class ForwardedRequest:
    request_id: str
    node_id: str
    model: str
    path: str
    max_tokens: int | None
    choices: int
    body_bytes: int


@dataclass(frozen=True)
class AuditRecord:
    """One decided audit as the ledger keeps it: `issued_at` is when the audited answer's route was issued."""

    audit_id: str
    node_id: str
    model: str
    outcome: str  # passed or failed
    reason: str
    margin_nats: float
    issued_at: float
    decided_at: float
    drift_gap_nats: float = 0.0  # the whole-answer figures counted in the node's CUSUM (0 tokens: none)
    drift_tokens: int = 0
    value_gap_nats: float = 0.0  # the same over the committed values (its other CUSUM)
    value_tokens: int = 0
    value_weights: str = "quantized"  # whose allowance they got (contract/model_proof.VALUE_DRIFTS)


# What a node earned, grouped by `columns`: its requests billed and their tokens, each figure of a receipt capped by
# the tracker's ceiling (a refused request bills nothing, one in flight or without a receipt or ceilings not yet).
_BILLED_SELECT = (
    "SELECT {columns}, count(*), SUM(MIN(c.prompt_tokens, r.prompt_ceiling)), SUM(MIN(c.completion_tokens, r.completion_ceiling))"
    " FROM forwarded r JOIN receipts c ON c.request_id = r.request_id"
    " WHERE r.outcome NOT IN ('refused', 'in_flight') AND r.prompt_ceiling IS NOT NULL"
    " AND r.completion_ceiling IS NOT NULL GROUP BY {columns}"
)


@dataclass(frozen=True)
class NodeEarnings:
    """A node's billed requests on this tracker, ever, and their tokens (`TrackerLedger.billed_by_node`)."""

    requests: int
    prompt_tokens: int
    completion_tokens: int

    @classmethod
    def summed(cls, parts: Iterable[NodeEarnings]) -> NodeEarnings:
        """Several earnings as one (a node's, from what it earned serving each of its models)."""
        listed = list(parts)
        return cls(sum(p.requests for p in listed), sum(p.prompt_tokens for p in listed), sum(p.completion_tokens for p in listed))


@dataclass(frozen=True)
class AuditTotals:
    passed: int
    failed: int
    last_passed_at: float  # the issue time of its last passed answer; 0 when none passed
    routed: int  # requests routed to the node, ever


class TrackerLedger:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        # Every node's and client's traffic: the operator's only, every row synced.
        self._store = SqliteStore(self.path, thread_name="tracker-ledger", create=_create)

    def close(self) -> None:
        self._store.close()

    # --- nodes ------------------------------------------------------------
    async def remember_node(self, node_id: str, public_key: str) -> None:
        await self._store.run(
            self._store.write,
            "INSERT OR IGNORE INTO nodes (node_id, public_key, first_seen) VALUES (?, ?, ?)",
            (node_id, public_key, time.time()),
        )

    async def node_key(self, node_id: str) -> str | None:
        rows = await self._store.run(self._store.read, "SELECT public_key FROM nodes WHERE node_id = ?", (node_id,))
        return rows[0][0] if rows else None

    # --- forwarded requests -----------------------------------------------
    def open_request_soon(
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
        prompt_ceiling: int | None = None,
    ) -> asyncio.Future[int]:
        """Hand the forwarded row to the writer thread now and return at once; the future is done once
        it is synced. Any receipt for the request is then recognisable, and checkable against what
        the route allowed (token cap, choices, body size, the prompt's ceiling). The request goes to
        its node meanwhile, and only the answer's first byte to the client waits for the future
        (protocol §6, rule 5): on the thread, so the synced write holds no forward on the loop."""
        # Handed over now, not at the loop's next turn as the node's row is: on the H200 the tracker's hop measured no
        # better deferred (1.11 ms p50 in one run against 0.71 and 0.81 without; bench/RESULTS.md, round 9c).
        return self._store.submit(
            self._store.write, _OPEN_FORWARDED,
            (request_id, node_id, model, path, int(stream), time.time(), max_tokens, choices, body_bytes, prompt_ceiling),
        )  # fmt: skip

    async def open_request(self, request_id: str, node_id: str, model: str, path: str, stream: bool, **limits: Any) -> None:
        """`open_request_soon`, awaited: the row is on disk when this returns."""
        await self.open_request_soon(request_id, node_id, model, path, stream, **limits)

    async def finish_request(
        self, request_id: str, status: int | None, outcome: Outcome, counts: UsageCounts | None, *, completion_ceiling: int | None = None
    ) -> None:
        counts = counts or UsageCounts()
        await self._store.run(
            self._store.write,
            "UPDATE forwarded SET status = ?, outcome = ?, prompt_tokens = ?, completion_tokens = ?, finished_at = ?,"
            " completion_ceiling = ? WHERE request_id = ?",
            (status, outcome, counts.prompt_tokens, counts.completion_tokens, time.time(), completion_ceiling, request_id),
        )

    async def settle_interrupted(self) -> list[str]:
        """Rows a previous run left `in_flight` (it died while forwarding): settled as `interrupted`, flagged, and
        bounded by what their routes allowed, so the receipt, when it comes, is billed within those bounds."""

        def settle() -> list[str]:
            with self._store.lock:
                rows = self._store.db.execute("SELECT request_id FROM forwarded WHERE outcome = 'in_flight'").fetchall()
                self._store.db.execute(
                    "UPDATE forwarded SET outcome = 'interrupted', flagged = 1, finished_at = ?,"
                    " completion_ceiling = COALESCE(max_tokens, 0) * choices WHERE outcome = 'in_flight'",
                    (time.time(),),
                )
            return [row[0] for row in rows]

        return await self._store.run(settle)

    async def forwarded(self, request_id: str) -> ForwardedRequest | None:
        rows = await self._store.run(
            self._store.read,
            "SELECT request_id, node_id, model, path, max_tokens, choices, body_bytes FROM forwarded WHERE request_id = ?",
            (request_id,),
        )
        return ForwardedRequest(*rows[0]) if rows else None

    async def mark_flagged(self, request_id: str) -> bool:
        """True the first time a request is flagged (so a node's flag count counts it once)."""
        changed = await self._store.run(
            self._store.write, "UPDATE forwarded SET flagged = 1 WHERE request_id = ? AND flagged = 0", (request_id,)
        )
        return changed == 1

    async def flag_unproven(self, node_id: str, since: float) -> int:
        """Flag the node's requests issued since `since` (its last passed audit) as `model_unproven`:
        they are not billed as the model they claimed. Returns how many were newly flagged."""

        def flag() -> int:
            with self._store.lock:
                self._store.db.execute("BEGIN IMMEDIATE")
                changed = self._flag_unproven(node_id, since)
                self._store.db.execute("COMMIT")
                return changed

        return await self._store.run(flag)

    def _flag_unproven(self, node_id: str, since: float) -> int:
        """Inside a transaction the caller holds (and the lock)."""
        self._store.db.execute(
            "INSERT OR IGNORE INTO flag_reasons (request_id, reason) SELECT request_id, ? FROM forwarded"
            " WHERE node_id = ? AND issued_at >= ?", (UNPROVEN_REASON, node_id, since),
        )  # fmt: skip
        return self._store.db.execute(
            "UPDATE forwarded SET flagged = 1 WHERE node_id = ? AND issued_at >= ? AND flagged = 0", (node_id, since)
        ).rowcount

    async def flag_reason(self, request_id: str) -> str | None:
        rows = await self._store.run(self._store.read, "SELECT reason FROM flag_reasons WHERE request_id = ?", (request_id,))
        return rows[0][0] if rows else None

    async def flags_by_node(self) -> dict[str, int]:
        rows = await self._store.run(self._store.read, "SELECT node_id, count(*) FROM forwarded WHERE flagged = 1 GROUP BY node_id", ())
        return {node_id: count for node_id, count in rows}

    # --- audits (proof of model) -------------------------------------------
    async def record_audit(self, audit: AuditRecord, *, flag_unproven_since: float | None = None) -> int:
        """Keep a decided audit; with `flag_unproven_since` (a failed one), flag the node's requests issued since
        then as `model_unproven` in the same transaction, so no restart keeps the one without the other.
        Returns how many requests were newly flagged."""

        def record() -> int:
            with self._store.lock:
                self._store.db.execute("BEGIN IMMEDIATE")
                try:
                    self._store.db.execute(
                        "INSERT OR IGNORE INTO audits (audit_id, node_id, model, outcome, reason, margin_nats, issued_at, decided_at,"
                        " drift_gap_nats, drift_tokens, value_gap_nats, value_tokens, value_weights)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (audit.audit_id, audit.node_id, audit.model, audit.outcome, audit.reason, audit.margin_nats,
                         audit.issued_at, audit.decided_at, audit.drift_gap_nats, audit.drift_tokens, audit.value_gap_nats,
                         audit.value_tokens, audit.value_weights),
                    )  # fmt: skip
                    changed = 0 if flag_unproven_since is None else self._flag_unproven(audit.node_id, flag_unproven_since)
                except BaseException:
                    self._store.db.execute("ROLLBACK")
                    raise
                self._store.db.execute("COMMIT")
                return changed

        return await self._store.run(record)

    async def audit_totals(self) -> dict[str, AuditTotals]:
        """Per node: its passed and failed audits, when the last passed answer was issued, and how many
        requests it was routed (for the new-node rate)."""

        def read() -> dict[str, AuditTotals]:
            with self._store.lock:
                rows = self._store.db.execute(
                    "SELECT node_id, SUM(outcome = 'passed'), SUM(outcome = 'failed'),"
                    " COALESCE(MAX(CASE WHEN outcome = 'passed' THEN issued_at END), 0) FROM audits GROUP BY node_id"
                ).fetchall()
                routed = dict(self._store.db.execute("SELECT node_id, count(*) FROM forwarded GROUP BY node_id").fetchall())
            return {
                node_id: AuditTotals(passed, failed, last_passed_at, routed.get(node_id, 0))
                for node_id, passed, failed, last_passed_at in rows
            }

        return await self._store.run(read)

    async def audit_drifts(self) -> dict[str, list[tuple[float, int, float, int, str, float]]]:
        """Per node, the whole-answer figures of its audits that carried some, in the order they were decided:
        (gap nats, tokens, value gap nats, value tokens, value weights, issue time), for the tracker to count its
        CUSUMs again when it starts."""
        rows = await self._store.run(
            self._store.read,
            "SELECT node_id, drift_gap_nats, drift_tokens, value_gap_nats, value_tokens, value_weights, issued_at FROM audits"
            " WHERE drift_tokens > 0 OR value_tokens > 0 ORDER BY decided_at, rowid",
            (),
        )
        out: dict[str, list[tuple[float, int, float, int, str, float]]] = {}
        for node_id, gap, tokens, value_gap, value_tokens, weights, issued_at in rows:
            out.setdefault(node_id, []).append(
                (float(gap), int(tokens), float(value_gap), int(value_tokens), str(weights), float(issued_at))
            )
        return out

    async def recent_audits(self, node_id: str | None = None, limit: int = 10) -> list[AuditRecord]:
        """The latest decided audits, newest first: of one node, or `limit` of each node."""
        where, params = ("WHERE node_id = ?", (node_id,)) if node_id else ("", ())
        rows = await self._store.run(
            self._store.read,
            "SELECT audit_id, node_id, model, outcome, reason, margin_nats, issued_at, decided_at FROM ("
            " SELECT *, ROW_NUMBER() OVER (PARTITION BY node_id ORDER BY decided_at DESC) AS nth FROM audits"
            f" {where}) WHERE nth <= ? ORDER BY decided_at DESC",
            (*params, limit),
        )
        return [AuditRecord(*row) for row in rows]

    # --- receipts -----------------------------------------------------------
    async def store_receipt(self, node_id: str, record: UsageRecord, token: str) -> bool:
        """False when a receipt for this request id is already stored (a resend): the first one stands."""
        inserted = await self._store.run(
            self._store.write,
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
    async def billed_by_node(self) -> dict[str, NodeEarnings]:
        """What each node earned here: its requests billed and their tokens, each figure of a receipt capped
        by the tracker's ceiling, as `billed` bills one request (a refused request bills nothing, one in
        flight or without a receipt or ceilings not yet). One pass over the ledger, like `usage_list`'s."""
        rows = await self._store.run(self._store.read, _BILLED_SELECT.format(columns="r.node_id"), ())
        return {node_id: NodeEarnings(requests, prompt or 0, completion or 0) for node_id, requests, prompt, completion in rows}

    async def billed_by_node_and_model(self) -> dict[str, dict[str, NodeEarnings]]:
        """`billed_by_node` by model too: node id -> the model each row was routed as (the node's own id for it,
        the one its receipt must name) -> what it earned serving that model."""
        rows = await self._store.run(self._store.read, _BILLED_SELECT.format(columns="r.node_id, r.model"), ())
        found: dict[str, dict[str, NodeEarnings]] = {}
        for node_id, model, requests, prompt, completion in rows:
            found.setdefault(node_id, {})[model] = NodeEarnings(requests, prompt or 0, completion or 0)
        return found

    async def usage(self, request_id: str) -> TrackerUsage | None:
        found = await self.usage_list(request_id=request_id)
        return found[0] if found else None

    async def usage_list(self, *, request_id: str | None = None, limit: int = 100) -> list[TrackerUsage]:
        where, params = ("WHERE r.request_id = ?", (request_id,)) if request_id else ("", ())
        rows = await self._store.run(
            self._store.read,
            "SELECT r.request_id, r.node_id, r.model, r.stream, r.status, r.outcome, r.prompt_tokens,"
            " r.completion_tokens, c.prompt_tokens, c.completion_tokens, c.finish_reason, c.request_id IS NOT NULL,"
            " r.prompt_ceiling, r.completion_ceiling, r.flagged"
            f" FROM forwarded r LEFT JOIN receipts c ON c.request_id = r.request_id {where}"
            " ORDER BY r.issued_at DESC LIMIT ?",
            (*params, limit),
        )
        return [_usage_row(row) for row in rows]


def _create(db: sqlite3.Connection) -> None:
    _rename_old_table(db)
    db.executescript(_SCHEMA)
    have = {row[1] for row in db.execute("PRAGMA table_info(forwarded)")}
    for column, kind in _ADDED_COLUMNS.items():
        if column not in have:
            db.execute(f"ALTER TABLE forwarded ADD COLUMN {column} {kind}")
    have = {row[1] for row in db.execute("PRAGMA table_info(audits)")}
    for column, kind in _ADDED_AUDIT_COLUMNS.items():
        if column not in have:
            db.execute(f"ALTER TABLE audits ADD COLUMN {column} {kind}")


def _rename_old_table(db: sqlite3.Connection) -> None:
    """Ledgers written before the table was named for what it holds (forwarded requests) keep their rows."""
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "relayed" in tables and "forwarded" not in tables:
        db.execute("ALTER TABLE relayed RENAME TO forwarded")


def _usage_row(row: tuple) -> TrackerUsage:
    (rid, node_id, model, stream, status, outcome, t_prompt, t_completion, n_prompt, n_completion, finish, has_receipt,
     prompt_ceiling, completion_ceiling, marked) = row  # fmt: skip
    tracker = UsageCounts(prompt_tokens=t_prompt, completion_tokens=t_completion)
    node = UsageCounts(prompt_tokens=n_prompt, completion_tokens=n_completion) if has_receipt else None
    ceiling = (
        UsageCounts(prompt_tokens=prompt_ceiling, completion_tokens=completion_ceiling)
        if prompt_ceiling is not None and completion_ceiling is not None
        else None
    )
    return TrackerUsage(
        billed=billed(outcome, ceiling, node),
        # A stream cut short (client gone, node broken, time limit) may leave tokens the node made but nobody saw:
        # billed within the ceiling all the same, flagged only when a finished answer claims more than went by.
        flagged=bool(marked) or (outcome == "complete" and disagrees(ceiling, node)),
        request_id=rid,
        node_id=node_id,
        model=model,
        stream=bool(stream),
        status=status,
        outcome=outcome,
        tracker=tracker,
        node=node,
        node_finish_reason=finish if has_receipt else None,
        agreement=agreement(ceiling, node),
        ceiling=ceiling,
    )


def billed(outcome: str, ceiling: UsageCounts | None, node: UsageCounts | None) -> UsageCounts | None:
    """What the tracker bills: the receipt, capped per figure by the tracker's ceiling (what the request could
    hold and what went by). A request the node refused (an error status before any answer) bills nothing; a
    request still forwarding, or without a receipt yet, or without ceilings (a row from an older tracker), None.
    """
    if outcome == "refused":
        return UsageCounts(prompt_tokens=0, completion_tokens=0)
    if node is None or outcome == "in_flight" or ceiling is None:
        return None
    return UsageCounts(
        prompt_tokens=min(node.prompt_tokens or 0, ceiling.prompt_tokens or 0),
        completion_tokens=min(node.completion_tokens or 0, ceiling.completion_tokens or 0),
    )


def disagrees(ceiling: UsageCounts | None, node: UsageCounts | None) -> bool:
    """The receipt claims more than the tracker's ceiling on either figure."""
    if node is None or ceiling is None:
        return False
    return (node.prompt_tokens or 0) > (ceiling.prompt_tokens or 0) or (node.completion_tokens or 0) > (ceiling.completion_tokens or 0)


def agreement(ceiling: UsageCounts | None, node: UsageCounts | None) -> UsageAgreement:
    if node is None:
        return "awaiting_receipt"
    if ceiling is None:
        return "unmetered"  # the forward has not finished (or the row predates ceilings)
    return "mismatch" if disagrees(ceiling, node) else "agree"
