"""One SQLite database a service keeps its records in, and what makes a row in it durable, decided once.

The node's usage ledger and the reference tracker's ledger are each one of these with a schema and
queries of their own. Here: the file is its owner's only (0600 in a 0700 folder); the log is WAL and
every commit is synced (a row a caller was told is written survives a power cut: a receipt is
money); one connection, serialised by a lock (SQLite allows one writer anyway, and the lock lets
any thread use it); the async API's calls run in order on one writer thread (`SerialWorker`), so
the event loop never waits on the disk and a call, once started, completes even if its caller is
cancelled; and the log's checkpoints run on that thread too, never inside a commit (`sqlite_wal`).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from meshnet_gguf.common.private_files import private_dir, private_sqlite
from meshnet_gguf.common.serial_worker import SerialWorker
from meshnet_gguf.common.sqlite_wal import WalCheckpoints

# Another process (`meshnet-gguf usage`, a backup) may hold a lock briefly; wait rather than fail.
BUSY_TIMEOUT_S = 10.0

T = TypeVar("T")


class SqliteStore:
    """The database at `path`, created or brought up to date by `create` (run once, under the lock)."""

    def __init__(self, path: Path, *, thread_name: str, create: Callable[[sqlite3.Connection], None]) -> None:
        self.path = Path(path)
        private_dir(self.path.parent)
        private_sqlite(self.path)
        self.lock = threading.Lock()
        self.worker = SerialWorker(thread_name)
        self.db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        with self.lock:
            create(self.db)
        self.checkpoints = WalCheckpoints(self.db, self.lock, self.worker)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the writer thread, awaited."""
        result = await self.worker.run(fn, *args)
        self.checkpoints.after_call()
        return result

    def submit(self, fn: Callable[..., T], *args: object, at_next_turn: bool = False) -> asyncio.Future[T]:
        """`fn(*args)` handed to the writer thread without waiting for it (at the loop's next turn with
        `at_next_turn`); the future is done once it has run."""
        done = self.worker.submit(fn, *args, at_next_turn=at_next_turn)
        self.checkpoints.after_call()
        return done

    def write(self, sql: str, params: tuple[object, ...] = ()) -> int:
        """One statement, on the calling thread; the rows it changed."""
        with self.lock:
            return self.db.execute(sql, params).rowcount

    def read(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple]:
        """One query, on the calling thread; its rows."""
        with self.lock:
            return self.db.execute(sql, params).fetchall()

    def close(self) -> None:
        with self.lock:
            self.db.close()
        self.worker.stop()  # its thread ends after this call

    async def aclose(self) -> None:
        """Close from the event loop: after a checkpoint under way, on the writer thread, behind every call queued."""
        await self.checkpoints.settle()
        await self.worker.run(self.close)
