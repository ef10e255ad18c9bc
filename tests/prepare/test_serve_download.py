"""Issue 3's done-when, as an operator meets it: `meshnet-gguf serve --gguf owner/name --quant Q --download-dir D`.

A real node process downloads a 3-shard tiny model from the local HF-compatible
hub over real HTTP (`HF_ENDPOINT`), verifies it and serves it through the real
llama-server; a serve killed mid-download fetches only what was missing when run
again; a flipped byte is caught before llama-server ever starts.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from meshnet_gguf.devtools.hf_server import LocalHub
from meshnet_gguf.llama.child import PIDFILE_NAME
from meshnet_gguf.models.download import PART_SUFFIX, HubAccess, RemoteFile, list_repo
from meshnet_gguf.models.quants import group_quants, select_quant
from support.local_hub_fixtures import ROOT_SPLIT, hub, hub_root  # noqa: F401
from support.node_process import NodeProcess, StartNode

pytestmark = pytest.mark.real_llama

QUANT = "Q8_0"
MODEL_NAME = f"{ROOT_SPLIT}:{QUANT}"  # what clients see for a hub model: repo and quant
# A killed download must leave its partial bytes on disk within this long.
PARTIAL_WAIT_S = 30.0
EXIT_TIMEOUT_S = 60.0
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


def shards(hub: LocalHub) -> list[RemoteFile]:
    listing = list_repo(ROOT_SPLIT, HubAccess(endpoint=hub.endpoint, token=None, offline=False))
    return list(select_quant(group_quants(listing.files), QUANT).files)


def hub_env(hub: LocalHub, tmp_path: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "0"}


def serve(start_node: StartNode, hub: LocalHub, tmp_path: Path, run: str, *extra: str) -> NodeProcess:
    """`serve --gguf owner/name --quant Q --download-dir D` with its own state dir per run (for the pidfile)."""
    workdir = tmp_path / run
    workdir.mkdir()
    # NodeProcess passes `--download-dir <workdir>/models` first; this later one wins (click keeps the last value).
    download_dir = tmp_path / "D"
    return start_node(
        "--gguf", ROOT_SPLIT, "--quant", QUANT, "--download-dir", str(download_dir), "--ctx-size", "1024", *extra,
        env=hub_env(hub, tmp_path), workdir=workdir,
    )  # fmt: skip


def on_disk(tmp_path: Path, file: RemoteFile) -> Path:
    return tmp_path / "D" / ROOT_SPLIT / file.path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def never_launched(node: NodeProcess) -> None:
    """The node gave up with a setup error before the supervisor ever spawned llama-server."""
    assert node.wait_exit(EXIT_TIMEOUT_S) == 2, node.log_text()
    assert not (node.state_dir / PIDFILE_NAME).exists()
    assert "launching " not in node.log_text()  # the supervisor's line for every spawn


def test_serve_downloads_verifies_and_serves_a_three_shard_model(
    hub: LocalHub,
    tmp_path: Path,
    real_llama,
    start_node: StartNode,  # noqa: F811
) -> None:
    files = shards(hub)
    assert len(files) == 3
    node = serve(start_node, hub, tmp_path, "first", "--llama-server", str(real_llama.path))
    health = node.wait_ready()

    assert health["model"] == MODEL_NAME and health["quant"] == QUANT
    for f in files:  # original names, in D, with the hub's sha256
        assert on_disk(tmp_path, f).name.endswith("-of-00003.gguf")
        assert sha256(on_disk(tmp_path, f)) == f.sha256
    assert not list((tmp_path / "D").rglob(f"*{PART_SUFFIX}"))
    assert not (tmp_path / "first" / "models").exists()  # --download-dir D, not the default
    assert hub.bytes_served(ROOT_SPLIT) == sum(f.size for f in files)
    # The running node exports what this start downloaded.
    metrics = httpx.get(node.url + "/metrics", timeout=10).text
    assert f"meshnet_download_bytes_total {float(sum(f.size for f in files))}" in metrics
    answer = httpx.post(node.url + "/v1/chat/completions", json=CHAT, timeout=60).json()
    assert answer["model"] == MODEL_NAME and answer["usage"]["completion_tokens"] >= 1
    log = node.log_text()
    assert "hardware: CPU" in log and f"launch plan for {MODEL_NAME}" in log and "sha256 verified" in log


def test_a_serve_killed_mid_download_fetches_only_what_was_missing(
    hub: LocalHub,
    tmp_path: Path,
    real_llama,
    start_node: StartNode,  # noqa: F811
) -> None:
    files = shards(hub)
    cut = files[1].size // 2
    hub.stall(ROOT_SPLIT, files[1].path, after_bytes=cut)
    part = on_disk(tmp_path, files[1]).with_name(on_disk(tmp_path, files[1]).name + PART_SUFFIX)

    first = serve(start_node, hub, tmp_path, "killed", "--llama-server", str(real_llama.path))
    deadline = time.monotonic() + PARTIAL_WAIT_S
    while not (part.exists() and part.stat().st_size == cut):
        assert first.proc.poll() is None, first.log_text()
        assert time.monotonic() < deadline, "the download never reached the stall point"
        time.sleep(0.02)
    first.signal(signal.SIGKILL)
    first.wait_exit()
    hub.release()
    assert on_disk(tmp_path, files[0]).exists() and part.stat().st_size == cut
    assert not (first.state_dir / PIDFILE_NAME).exists()  # killed before any launch

    hub.reset_counters()
    again = serve(start_node, hub, tmp_path, "again", "--llama-server", str(real_llama.path))
    assert again.wait_ready()["model"] == MODEL_NAME
    assert hub.bytes_served(ROOT_SPLIT, files[0].path) == 0
    assert hub.bytes_served(ROOT_SPLIT, files[1].path) == files[1].size - cut
    assert hub.bytes_served(ROOT_SPLIT, files[2].path) == files[2].size
    ranges = [rng for method, url, rng in hub.requests() if method == "GET" and url.endswith(files[1].path)]
    assert ranges == [f"bytes={cut}-"]
    for f in files:
        assert sha256(on_disk(tmp_path, f)) == f.sha256


def test_a_flipped_byte_is_caught_before_launch(
    hub: LocalHub,
    tmp_path: Path,
    real_llama,
    start_node: StartNode,  # noqa: F811
) -> None:
    files = shards(hub)
    llama = ("--llama-server", str(real_llama.path))

    # In transit: the hub serves one flipped byte (twice: one fresh download after a mismatch). Never kept, never launched.
    hub.corrupt(ROOT_SPLIT, files[2].path)
    corrupt = serve(start_node, hub, tmp_path, "in-transit", *llama)
    never_launched(corrupt)
    assert "does not match the hub's" in corrupt.log_text() and "will not be launched" in corrupt.log_text()
    assert not on_disk(tmp_path, files[2]).exists()
    hub.heal()

    # On disk, after a verified download: the next start re-hashes the touched shard, fetches only it again, serves.
    good = serve(start_node, hub, tmp_path, "good", *llama)
    good.wait_ready()
    good.close()
    target = on_disk(tmp_path, files[1])
    flip_a_byte(target)
    hub.reset_counters()
    healed = serve(start_node, hub, tmp_path, "online", *llama)
    assert healed.wait_ready()["model"] == MODEL_NAME
    assert "differs from the hub's copy" in healed.log_text()
    assert sha256(target) == files[1].sha256
    assert hub.bytes_served(ROOT_SPLIT) == files[1].size == hub.bytes_served(ROOT_SPLIT, files[1].path)
    healed.close()

    # Offline it cannot be fetched again: a clear error, and llama-server never starts.
    flip_a_byte(target)
    offline = serve(start_node, hub, tmp_path, "offline", *llama, "--offline")
    never_launched(offline)
    assert "error: offline" in offline.log_text() and files[1].path in offline.log_text()


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    # A new mtime, as any real change has: the remembered verification no longer applies.
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 5_000_000_000))
