"""Downloads against the local HF-compatible hub over real HTTP on 127.0.0.1."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from meshnet_gguf.devtools.hf_server import LocalHub
from meshnet_gguf.models.download import (
    DISK_FREE_MARGIN_BYTES,
    META_DIR,
    PART_SUFFIX,
    AccessDenied,
    ChecksumMismatch,
    HubAccess,
    HubUnreachable,
    MissingOffline,
    NotEnoughDiskSpace,
    RemoteFile,
    RepoListing,
    fetch_files,
    list_repo,
    progress,
    verified,
)
from meshnet_gguf.models.quants import group_quants, select_quant
from support.local_hub_fixtures import GATED, GOOD_TOKEN, ROOT_SPLIT, access, hub, hub_root  # noqa: F401

# A killed download must leave its partial bytes on disk within this long.
PARTIAL_WAIT_S = 30.0


def _quant_files(listing: RepoListing, quant: str) -> list[RemoteFile]:
    return list(select_quant(group_quants(listing.files), quant).files)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    hashed: list[Path] = []
    real = verified.sha256_of

    def counting(path: Path, **kwargs):  # type: ignore[no-untyped-def]
        hashed.append(Path(path))
        return real(path, **kwargs)

    monkeypatch.setattr(verified, "sha256_of", counting)
    return hashed


def test_listing_has_sizes_and_sha256_before_any_byte(hub: LocalHub, access: HubAccess, hub_root: Path) -> None:
    listing = list_repo(ROOT_SPLIT, access)
    shards = _quant_files(listing, "Q8_0")
    assert len(shards) == 3
    for f in shards:
        on_hub = hub_root / ROOT_SPLIT / f.path
        assert f.size == on_hub.stat().st_size
        assert f.sha256 == _sha256(on_hub)
    assert len(listing.commit) == 40
    assert hub.bytes_served(ROOT_SPLIT) == 0


def test_three_shard_download_keeps_original_names_and_is_remembered(
    hub: LocalHub, access: HubAccess, hub_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listing = list_repo(ROOT_SPLIT, access)
    shards = _quant_files(listing, "Q8_0")
    paths = fetch_files(listing, shards, tmp_path, access, progress=False)

    assert [p.relative_to(tmp_path).as_posix() for p in paths] == [f"{ROOT_SPLIT}/{f.path}" for f in shards]
    assert [p.name for p in paths] == [f"Tiny-Q8_0-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    for p, f in zip(paths, shards):
        assert _sha256(p) == f.sha256
    assert hub.bytes_served(ROOT_SPLIT) == sum(f.size for f in shards)
    assert not list(tmp_path.rglob(f"*{PART_SUFFIX}"))

    # A restart neither downloads nor re-hashes: the verified state is trusted while size+mtime hold.
    hub.reset_counters()
    hashed = _count_hashing(monkeypatch)
    assert fetch_files(listing, shards, tmp_path, access, progress=False) == paths
    assert hub.bytes_served(ROOT_SPLIT) == 0
    assert hashed == []

    # A touched file (new mtime, same bytes) is hashed again, once, and not downloaded.
    os.utime(paths[1], ns=(time.time_ns(), time.time_ns() + 5_000_000_000))
    fetch_files(listing, shards, tmp_path, access, progress=False)
    assert hashed == [paths[1]]
    assert hub.bytes_served(ROOT_SPLIT) == 0


def test_flipped_byte_on_disk_is_caught_and_only_that_shard_refetched(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    listing = list_repo(ROOT_SPLIT, access)
    shards = _quant_files(listing, "Q8_0")
    paths = fetch_files(listing, shards, tmp_path, access, progress=False)
    data = bytearray(paths[2].read_bytes())
    data[len(data) // 2] ^= 0x01
    paths[2].write_bytes(bytes(data))

    hub.reset_counters()
    fetch_files(listing, shards, tmp_path, access, progress=False)
    assert _sha256(paths[2]) == shards[2].sha256
    assert hub.bytes_served(ROOT_SPLIT) == shards[2].size
    assert hub.bytes_served(ROOT_SPLIT, shards[2].path) == shards[2].size


def test_corruption_in_transit_is_never_kept(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    listing = list_repo(ROOT_SPLIT, access)
    shards = _quant_files(listing, "Q8_0")
    hub.corrupt(ROOT_SPLIT, shards[1].path)

    with pytest.raises(ChecksumMismatch, match="will not be launched"):
        fetch_files(listing, shards, tmp_path, access, progress=False)
    second = tmp_path / ROOT_SPLIT / shards[1].path
    assert not second.exists()
    assert not second.with_name(second.name + PART_SUFFIX).exists()
    # One fresh download after the first mismatch, then a clear error.
    assert hub.bytes_served(ROOT_SPLIT, shards[1].path) == 2 * shards[1].size

    # Once the source is healthy, the next run fetches only what is missing.
    hub.heal()
    hub.reset_counters()
    fetch_files(listing, shards, tmp_path, access, progress=False)
    assert hub.bytes_served(ROOT_SPLIT, shards[0].path) == 0
    assert hub.bytes_served(ROOT_SPLIT) == shards[1].size + shards[2].size


def test_resume_after_a_download_killed_halfway(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    listing = list_repo(ROOT_SPLIT, access)
    shards = _quant_files(listing, "Q8_0")
    cut = shards[1].size // 2
    hub.stall(ROOT_SPLIT, shards[1].path, after_bytes=cut)
    part = tmp_path / ROOT_SPLIT / (shards[1].path + PART_SUFFIX)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MESHNET_"))}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf-home"))
    argv = [sys.executable, "-m", "meshnet_gguf", "download", f"{ROOT_SPLIT}:Q8_0", "--download-dir", str(tmp_path)]
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + PARTIAL_WAIT_S
        while not (part.exists() and part.stat().st_size == cut):
            assert child.poll() is None, child.communicate()[0].decode()
            assert time.monotonic() < deadline, "the download never reached the stall point"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    hub.release()
    assert (tmp_path / ROOT_SPLIT / shards[0].path).exists()  # shard 1 finished before the kill
    assert part.stat().st_size == cut

    hub.reset_counters()
    paths = fetch_files(listing, shards, tmp_path, access, progress=False)
    assert hub.bytes_served(ROOT_SPLIT, shards[0].path) == 0
    assert hub.bytes_served(ROOT_SPLIT, shards[1].path) == shards[1].size - cut
    assert hub.bytes_served(ROOT_SPLIT, shards[2].path) == shards[2].size
    ranges = [rng for method, url, rng in hub.requests() if method == "GET" and url.endswith(shards[1].path)]
    assert ranges == [f"bytes={cut}-"]
    for p, f in zip(paths, shards):
        assert _sha256(p) == f.sha256


def test_free_space_is_checked_before_the_first_byte(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    listing = list_repo(ROOT_SPLIT, access)
    shards = _quant_files(listing, "Q8_0")
    total = sum(f.size for f in shards)
    # A partial second shard already on disk counts as fetched.
    partial = 1000
    part = tmp_path / ROOT_SPLIT / (shards[1].path + PART_SUFFIX)
    part.parent.mkdir(parents=True)
    part.write_bytes((hub.root / ROOT_SPLIT / shards[1].path).read_bytes()[:partial])
    asked: list[Path] = []

    def tight(directory: Path) -> int:
        asked.append(directory)
        return total - partial + DISK_FREE_MARGIN_BYTES - 1

    with pytest.raises(NotEnoughDiskSpace) as info:
        fetch_files(listing, shards, tmp_path, access, progress=False, free_bytes=tight)
    assert info.value.needed_bytes == total - partial
    assert "--download-dir" in str(info.value)
    assert asked == [tmp_path / ROOT_SPLIT]
    assert hub.bytes_served(ROOT_SPLIT) == 0

    paths = fetch_files(listing, shards, tmp_path, access, progress=False, free_bytes=lambda d: total - partial + DISK_FREE_MARGIN_BYTES)
    assert hub.bytes_served(ROOT_SPLIT) == total - partial
    assert _sha256(paths[1]) == shards[1].sha256


def test_offline_uses_only_the_disk(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    listing = list_repo(ROOT_SPLIT, access)
    shards = _quant_files(listing, "Q8_0")
    offline = HubAccess(endpoint=access.endpoint, token=None, offline=True)

    with pytest.raises(MissingOffline, match="meshnet-gguf download"):
        fetch_files(listing, shards, tmp_path, offline, progress=False)
    with pytest.raises(MissingOffline):
        list_repo(ROOT_SPLIT, offline)

    paths = fetch_files(listing, shards, tmp_path, access, progress=False)
    hub.reset_counters()
    assert fetch_files(listing, shards, tmp_path, offline, progress=False) == paths
    assert hub.requests() == []

    paths[0].unlink()
    with pytest.raises(MissingOffline, match=shards[0].path):
        fetch_files(listing, shards, tmp_path, offline, progress=False)


def test_gated_repo_needs_a_token(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    listing = list_repo(GATED, access)  # metadata is public, as on the hub
    assert listing.gated
    files = _quant_files(listing, "Q4_K_M")

    with pytest.raises(AccessDenied, match="HF_TOKEN"):
        fetch_files(listing, files, tmp_path, access, progress=False)
    wrong = HubAccess(endpoint=access.endpoint, token="hf_not_allowed", offline=False)
    with pytest.raises(AccessDenied, match="no access"):
        fetch_files(listing, files, tmp_path, wrong, progress=False)
    assert hub.bytes_served(GATED) == 0
    assert not list((tmp_path / GATED).rglob("*.gguf*"))

    allowed = HubAccess(endpoint=access.endpoint, token=GOOD_TOKEN, offline=False)
    (path,) = fetch_files(listing, files, tmp_path, allowed, progress=False)
    assert _sha256(path) == files[0].sha256


def test_unreachable_hub_says_what_to_do(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    nowhere = HubAccess(endpoint=f"http://127.0.0.1:{closed_port}", token=None, offline=False)
    with pytest.raises(HubUnreachable, match="--offline"):
        list_repo(ROOT_SPLIT, nowhere)


def test_access_follows_the_environment_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9/")
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: pin what it read so that only this test's
    # environment decides (a shell with HF_HUB_OFFLINE=1 would otherwise make every check below pass).
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    access = HubAccess.from_environment()
    assert access.endpoint == "http://127.0.0.1:9"
    assert access.token == "hf_from_env"
    assert access.headers()["authorization"] == "Bearer hf_from_env"
    assert access.offline is False
    assert HubAccess.from_environment(offline=True).offline is True
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert HubAccess.from_environment().offline is True
    # Offline as huggingface_hub saw it at import counts too.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    assert HubAccess.from_environment().offline is True


def test_verified_state_lives_beside_the_files(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    listing = list_repo(ROOT_SPLIT, access)
    fetch_files(listing, _quant_files(listing, "Q4_K_M"), tmp_path, access, progress=False)
    meta = tmp_path / ROOT_SPLIT / META_DIR
    assert (meta / "verified.json").is_file()


def test_local_hub_speaks_enough_hub_for_huggingface_hub(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    """The test server is only useful if huggingface_hub's own calls accept it."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.utils import get_session

    listing = list_repo(ROOT_SPLIT, access)
    shard = _quant_files(listing, "Q8_0")[0]
    url = hf_hub_url(ROOT_SPLIT, shard.path, endpoint=access.endpoint)
    meta = get_hf_file_metadata(url, token=False)
    assert (meta.etag, meta.size, meta.commit_hash) == (shard.sha256, shard.size, listing.commit)

    (info,) = access.api().get_paths_info(ROOT_SPLIT, [shard.path])
    assert info.lfs is not None and info.lfs.sha256 == shard.sha256

    path = hf_hub_download(ROOT_SPLIT, shard.path, local_dir=tmp_path, endpoint=access.endpoint, token=False)
    assert _sha256(Path(path)) == shard.sha256

    tail = get_session().get(url, headers={"Range": "bytes=100-"})
    assert tail.status_code == 206 and tail.headers["Content-Range"] == f"bytes 100-{shard.size - 1}/{shard.size}"
    assert tail.content == Path(path).read_bytes()[100:]


def test_a_server_that_ignores_range_still_yields_a_verified_file(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    listing = list_repo(ROOT_SPLIT, access)
    shard = _quant_files(listing, "Q8_0")[0]
    part = tmp_path / ROOT_SPLIT / (shard.path + PART_SUFFIX)
    part.parent.mkdir(parents=True)
    part.write_bytes((hub.root / ROOT_SPLIT / shard.path).read_bytes()[:5000])
    hub.honour_range = False

    (path,) = fetch_files(listing, [shard], tmp_path, access, progress=False)
    assert _sha256(path) == shard.sha256
    assert hub.bytes_served(ROOT_SPLIT) == shard.size  # started over, as it had to


def test_progress_bars_are_quiet_when_not_a_tty(capsys: pytest.CaptureFixture[str]) -> None:
    with progress.progress_bar(total=10, initial=0, desc="x", enabled=True) as bar:
        bar.update(10)
    assert bar.disable  # pytest's captured stderr is not a TTY
    assert capsys.readouterr().err == ""
