"""One node per state directory.

A state directory holds one node's identity, billing ledger and llama-server
pidfile. Two nodes sharing one would share an identity and a ledger, and each
would take the other's llama-server for a leftover of a crashed run. So a node
holds an exclusive lock on `node.lock` in its state directory for its whole
life. The lock is an `flock`, which the kernel drops when the process dies in
any way, so a crash never leaves a stale lock behind. The file's content says
who holds it (pid, address), for the refusal message.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from meshnet_gguf.common.private_files import private_dir
from meshnet_gguf.contract.node_part import BasePart

LOCK_FILE_NAME = "node.lock"


class StateDirInUse(RuntimeError):
    """Another live node holds this state directory; the message names it and the fix."""


@dataclass(frozen=True)
class LockHolder:
    pid: int | None
    host: str | None
    port: int | None

    def describe(self) -> str:
        where = f", listening on {self.host}:{self.port}" if self.port is not None else ""
        return f"pid {self.pid}{where}" if self.pid is not None else "a process that did not say who it is"


class StateDirLock(BasePart):
    """A node part held from construction to `close()`; construction raises `StateDirInUse` when another node holds it.

    Built first and closed last, so the identity, ledger and pidfile are never another node's for a moment.
    """

    name = "state dir lock"

    def __init__(self, state_dir: Path, *, host: str, port: int) -> None:
        self.path = state_dir / LOCK_FILE_NAME
        private_dir(state_dir)  # keys, ledger and logs of one node: its owner's only
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(self.path)
            os.close(fd)
            raise StateDirInUse(
                f"another node ({holder.describe()}) is running with the state dir {state_dir}. "
                "One state dir holds one node's identity, ledger and llama-server: give this node its own with "
                "--state-dir DIR (or MESHNET_STATE_DIR), or stop the other node first."
            ) from None
        self._fd: int | None = fd
        record = {"pid": os.getpid(), "host": host, "port": port, "since": int(time.time())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)

    def release(self) -> None:
        """Give the state directory up (the file stays; only the lock says whether it is held)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.ftruncate(fd, 0)
            os.close(fd)  # closing the descriptor drops the flock

    async def close(self) -> None:
        self.release()


def read_holder(path: Path) -> LockHolder:
    try:
        record = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        record = {}
    if not isinstance(record, dict):
        record = {}
    pid, port = record.get("pid"), record.get("port")
    return LockHolder(
        pid=pid if isinstance(pid, int) else None,
        host=str(record["host"]) if record.get("host") is not None else None,
        port=port if isinstance(port, int) else None,
    )
