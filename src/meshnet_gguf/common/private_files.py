"""Directories and files only their owner may read: state dirs (0700), ledgers and keys (0600).

A node's ledger says what it served and earned; a tracker's says what every node
and client did. Neither is for the other users of the machine.
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
# SQLite's companions of a database file (WAL mode); SQLite gives new ones the database file's mode.
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")


def private_dir(path: Path) -> Path:
    """Make `path` (and missing parents) and leave it 0700, whatever the umask or an earlier run left."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    os.chmod(path, PRIVATE_DIR_MODE)
    return path


def private_sqlite(path: Path) -> Path:
    """Create the database file 0600 before SQLite opens it (and tighten one an earlier run left wider)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    os.close(fd)
    for candidate in (path, *(path.with_name(path.name + suffix) for suffix in SQLITE_COMPANIONS)):
        if candidate.exists():
            os.chmod(candidate, PRIVATE_FILE_MODE)
    return path


__all__ = ["PRIVATE_DIR_MODE", "PRIVATE_FILE_MODE", "private_dir", "private_sqlite"]
