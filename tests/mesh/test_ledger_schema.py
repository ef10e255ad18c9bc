"""A ledger an older node wrote on an operator's disk opens in the current schema, every row kept in its state."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from meshnet_gguf.contract.protocol import UsageRecord
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.ledger import LEDGER_FILE, RowState, UsageLedger

PATH = "/v1/chat/completions"
# Schema 3, in the statements the node ran before its columns were renamed (`route` -> `path`,
# `in_flight` -> `state`): the table of schema 1, the columns schemas 2 and 3 added, their indexes.
SCHEMA_3 = """
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
ALTER TABLE usage ADD COLUMN in_flight INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage ADD COLUMN route_expires_at REAL;
ALTER TABLE usage ADD COLUMN prompt_body BLOB;
DROP INDEX IF EXISTS usage_outbox;
CREATE INDEX IF NOT EXISTS usage_outbox2 ON usage (recorded_at) WHERE reported_at IS NULL AND rejected IS NULL AND in_flight = 0;
CREATE INDEX IF NOT EXISTS usage_in_flight ON usage (started_at) WHERE in_flight = 1;
CREATE INDEX IF NOT EXISTS usage_route_expiry ON usage (route_expires_at) WHERE route_expires_at IS NOT NULL;
PRAGMA user_version=3;
"""
# Schema 3's writes: a row opened before forwarding, a settled row, a row parked uncounted.
OPEN_ROW_3 = (
    "INSERT OR IGNORE INTO usage (request_id, recorded_at, started_at, model, route, status, stream,"
    " prompt_tokens, cached_tokens, completion_tokens, finish_reason, record_json, receipt,"
    " in_flight, route_expires_at, prompt_body)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, '', 1, ?, ?)"
)
SETTLED_ROW_3 = (
    "INSERT OR IGNORE INTO usage (request_id, recorded_at, started_at, model, route, status, stream,"
    " prompt_tokens, cached_tokens, completion_tokens, finish_reason, record_json, receipt)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
PARK_3 = "UPDATE usage SET in_flight = 2 WHERE request_id = ? AND in_flight = 1"


def record(rid: str, prompt: int = 42) -> UsageRecord:
    return UsageRecord(request_id=rid, route=PATH, model="tiny", status=200, stream=True, prompt_tokens=prompt,
                       completion_tokens=5, finish_reason="stop", started_at=time.time())  # fmt: skip


def columns(rec: UsageRecord) -> tuple[object, ...]:
    return (rec.request_id, time.time(), rec.started_at, rec.model, rec.route, rec.status, int(rec.stream),
            rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens, rec.finish_reason, rec.model_dump_json())  # fmt: skip


def schema_3_ledger(path: Path, identity: NodeIdentity) -> None:
    expires = time.time() + 50
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(SCHEMA_3)
    settled = record("req-settled")
    db.execute(SETTLED_ROW_3, (*columns(settled), identity.sign_receipt(settled).token))
    db.execute(OPEN_ROW_3, (*columns(record("req-open")), expires, b'{"messages": []}'))
    db.execute(OPEN_ROW_3, (*columns(record("req-counted")), expires, None))  # its count landed: the body dropped
    db.execute(OPEN_ROW_3, (*columns(record("req-parked")), expires, b'{"prompt": "x"}'))
    db.execute(PARK_3, ("req-parked",))
    db.close()


def test_a_schema_3_ledger_opens_with_its_columns_renamed_and_every_row_in_its_state(tmp_path: Path) -> None:
    identity = NodeIdentity.load_or_create(tmp_path / "id")
    path = tmp_path / LEDGER_FILE
    schema_3_ledger(path, identity)

    ledger = UsageLedger(path)
    try:
        assert [r.request_id for r in ledger.pending_sync(10)] == ["req-settled"]
        assert [e.record.route for e in ledger.entries_sync()] == [PATH]
        assert [r.request_id for r in ledger.open_counted_sync()] == ["req-counted"]
        assert {r.request_id: body for r, body in ledger.awaiting_count_sync()} == {
            "req-open": b'{"messages": []}', "req-parked": b'{"prompt": "x"}'
        }  # fmt: skip
        assert {rid for rid, _ in ledger.unexpired_routes_sync(time.time())} == {"req-open", "req-counted", "req-parked"}
        # The upgraded ledger goes on as a new one: a row settled, a row opened.
        assert ledger.add_sync(record("req-open"), identity.sign_receipt(record("req-open")))
        assert ledger.open_request_sync(record("req-new"), time.time() + 30, b"{}")
    finally:
        ledger.close()

    with sqlite3.connect(path) as db:
        names = {row[1] for row in db.execute("PRAGMA table_info(usage)")}
        rows = dict(db.execute("SELECT request_id, state FROM usage").fetchall())
        paths = {p for (p,) in db.execute("SELECT path FROM usage")}
        indexes = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"state", "path"} <= names and not {"in_flight", "route"} & names
    assert rows == {
        "req-settled": RowState.SETTLED, "req-open": RowState.SETTLED, "req-counted": RowState.OPEN,
        "req-parked": RowState.PARKED, "req-new": RowState.OPEN,
    }  # fmt: skip
    assert paths == {PATH}
    assert {"usage_pending", "usage_open"} <= indexes and not {"usage_outbox2", "usage_in_flight"} & indexes

    UsageLedger(path).close()  # opening it again changes nothing
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM usage").fetchone()[0] == len(rows)
        assert db.execute("PRAGMA user_version").fetchone()[0] == 4
