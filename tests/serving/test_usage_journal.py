"""The standalone node's usage journal: one line a request, bounded by rotation, read back by `usage`."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from meshnet_gguf.contract.protocol import UsageRecord
from meshnet_gguf.serving import usage_journal
from meshnet_gguf.serving.usage_journal import USAGE_JOURNAL_FILE, UsageJournal, journal_files, read_journal

pytestmark = pytest.mark.anyio


def record(n: int, finish: str = "stop") -> UsageRecord:
    return UsageRecord(request_id=f"req-{n}", route="/v1/chat/completions", model="tiny", status=200, stream=True,
                       prompt_tokens=10, completion_tokens=n, finish_reason=finish, started_at=1_000.0 + n)  # type: ignore[arg-type]  # fmt: skip


async def test_records_are_appended_one_line_each_and_read_back_newest_first(tmp_path: Path) -> None:
    journal = UsageJournal.in_state_dir(tmp_path)
    for n in range(5):
        await journal.record(record(n, "cancelled" if n == 4 else "stop"))
    await journal.close()
    path = tmp_path / USAGE_JOURNAL_FILE
    assert len(path.read_bytes().splitlines()) == 5
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # what was served: the operator's only
    summary = read_journal(tmp_path, limit=3)
    assert summary is not None
    assert [r.request_id for r in summary.latest] == ["req-4", "req-3", "req-2"]
    assert (summary.totals.requests, summary.totals.completion_tokens, summary.totals.cancelled) == (5, 10, 1)


async def test_a_reopened_journal_appends_and_a_full_file_rotates_keeping_one_older(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = UsageJournal.in_state_dir(tmp_path)
    await journal.record(record(0))
    await journal.close()
    line_bytes = (tmp_path / USAGE_JOURNAL_FILE).stat().st_size
    monkeypatch.setattr(usage_journal, "MAX_JOURNAL_BYTES", 3 * line_bytes)
    journal = UsageJournal.in_state_dir(tmp_path)  # a node's next start: appends
    for n in range(1, 10):
        await journal.record(record(n))
    await journal.close()
    files = journal_files(tmp_path)
    assert [f.name for f in files] == [USAGE_JOURNAL_FILE + ".1", USAGE_JOURNAL_FILE]
    summary = read_journal(tmp_path, limit=100)
    assert summary is not None and summary.latest[0].request_id == "req-9"
    # Older rotations are gone: at most two files' worth is kept.
    assert summary.totals.requests < 10 and all(f.stat().st_size <= 4 * line_bytes for f in files)


async def test_a_torn_line_is_counted_not_fatal(tmp_path: Path) -> None:
    journal = UsageJournal.in_state_dir(tmp_path)
    await journal.record(record(1))
    await journal.close()
    with (tmp_path / USAGE_JOURNAL_FILE).open("ab") as f:
        f.write(b'{"request_id": "req-2", "rou\n')
    summary = read_journal(tmp_path, limit=10)
    assert summary is not None and summary.totals.requests == 1 and summary.unreadable_lines == 1


async def test_a_write_that_fails_costs_the_request_nothing_and_is_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    journal = UsageJournal.in_state_dir(tmp_path)

    def full(fd: int, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    for n in range(3):
        await journal.record(record(n))  # no exception reaches the proxy
    monkeypatch.undo()
    await journal.close()
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1


def test_no_journal_reads_as_none(tmp_path: Path) -> None:
    assert read_journal(tmp_path, limit=10) is None
