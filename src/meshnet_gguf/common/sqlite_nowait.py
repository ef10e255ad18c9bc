"""SQLite statements made on the event loop without ever waiting for a lock.

A database that `SerialWorker.run_inline_when_quick` writes on the event loop is shared with
its writer thread (a `threading.Lock`) and possibly with other processes (SQLite's write lock:
`meshnet-gguf usage` opening the ledger, a backup). Waiting for either would stall every task
on the loop, for up to the connection's busy timeout; this raises `WouldBlock` instead, and the
statements are made on the thread, where waiting is harmless.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from typing import TypeVar

from meshnet_gguf.common.serial_worker import WouldBlock

T = TypeVar("T")


def run_without_waiting(db: sqlite3.Connection, lock: threading.Lock, statements: Callable[[], T], busy_timeout_ms: int) -> T:
    """`statements()` (which uses `db`, an autocommit connection) under `lock`, or `WouldBlock` at once
    when `lock` or SQLite's write lock is held; `busy_timeout_ms` is the connection's own, restored after.
    A statement that raised `WouldBlock` wrote nothing; those before it did, so `statements` must be
    safe to run again whole on the thread (each one idempotent, or the first to write the last)."""
    if not lock.acquire(blocking=False):
        raise WouldBlock("the database is in use by another thread")
    try:
        db.execute("PRAGMA busy_timeout = 0")
        try:
            return statements()
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


def execute_without_waiting(
    db: sqlite3.Connection, lock: threading.Lock, sql: str, params: tuple[object, ...], busy_timeout_ms: int
) -> sqlite3.Cursor:
    """`db.execute(sql, params)` made as `run_without_waiting` makes its statements."""
    return run_without_waiting(db, lock, lambda: db.execute(sql, params), busy_timeout_ms)


__all__ = ["execute_without_waiting", "run_without_waiting"]
