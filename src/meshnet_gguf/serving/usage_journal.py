"""A standalone node's usage, kept: one JSON line per request appended to `usage.jsonl` in its state dir.

A meshed node's usage goes to its SQLite ledger (mesh/ledger), a row synced before forwarding,
because a tracker bills from it. A standalone node bills nobody: its record only has to outlive
the node, so `meshnet-gguf usage` can answer. It is written after the answer has gone (the proxy
calls its usage sinks once the last byte is out), with one `os.write` on a file opened `O_APPEND`:
no fsync, no thread hand-off, no lock, no SQLite. The kernel's page cache survives the process, so a
crash of the node loses nothing; a crash of the machine may lose the last seconds, which the
standalone path's speed is worth (bench/RESULTS.md, "Usage on a standalone node").

The file is bounded: past `MAX_JOURNAL_BYTES` it becomes `usage.jsonl.1` (one older file kept) and
a new one starts, so a busy node's journal stays a few tens of megabytes.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from meshnet_gguf.common.private_files import PRIVATE_FILE_MODE, private_dir
from meshnet_gguf.contract.node_part import BasePart
from meshnet_gguf.contract.protocol import UsageRecord, UsageTotals
from meshnet_gguf.serving.usage_stats import UsageStats

log = logging.getLogger(__name__)

USAGE_JOURNAL_FILE = "usage.jsonl"
# ~300 bytes a request: ~200,000 requests a file, two files kept. Reading both for `usage` takes a second or two.
MAX_JOURNAL_BYTES = 64 * 1024 * 1024
ROTATED_SUFFIX = ".1"


class UsageJournal(BasePart):
    """The usage sink of a standalone node; a node part only so its file is closed with the node."""

    name = "usage journal"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        private_dir(self.path.parent)
        self._fd = _open_append(self.path)
        self._size = os.fstat(self._fd).st_size
        self._failed = False

    @classmethod
    def in_state_dir(cls, state_dir: Path) -> UsageJournal:
        return cls(Path(state_dir) / USAGE_JOURNAL_FILE)

    async def record(self, usage: UsageRecord) -> None:
        line = usage.model_dump_json().encode() + b"\n"
        try:
            # One write of a whole line on an O_APPEND file: lines never interleave or tear in the page cache.
            self._size += os.write(self._fd, line)
            if self._size > MAX_JOURNAL_BYTES:
                self._rotate()
        except OSError as exc:
            # A full disk must not cost the request (the proxy would log a traceback per request): said once.
            if not self._failed:
                log.warning("usage journal %s: %s; usage of this run is not kept until it can be written", self.path, exc)
            self._failed = True
        else:
            self._failed = False

    def _rotate(self) -> None:
        os.replace(self.path, self.path.with_name(self.path.name + ROTATED_SUFFIX))
        os.close(self._fd)
        self._fd = _open_append(self.path)
        self._size = 0

    async def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _open_append(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE_MODE)


@dataclass(frozen=True)
class JournalSummary:
    """What `meshnet-gguf usage` shows of a journal: the latest records (newest first) and the totals of all."""

    latest: list[UsageRecord]
    totals: UsageTotals
    unreadable_lines: int


def journal_files(state_dir: Path) -> list[Path]:
    """The journal's files in a state dir, oldest first; none when the node never served standalone."""
    current = Path(state_dir) / USAGE_JOURNAL_FILE
    return [p for p in (current.with_name(current.name + ROTATED_SUFFIX), current) if p.exists()]


def read_journal(state_dir: Path, limit: int) -> JournalSummary | None:
    files = journal_files(state_dir)
    if not files:
        return None
    stats = UsageStats()  # the totals the node's /health keeps, added up the same way
    latest: list[UsageRecord] = []
    bad = 0
    for raw in _lines(files):
        try:
            record = UsageRecord.model_validate(json.loads(raw))
        except ValueError:  # a line cut by a full disk, or edited by hand: counted, not fatal
            bad += 1
            continue
        stats.observe(record)
        latest.append(record)
        if len(latest) > 2 * limit:
            del latest[:-limit]
    latest = latest[-limit:] if limit > 0 else []
    return JournalSummary(latest=latest[::-1], totals=stats.totals, unreadable_lines=bad)


def _lines(files: list[Path]) -> Iterator[bytes]:
    for path in files:
        with path.open("rb") as f:
            for line in f:
                if line.strip():
                    yield line


__all__ = ["JournalSummary", "MAX_JOURNAL_BYTES", "USAGE_JOURNAL_FILE", "UsageJournal", "journal_files", "read_journal"]
