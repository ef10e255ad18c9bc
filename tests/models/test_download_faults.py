"""Download faults the other download tests do not cover: the disk filling up mid-shard, a shard
truncated on disk, a download folder that cannot be written. Each gives a clear error, and a
file is never given its final name (the one llama-server is launched on) before it is whole and verified."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from meshnet_gguf.devtools.hf_server import LocalHub
from meshnet_gguf.models.download import transfer
from meshnet_gguf.models.download import PART_SUFFIX, DownloadError, HubAccess, MissingOffline, fetch_files, list_repo
from support.local_hub_fixtures import ROOT_SPLIT, access, hub, hub_root  # noqa: F401


def _q8(access: HubAccess):  # type: ignore[no-untyped-def]
    listing = list_repo(ROOT_SPLIT, access)
    return listing, [f for f in listing.files if "Q8_0" in f.path]


def test_disk_full_mid_shard_is_a_clear_error_and_leaves_no_final_file(
    hub: LocalHub, access: HubAccess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listing, shards = _q8(access)
    real_write = transfer._write_all
    budget = {"bytes": shards[0].size + shards[1].size // 2}  # the disk fills halfway through shard 2

    def filling_disk(out, data: bytes) -> None:  # type: ignore[no-untyped-def]
        if budget["bytes"] < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget["bytes"] -= len(data)
        real_write(out, data)

    monkeypatch.setattr(transfer, "_write_all", filling_disk)
    with pytest.raises(DownloadError) as failed:
        fetch_files(listing, shards, tmp_path, access, progress=False)
    message = str(failed.value)
    assert "No space left on device" in message and shards[1].path in message and "resumes" in message
    repo = tmp_path / ROOT_SPLIT
    assert (repo / shards[0].path).exists()  # whole and verified
    assert not (repo / shards[1].path).exists() and not (repo / shards[2].path).exists()  # never a half file under its name
    assert (repo / (shards[1].path + PART_SUFFIX)).exists()

    monkeypatch.setattr(transfer, "_write_all", real_write)  # space freed: the next run resumes and verifies
    hub.reset_counters()
    paths = fetch_files(listing, shards, tmp_path, access, progress=False)
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths] == [f.sha256 for f in shards]
    assert hub.bytes_served(ROOT_SPLIT) < sum(f.size for f in shards[1:])


def test_a_truncated_shard_is_fetched_again_or_refused_offline(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    listing, shards = _q8(access)
    paths = fetch_files(listing, shards, tmp_path, access, progress=False)
    with paths[1].open("r+b") as fh:
        fh.truncate(shards[1].size // 3)
    offline = HubAccess(endpoint=access.endpoint, token=None, offline=True)
    with pytest.raises(MissingOffline) as refused:
        fetch_files(listing, shards, tmp_path, offline, progress=False)
    assert shards[1].path in str(refused.value)
    assert not paths[1].exists()  # the truncated copy is gone, never launched
    fetch_files(listing, shards, tmp_path, access, progress=False)
    assert hashlib.sha256(paths[1].read_bytes()).hexdigest() == shards[1].sha256


def test_a_download_folder_that_cannot_be_written_is_a_clear_error(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    listing, shards = _q8(access)
    blocked = tmp_path / "models"
    blocked.write_text("a file where the download folder should be")
    with pytest.raises(DownloadError) as failed:
        fetch_files(listing, shards, blocked, access, progress=False)
    assert str(blocked) in str(failed.value)
    assert blocked.read_text().startswith("a file")
