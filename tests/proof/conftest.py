"""Fixtures the proof tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnet_gguf.reference.tracker.ledger import TrackerLedger


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[TrackerLedger]:
    """A real tracker ledger in `tmp_path`, closed after the test."""
    ledger = TrackerLedger(tmp_path / "tracker.sqlite")
    yield ledger
    ledger.close()
