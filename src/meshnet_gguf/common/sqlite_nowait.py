"""One SQLite statement made on the event loop without ever waiting for a lock.

A database that `SerialWorker.run_inline_when_quick` writes on the event loop is shared with
its writer thread (a `threading.Lock`) and possibly with other processes (SQLite's write lock:
`meshnet-gguf usage` opening the ledger, a backup). Waiting for either would stall every task
on the loop, for up to the connection's busy timeout; this raises `WouldBlock` instead, and the
statement is made on the thread, where waiting is harmless.
"""

from __future__ import annotations

import sqlite3
import threading

from meshnet_gguf.common.serial_worker import WouldBlock


def execute_without_waiting(
    db: sqlite3.Connection, lock: threading.Lock, sql: str, params: tuple[object, ...], busy_timeout_ms: int
) -> sqlite3.Cursor:
    """`db.execute(sql, params)` under `lock` (an autocommit connection), or `WouldBlock` at once when
    `lock` or SQLite's write lock is held; `busy_timeout_ms` is the connection's own, restored after."""
    if not lock.acquire(blocking=False):
        raise WouldBlock("the database is in use by another thread")
    try:
        db.execute("PRAGMA busy_timeout = 0")
        try:
            return db.execute(sql, params)
        except sqlite3.OperationalError as exc:
            if db.in_transaction:
                db.rollback()
            if "locked" in str(exc) or "busy" in str(exc):
                raise WouldBlock(str(exc)) from exc
            raise
        finally:
            db.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
    finally:
        lock.release()


__all__ = ["execute_without_waiting"]
