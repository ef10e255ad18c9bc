"""A dry run (`serve --dry-run`, `doctor`: the pipeline with `may_write` down) writes nothing.

Every file and folder under the test's root (download dir, state dir, HF_HOME, the XDG cache)
is listed with its size and modification time before and after `prepare_launch(dry_run=True)`:
no hub listing saved, no download folder created, nothing in the state dir, nothing rewritten.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.devtools.hf_server import LocalHub
from meshnet_gguf.hardware.report import machine_budget_bytes
from meshnet_gguf.models.download import HubAccess
from meshnet_gguf.models.source import resolve_model
from meshnet_gguf.prepare.pipeline import NotDownloadedYet, prepare_launch
from support.hardware_fixtures import FIXTURES, write_recorded_llama
from support.local_hub_fixtures import ROOT_FILE, ROOT_SPLIT, hub, hub_root  # noqa: F401

Snapshot = dict[str, tuple[bool, int, int]]


def snapshot(root: Path) -> Snapshot:
    """Every path under `root`: is it a folder, its size and its modification time (a rewrite shows)."""
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The root everything of the run lives under, the recorded llama-server inside it."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    (tmp_path / "bin").mkdir()
    write_recorded_llama(tmp_path / "bin")
    return tmp_path


def settings_for(work: Path, gguf: str, box: str = "cpu-only") -> NodeSettings:
    return NodeSettings(
        gguf=gguf, llama_server=work / "bin" / "llama-server", hardware_fixture=FIXTURES / box,
        download_dir=work / "models", state_dir=work / "state",
    )  # fmt: skip


def test_a_hub_repo_not_downloaded_is_listed_but_nothing_is_saved(work: Path, hub: LocalHub, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    before = snapshot(work)
    with pytest.raises(NotDownloadedYet, match="not downloaded yet"):
        prepare_launch(settings_for(work, f"{ROOT_SPLIT}:Q8_0"), dry_run=True)
    assert snapshot(work) == before
    assert not (work / "models").exists() and not (work / "state").exists()
    assert hub.bytes_served(ROOT_SPLIT) == 0


def test_a_catalog_model_is_planned_from_its_figures_and_nothing_is_written(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a dry run that asked would fail
    before = snapshot(work)
    launch = prepare_launch(settings_for(work, "deepseek-v4-flash:UD-IQ3_XXS", box="strix-halo-128"), dry_run=True)
    assert launch.resolved is None and any("not downloaded yet" in note for note in launch.notes)
    assert snapshot(work) == before


def test_a_downloaded_hub_repo_is_planned_without_rewriting_a_byte(
    work: Path,
    hub: LocalHub,
    monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    settings = settings_for(work, f"{ROOT_SPLIT}:Q8_0")
    access = HubAccess(endpoint=hub.endpoint, token=None, offline=False)
    resolve_model(settings, progress=False, access=access, budget=machine_budget_bytes)
    before = snapshot(work)
    hub.reset_counters()

    launch = prepare_launch(settings, dry_run=True)
    assert launch.resolved is not None and launch.model_name == f"{ROOT_SPLIT}:Q8_0"
    # The hub was asked for its listing (the quant table), and that listing was not saved over the download's.
    assert snapshot(work) == before and hub.bytes_served(ROOT_SPLIT) == 0


def test_a_local_file_is_planned_and_nothing_is_written(work: Path, hub_root: Path) -> None:  # noqa: F811
    before = snapshot(work)
    launch = prepare_launch(settings_for(work, str(hub_root / ROOT_FILE / "Tiny-Q8_0.gguf")), dry_run=True)
    assert launch.model_name == "Tiny-Q8_0"
    assert snapshot(work) == before
