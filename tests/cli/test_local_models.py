"""`pull`, `models --local` and `rm` on real files: a model pulled from the loopback hub, listed, held by a
real `serve` (in front of the fake llama-server) so `rm` refuses it, then listed as served and removed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from meshnet_gguf.devtools.hf_server import LocalHub
from support.local_hub_fixtures import ROOT_FILE, ROOT_SPLIT, hub, hub_root  # noqa: F401
from support.node_process import StartNode

QUANT = "Q4_K_M"


def cli(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnet_gguf", *args], capture_output=True, text=True, timeout=120, input=stdin,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def hub_env(hub: LocalHub, tmp_path: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "0"}


def listed(models: Path) -> list[dict]:  # type: ignore[type-arg]
    done = cli("models", "--local", "--json", "--download-dir", str(models))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["models"]


def test_pull_list_refuse_while_served_then_remove(hub: LocalHub, tmp_path: Path, start_node: StartNode, fake_llama_path: Path) -> None:  # noqa: F811
    models = tmp_path / "models"  # the download dir the test's nodes use
    pulled = cli("pull", f"{ROOT_FILE}:{QUANT}", "--download-dir", str(models), "--json", env=hub_env(hub, tmp_path))
    assert pulled.returncode == 0, pulled.stderr
    document = json.loads(pulled.stdout)
    assert document["verified"] is True and document["quant"] == QUANT
    path = Path(document["files"][0])
    assert path.is_file() and path.is_relative_to(models)
    split = cli("pull", f"{ROOT_SPLIT}:{QUANT}", "--download-dir", str(models), env=hub_env(hub, tmp_path))
    assert split.returncode == 0 and "sha256 verified" in split.stdout, split.stderr

    rows = {(r["model"], r["quant"]): r for r in listed(models)}
    one, three = rows[(ROOT_FILE, QUANT)], rows[(ROOT_SPLIT, QUANT)]
    assert one["path"] == str(path) and one["bytes"] == path.stat().st_size and one["complete"]
    assert three["files"] == 3 and three["path"].endswith("-00001-of-00003.gguf")
    assert (one["in_use"], one["last_served"], one["fits"]) == (False, None, True)
    table = cli("models", "--local", "--download-dir", str(models)).stdout
    assert "LAST SERVED" in table and "never" in table and str(path) in table

    node = start_node("--gguf", str(path), "--llama-server", str(fake_llama_path))
    node.wait_ready()
    serving = {(r["model"], r["quant"]): r for r in listed(models)}[(ROOT_FILE, QUANT)]
    assert serving["in_use"] is True and serving["last_served"] is not None
    refused = cli("rm", f"{ROOT_FILE}:{QUANT}", "--yes", "--download-dir", str(models))
    assert refused.returncode == 2 and "in use by a running node" in refused.stderr
    assert path.is_file()  # nothing removed

    node.signal(signal.SIGTERM)
    assert node.wait_exit() == 0
    stopped = {(r["model"], r["quant"]): r for r in listed(models)}[(ROOT_FILE, QUANT)]
    assert stopped["in_use"] is False and stopped["last_served"] >= serving["last_served"]

    declined = cli("rm", f"{ROOT_FILE}:{QUANT}", "--download-dir", str(models), stdin="n\n")
    assert declined.returncode == 1 and "nothing removed" in declined.stdout and path.is_file()
    asked = cli("rm", ROOT_SPLIT, "--download-dir", str(models), stdin="y\n")  # every quant of the model
    assert asked.returncode == 0 and "freed" in asked.stdout, asked.stderr
    removed = cli("rm", f"{ROOT_FILE}:{QUANT}", "--yes", "--json", "--download-dir", str(models))
    assert removed.returncode == 0, removed.stderr
    assert json.loads(removed.stdout)["removed"][0]["files"] == [str(path)]
    assert not path.exists() and listed(models) == []


def test_rm_of_what_is_not_there_says_so_and_touches_nothing(tmp_path: Path) -> None:
    kept = tmp_path / "models" / "acme" / "other-GGUF" / "Other-Q8_0.gguf"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"GGUF")
    done = cli("rm", "acme/missing-GGUF", "--yes", "--download-dir", str(tmp_path / "models"))
    assert done.returncode == 2 and "no model 'acme/missing-GGUF'" in done.stderr
    assert kept.exists()
    assert cli("rm", "acme/other-GGUF", "--json", "--download-dir", str(tmp_path / "models")).returncode == 2  # --json needs --yes
    assert kept.exists()


def test_the_demo_model_is_listed_under_its_catalog_id_and_removed_by_it(tmp_path: Path) -> None:
    # Where `serve --demo` assembles it: <download dir>/demo/, one level, not owner/name.
    demo = tmp_path / "models" / "demo" / "gemma-3-270m-q4_k_m.gguf"
    demo.parent.mkdir(parents=True)
    (demo.parent / ".meshnet").mkdir()  # its verified-once bookkeeping, never a model
    demo.write_bytes(b"GGUF" + bytes(4096))
    rows = listed(tmp_path / "models")
    assert [(r["model"], r["quant"], r["path"], r["bytes"]) for r in rows] == [("demo", "Q4_K_M", str(demo), demo.stat().st_size)]
    table = cli("models", "--local", "--download-dir", str(tmp_path / "models")).stdout
    assert "demo" in table and str(demo) in table
    removed = cli("rm", "demo", "--yes", "--download-dir", str(tmp_path / "models"))
    assert removed.returncode == 0 and "removed demo:Q4_K_M" in removed.stdout, removed.stderr
    assert not demo.exists() and listed(tmp_path / "models") == []
