"""The one way files are written whole: no half file on a crash, the mode set before any byte, first key wins."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from meshnet_gguf.common.atomic_file import TEMP_SUFFIX, replaced_on_success, write_atomically


def test_the_content_appears_whole_with_its_mode_and_no_temporary_file_stays(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "unit.service"
    assert write_atomically(target, "[Unit]\n", mode=0o640)
    assert target.read_text() == "[Unit]\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert not list(tmp_path.rglob(f"*{TEMP_SUFFIX}"))


def test_a_replaced_file_is_never_seen_half_written(tmp_path: Path) -> None:
    target = tmp_path / "pin"
    target.write_text("old key\n")
    inode = target.stat().st_ino
    write_atomically(target, "new key\n")
    assert target.read_text() == "new key\n" and target.stat().st_ino != inode  # a new file renamed over, not rewritten


def test_exclusive_keeps_the_file_already_there(tmp_path: Path) -> None:
    key = tmp_path / "node.key"
    assert write_atomically(key, b"first", mode=0o600, exclusive=True)
    assert not write_atomically(key, b"second", mode=0o600, exclusive=True)
    assert key.read_bytes() == b"first" and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert not list(tmp_path.glob(f"*{TEMP_SUFFIX}"))


def test_a_writer_that_fails_leaves_the_old_file_and_no_temporary_one(tmp_path: Path) -> None:
    target = tmp_path / "model.gguf"
    target.write_bytes(b"the good copy")
    with pytest.raises(RuntimeError), replaced_on_success(target) as partial:
        partial.write_bytes(b"half of a")
        raise RuntimeError("the writer died")
    assert target.read_bytes() == b"the good copy"
    assert not list(tmp_path.glob(f"*{TEMP_SUFFIX}"))

    with replaced_on_success(target) as partial:
        assert partial.parent == target.parent and partial.name.startswith(".")  # same filesystem, hidden
        partial.write_bytes(b"a new copy")
    assert target.read_bytes() == b"a new copy" and os.listdir(tmp_path) == ["model.gguf"]
