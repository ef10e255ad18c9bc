"""The node chooses its llama-server by measurement: each installed one that runs the model is measured once
with the node's own launch and speed probe, the figures are kept, and the node serves with the one whose typical
request is expected soonest. The operator's choice, and a single candidate, are served without measuring; a run
that dies or hangs falls back to today's order, said once."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from support.node_process import NodeProcess
from support.supervisor_policies import QUICK

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import NodeCapability, RatePoint
from meshnet_gguf.llama import binary as binary_module
from meshnet_gguf.llama import speed_choice
from meshnet_gguf.llama.binary import (
    BINARY_ENV_VAR,
    BINARY_NAME,
    INSTALL_ORDER,
    RELEASE_INSTALL,
    BinaryInfo,
    built_binary_dir,
    probe_binary,
)
from meshnet_gguf.llama.child import ChildSpec
from meshnet_gguf.llama.runnable import every_runnable_installed
from meshnet_gguf.llama.speed_choice import (
    TYPICAL_ANSWER_TOKENS,
    TYPICAL_PROMPT_TOKENS,
    BinaryCandidate,
    SpeedCache,
    choose_fastest,
    expected_request_s,
)
from meshnet_gguf.llama.speed_probe import SpeedProbePolicy
from meshnet_gguf.prepare.binary_choice import ONLY_ONE, OPERATORS_CHOICE
from meshnet_gguf.prepare.pipeline import prepare_launch

# A bound for a measuring run of the fake that never finishes loading: long enough for the fake to start.
HUNG_RUN_BOUND_S = 3.0


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The binaries `speed_choice` runs a measuring launch of, in order (the real runs still happen)."""
    runs: list[Path] = []
    real = speed_choice.measure_launch

    async def counted(child: ChildSpec, *args: object) -> NodeCapability:
        runs.append(child.binary.path)
        return await real(child, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(speed_choice, "measure_launch", counted)
    return runs


@pytest.fixture
def node_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A fresh place for the node's own installs and caches, measuring on, no operator's choice."""
    env = {
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "MESHNET_MEASURE_SPEED": "true",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(BINARY_ENV_VAR, raising=False)
    return env


def _second_install(first: BinaryInfo, env: dict[str, str]) -> None:
    """Install `first` again as llama.cpp's release build: its executable copied, everything beside it linked
    (the wheel finds its libraries by $ORIGIN), so the node finds two real llama-servers."""
    folder = built_binary_dir(env, RELEASE_INSTALL)
    folder.mkdir(parents=True)
    for item in first.path.parent.iterdir():
        if item.name == first.path.name:
            shutil.copy2(item, folder / BINARY_NAME)
        else:
            (folder / item.name).symlink_to(item)


def _real_installs(env: dict[str, str]) -> list[Path]:
    """Two real llama-servers that run models here, where the node looks by itself: the bundled wheel and the
    build made for this machine where both run here; else one of them installed twice."""
    real_env = {k: v for k, v in os.environ.items() if k not in (BINARY_ENV_VAR, "XDG_DATA_HOME", "XDG_CACHE_HOME")}
    runnable = every_runnable_installed(("F32",), env=real_env)
    if not runnable:
        pytest.skip("no real llama-server runs models here")
    for found in runnable:  # the node's own builds, linked into this test's data folder
        install = found.binary.path.parent.name
        if install in INSTALL_ORDER and found.binary.path.parent.parent.name == "meshnet":
            folder = built_binary_dir(env, install)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / BINARY_NAME).symlink_to(found.binary.path)
    if len(runnable) < 2:
        _second_install(runnable[0].binary, env)
    paths = [r.binary.path for r in every_runnable_installed(("F32",))]
    assert len(paths) >= 2, paths
    return paths


@pytest.mark.real_llama
def test_two_real_llama_servers_are_measured_once_and_the_faster_serves(
    tiny_gguf: Path, tmp_path: Path, node_home: dict[str, str], measured: list[Path], start_node: Callable[..., NodeProcess]
) -> None:
    installed = _real_installs(node_home)
    settings = NodeSettings(gguf=str(tiny_gguf), state_dir=tmp_path / "state", download_dir=tmp_path / "models")

    launch = prepare_launch(settings)
    choice = launch.binary_choice
    assert choice is not None and choice.by_measurement, choice
    assert measured == installed  # each once, in today's order
    figures = {entry.binary.path: entry.expected_s for entry in choice.measured}
    assert set(figures) == set(installed) and all(s is not None and s > 0 for s in figures.values())
    fastest = min(installed, key=lambda path: figures[path])  # type: ignore[arg-type,return-value]
    assert choice.chosen.path == launch.binary.path == launch.child.binary.path == fastest
    kept = json.loads((tmp_path / "cache" / "meshnet" / "llama-speeds.json").read_text())
    assert len(kept) == len(installed)

    # A second start, its dry run, doctor and the service installer measure nothing and say the same choice.
    again = prepare_launch(settings)
    assert again.binary.path == fastest and all(entry.cached for entry in again.binary_choice.measured)  # type: ignore[union-attr]
    printed = prepare_launch(settings, dry_run=True).describe()
    assert f"chosen:    {fastest}: the fastest of {len(installed)}" in printed
    assert printed.count("(measured at an earlier start)") == len(installed)
    from meshnet_gguf.cli.service import with_the_chosen_llama_server
    from meshnet_gguf.doctor.binary_choice import check_binary_choice

    (finding,) = check_binary_choice(settings)
    assert finding.status == "ok" and str(fastest) in finding.summary and "the fastest" in finding.summary
    assert with_the_chosen_llama_server(settings).llama_server == fastest
    assert measured == installed

    # A real node on the same box: it serves with the choice, measures no candidate, and its page says so.
    node = start_node("--gguf", str(tiny_gguf), env=node_home)
    node.wait_ready()
    document = httpx.get(node.url + "/status.json", timeout=5.0).json()
    shown = document["llama_server_choice"]
    assert shown["chosen"] == str(fastest) and shown["by_measurement"] is True
    assert {c["path"] for c in shown["candidates"]} == {str(p) for p in installed}
    assert all(c["cached"] and c["expected_request_s"] > 0 for c in shown["candidates"])
    assert str(fastest) in document["llama_server"]
    assert "measuring " not in node.log_text()


def _fake_candidate(fake: BinaryInfo, tmp_path: Path, name: str, env: dict[str, str] | None = None) -> BinaryCandidate:
    policy = dataclasses.replace(QUICK, speed_probe=SpeedProbePolicy(prompt_words=(4,)))
    child = ChildSpec(fake, ["--model", str(tmp_path / "m.gguf")], env or {})
    return BinaryCandidate(BinaryInfo(tmp_path / name, fake.source, fake.version, fake.build, fake.help_text), child, name, policy)


def _fakes_alive() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "fake_llama_server" in " ".join(p.cmdline())]


def test_a_run_that_dies_or_hangs_falls_back_to_todays_order_said_once(
    fake_llama: BinaryInfo, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = SpeedCache(tmp_path / "speeds.json")
    dies = _fake_candidate(fake_llama, tmp_path, "dies", {"FAKE_LLAMA_EXIT_ON_START": "3"})
    hangs = _fake_candidate(fake_llama, tmp_path, "hangs", {"FAKE_LLAMA_LOAD_S": "600"})
    runs = _fake_candidate(fake_llama, tmp_path, "runs")
    with caplog.at_level(logging.WARNING, logger=speed_choice.__name__):
        index, choice = choose_fastest([dies, hangs, runs], measure=True, cache=cache, timeout_s=HUNG_RUN_BOUND_S)
    # Today's order, passing over the one that died: the hung one is not known to be unable to serve.
    assert index == 1 and choice.chosen.path == tmp_path / "hangs" and not choice.by_measurement
    said = [r for r in caplog.records if r.name == speed_choice.__name__ and r.levelno == logging.WARNING]
    assert len(said) == 1 and "chosen by order, not speed" in said[0].getMessage()
    why = {entry.binary.path.name: entry.why_not for entry in choice.measured}
    assert "failed" in why["dies"] and "exited with code 3" in why["dies"]
    assert f"did not finish in {HUNG_RUN_BOUND_S:.0f} s" in why["hangs"] and why["runs"] is None
    assert _fakes_alive() == []  # every measuring run's child was ended
    # Only real figures are kept: a death or a hang is asked again at the next start.
    assert isinstance(cache.get("runs"), NodeCapability) and cache.get("dies") is None and cache.get("hangs") is None


@pytest.mark.parametrize("how", ["--llama-server", BINARY_ENV_VAR])
def test_the_operators_choice_is_served_and_nothing_is_measured(
    how: str, fake_llama_path: Path, tiny_gguf: Path, tmp_path: Path, node_home: dict[str, str], measured: list[Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    _second_install(probe_binary(fake_llama_path), node_home)  # another one installed, which would be measured
    given = {"llama_server": fake_llama_path} if how == "--llama-server" else {}
    if how == BINARY_ENV_VAR:
        monkeypatch.setenv(BINARY_ENV_VAR, str(fake_llama_path))
    settings = NodeSettings(gguf=str(tiny_gguf), state_dir=tmp_path / "state", download_dir=tmp_path / "models", **given)
    launch = prepare_launch(settings)
    assert launch.binary.path == fake_llama_path.resolve() and measured == []
    assert launch.binary_choice is not None and launch.binary_choice.how == OPERATORS_CHOICE


def test_a_single_installed_llama_server_is_not_measured(
    fake_llama_path: Path, tiny_gguf: Path, tmp_path: Path, node_home: dict[str, str], measured: list[Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(binary_module, "_bundled", lambda: None)  # no wheel here
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    _second_install(probe_binary(fake_llama_path), node_home)
    settings = NodeSettings(gguf=str(tiny_gguf), state_dir=tmp_path / "state", download_dir=tmp_path / "models")
    launch = prepare_launch(settings)
    assert launch.binary_choice is not None and launch.binary_choice.how == ONLY_ONE and measured == []


def test_the_score_is_a_typical_requests_expected_time_and_a_tie_keeps_the_order(fake_llama: BinaryInfo, tmp_path: Path) -> None:
    def figures(prefill: float, decode: float) -> NodeCapability:
        # The short prompt's rates (per-request overhead) do not count: the longest prompt's do.
        return NodeCapability(
            prefill_tokens_per_s=[RatePoint(ctx_tokens=20, tokens_per_s=1.0), RatePoint(ctx_tokens=500, tokens_per_s=prefill)],
            decode_tokens_per_s=[RatePoint(ctx_tokens=20, tokens_per_s=1.0), RatePoint(ctx_tokens=500, tokens_per_s=decode)],
        )

    assert expected_request_s(figures(1500.0, 30.0)) == pytest.approx(TYPICAL_PROMPT_TOKENS / 1500 + TYPICAL_ANSWER_TOKENS / 30)
    assert expected_request_s(None) is None
    cache = SpeedCache(tmp_path / "speeds.json")
    # A GPU build that prefills far faster wins over a CPU build that decodes a little faster.
    cache.put("cpu", figures(500.0, 40.0))
    cache.put("gpu", figures(20000.0, 35.0))
    cache.put("same-gpu", figures(20000.0, 35.0))
    cpu, gpu, same = (_fake_candidate(fake_llama, tmp_path, name) for name in ("cpu", "gpu", "same-gpu"))
    index, choice = choose_fastest([cpu, same, gpu], measure=False, cache=cache)
    assert index == 1 and choice.by_measurement and choice.chosen.path == tmp_path / "same-gpu"


@pytest.fixture(autouse=True)
def _no_leftover_children() -> Iterator[None]:
    yield
    assert _fakes_alive() == []
