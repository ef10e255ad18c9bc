"""Which model files a running node uses, and when each was last served.

A serving node holds a shared `flock` on every shard of its model for its whole life (`ModelFilesHeld`,
a node part). `meshnet-gguf rm` takes an exclusive one, without waiting, on each file before it
unlinks anything: it cannot while any node on this machine holds the file, whatever that node's state
dir, and the kernel drops a crashed node's lock, so no stale marker can keep a file forever. Two nodes
serving one file both hold shared locks, which do not exclude each other.

When the node starts and when it stops it notes the time against its model's first shard in
`<download dir>/.meshnet/last-served.json`, beside the models it lists (`models --local` reads it
whatever state dir a node had). Two nodes stopping in the same instant may lose one note: a
listing's hint, not a record anyone bills from.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from meshnet_gguf.common.atomic_file import write_atomically
from meshnet_gguf.contract.node_part import BasePart

log = logging.getLogger(__name__)

LAST_SERVED_FILE = Path(".meshnet") / "last-served.json"


class ModelFilesHeld(BasePart):
    """The shared locks on a node's model files, from construction to `close()`; the served time noted at both."""

    name = "model files"

    def __init__(self, files: Sequence[Path], download_dir: Path) -> None:
        self.files = [Path(f).absolute() for f in files]
        self._download_dir = Path(download_dir).expanduser().absolute()
        self._fds: list[int] = []
        for path in self.files:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                # `rm` holds it this instant and is about to unlink it: llama-server will say so.
                log.warning("%s is being removed (meshnet-gguf rm) while this node starts", path)
            self._fds.append(fd)
        self._note()

    def _note(self) -> None:
        if self.files:
            note_served(self._download_dir, self.files[0])

    async def close(self) -> None:
        self._note()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def note_served(download_dir: Path, first_shard: Path, when: float | None = None) -> None:
    path = Path(download_dir) / LAST_SERVED_FILE
    served = last_served(download_dir)
    served[str(Path(first_shard).absolute())] = time.time() if when is None else when
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(served, indent=1, sort_keys=True))
    except OSError as exc:  # a read-only download dir: serving goes on, the listing lacks the date
        log.debug("could not note when %s was served: %s", first_shard, exc)


def last_served(download_dir: Path) -> dict[str, float]:
    """First shard path -> when a node last started or stopped serving it (Unix time)."""
    try:
        data = json.loads((Path(download_dir) / LAST_SERVED_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def in_use(path: Path) -> bool:
    """True while a running node holds `path` (its shared lock stops an exclusive try)."""
    with exclusively_held([path]) as held:
        return not held


@contextlib.contextmanager
def exclusively_held(paths: Sequence[Path]) -> Iterator[bool]:
    """Exclusive locks on every file, or none: yields False (holding nothing) when any is in use."""
    fds: list[int] = []
    try:
        for path in paths:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
        yield True
    finally:
        for fd in fds:
            os.close(fd)


__all__ = ["LAST_SERVED_FILE", "ModelFilesHeld", "exclusively_held", "in_use", "last_served", "note_served"]
