"""WAL checkpoints of a database whose rows may be written on the event loop, run on its writer thread.

SQLite copies the write-ahead log back into the database inside whichever commit takes the
log past its threshold (1,000 pages by default): ~10 ms for a 4.5 MB log on the 2-core dev
box (`PRAGMA wal_checkpoint` timed alone), far longer on a slow or busy disk. A row written
on the event loop must never be that commit, or every stream of the node stands still for it
(rows go to the writer thread today; a checkpoint there still holds every row queued behind it). So the connection never checkpoints by
itself (`wal_autocheckpoint=0`), and every CHECKPOINT_EVERY_CALLS calls through the async API
a passive checkpoint is handed to the writer thread, where only calls queued behind it wait.
The log then stays near its usual size and is overwritten from its start, which also keeps
each synced commit an overwrite rather than an append that grows the file (slower to sync).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading

from meshnet_gguf.common.serial_worker import SerialWorker

log = logging.getLogger(__name__)

# A request writes two or three rows (opened, maybe its prompt noted, settled) of a page or
# more each with its body: a checkpoint every this many calls keeps the log to a few MB.
CHECKPOINT_EVERY_CALLS = 200


class WalCheckpoints:
    """Turns the connection's own checkpoints off and runs them on `worker` instead; `after_call()`
    on the event loop after each call through the database's async API counts toward the next."""

    def __init__(
        self, db: sqlite3.Connection, lock: threading.Lock, worker: SerialWorker, every_calls: int = CHECKPOINT_EVERY_CALLS
    ) -> None:
        self._db, self._lock, self._worker, self._every = db, lock, worker, every_calls
        db.execute("PRAGMA wal_autocheckpoint=0")
        # Counted here rather than read from SQLite (`total_changes`): that read takes the
        # connection's mutex, which the writer thread holds for a whole synced write.
        self._calls = 0
        self._pending: asyncio.Task[None] | None = None
        self.done = 0

    def after_call(self) -> None:
        self._calls += 1
        if self._calls >= self._every and (self._pending is None or self._pending.done()):
            self._calls = 0
            self._pending = asyncio.get_running_loop().create_task(self._worker.run(self.checkpoint_sync))

    def checkpoint_sync(self) -> None:
        """A passive checkpoint: what no reader still needs goes into the database, and the log starts over."""
        try:
            with self._lock:
                self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            self.done += 1
        except sqlite3.ProgrammingError:
            pass  # the database closed first (closing checkpoints it anyway)
        except sqlite3.Error:  # the next one catches up; a commit never depends on it
            log.exception("WAL checkpoint failed")

    async def settle(self) -> None:
        """Wait for a checkpoint under way (before the database closes)."""
        if self._pending is not None:
            await asyncio.shield(self._pending)


__all__ = ["CHECKPOINT_EVERY_CALLS", "WalCheckpoints"]
