"""`meshnet-gguf serve --dry-run` as an operator runs it, on recorded machines (issue 4's done-when).

The node probes a recorded box through `MESHNET_HARDWARE_FIXTURE` and plans
with a llama-server whose `--help` is a recorded release's (b10434), so the
plans do not depend on this machine or on which binary is installed. A dry run
downloads nothing: the hub is pointed at a closed port, and the download dir
must stay empty.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.devtools.hf_server import LocalHub
from meshnet_gguf.prepare.pipeline import PreparedLaunch, prepare_launch
from support.hardware_fixtures import FIXTURES, write_recorded_llama
from support.local_hub_fixtures import ROOT_SPLIT, hub, hub_root  # noqa: F401

# Nothing listens here: a dry run that tried the hub would fail loudly rather than download.
CLOSED_HUB = "http://127.0.0.1:9"
DRY_RUN_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def recorded_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_recorded_llama(tmp_path_factory.mktemp("recorded-bin"))


def dry_run(tmp_path: Path, box: str | None, *args: str, llama: Path, hub_endpoint: str = CLOSED_HUB) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHNET_", "HF_"))}
    env.update(HF_ENDPOINT=hub_endpoint, HF_HOME=str(tmp_path / "hf-home"), MESHNET_LOG_FORMAT="text")
    if box is not None:
        env["MESHNET_HARDWARE_FIXTURE"] = str(FIXTURES / box)
    argv = [
        sys.executable, "-m", "meshnet_gguf", "serve", *args, "--dry-run", "--llama-server", str(llama),
        "--download-dir", str(tmp_path / "models"), "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S)


def downloaded(tmp_path: Path) -> list[Path]:
    models = tmp_path / "models"
    return [p for p in models.rglob("*") if p.is_file()] if models.exists() else []


def test_strix_halo_plans_ud_iq3_xxs_all_on_vulkan_without_mmap_before_any_download(tmp_path: Path, recorded_llama: Path) -> None:
    done = dry_run(tmp_path, "strix-halo-128", "--gguf", "deepseek-v4-flash", "--quant", "UD-IQ3_XXS", llama=recorded_llama)

    assert done.returncode == 0, done.stderr
    out = done.stdout
    hardware = next(line for line in out.splitlines() if line.startswith("hardware:"))
    assert "Strix Halo" in hardware and "unified" in hardware and "vulkan" in hardware and "Vulkan0" in hardware
    plan = next(line for line in out.splitlines() if line.startswith("plan:"))
    assert plan.startswith("plan: vulkan on Vulkan0, 44/44 layers") and "no-mmap" in plan
    assert "UD-IQ3_XXS" in out and "<- best" in out  # the quant advice
    command = next(line for line in out.splitlines() if line.startswith("command:"))
    for expected in ("--device Vulkan0", "--n-gpu-layers 44", "--load-mode none", "--alias deepseek-v4-flash:UD-IQ3_XXS"):
        assert expected in command
    assert command.split().count("--parallel") == 1 and "--parallel 4" in command
    assert "DeepSeek-V4-Flash-UD-IQ3_XXS-00001-of-00004.gguf" in command
    assert "planned from the catalog's figures" in out
    assert "CPU mode" not in out + done.stderr and "CPU only" not in out
    # The plan is printed once: not logged beside the printout, and its argv only on the command line.
    assert out.count("hardware:  CPU AMD RYZEN AI MAX+ 395") == 1 and out.count("plan: ") == 1
    assert out.count("--n-gpu-layers 44") == 1
    assert "launch plan" not in done.stderr and "hardware:" not in done.stderr
    # The prompt cache is bounded by the plan and counted in its memory line.
    assert "--cache-ram " in command and "prompt cache" in out
    assert downloaded(tmp_path) == []


def test_iq4_xs_is_refused_naming_the_quant_that_fits(tmp_path: Path, recorded_llama: Path) -> None:
    done = dry_run(tmp_path, "strix-halo-128", "--gguf", "deepseek-v4-flash", "--quant", "IQ4_XS", llama=recorded_llama)

    assert done.returncode != 0
    assert "error: IQ4_XS needs" in done.stderr
    assert "UD-IQ3_XXS fits" in done.stderr and "--quant UD-IQ3_XXS" in done.stderr and "--force" in done.stderr
    assert "Traceback" not in done.stderr
    assert downloaded(tmp_path) == []


def test_force_plans_iq4_xs_anyway_and_says_it_does_not_fit(tmp_path: Path, recorded_llama: Path) -> None:
    done = dry_run(tmp_path, "strix-halo-128", "--gguf", "deepseek-v4-flash:IQ4_XS", "--force", llama=recorded_llama)

    assert done.returncode == 0, done.stderr
    plan = next(line for line in done.stdout.splitlines() if line.startswith("plan:"))
    assert plan.startswith("plan: vulkan on Vulkan0,") and "/44 layers" in plan
    assert "DOES NOT FIT" in done.stdout
    assert "--force: trying anyway although IQ4_XS needs" in done.stdout
    assert "Pass --force" not in done.stdout and "pass --force" not in done.stdout  # it was given
    assert downloaded(tmp_path) == []


def test_no_quant_lists_the_advice_and_asks_for_one(tmp_path: Path, recorded_llama: Path) -> None:
    done = dry_run(tmp_path, "strix-halo-128", "--gguf", "deepseek-v4-flash", llama=recorded_llama)

    assert done.returncode != 0
    assert "choose one with --quant" in done.stderr
    assert "UD-IQ3_XXS" in done.stderr and "<- best" in done.stderr


def test_cpu_box_plans_a_tiny_local_model_cpu_only(tmp_path: Path, recorded_llama: Path, tiny_gguf: Path) -> None:
    done = dry_run(tmp_path, "cpu-only", "--gguf", str(tiny_gguf), llama=recorded_llama)

    assert done.returncode == 0, done.stderr
    assert "no GPU: CPU only" in done.stdout
    plan = next(line for line in done.stdout.splitlines() if line.startswith("plan:"))
    assert plan.startswith("plan: CPU only")
    assert "--n-gpu-layers 0" in done.stdout and "--load-mode" not in done.stdout
    # A local file is named by its stem.
    assert "--alias tiny " in done.stdout and done.stdout.splitlines()[1].startswith("model:     tiny (")


def test_a_split_local_model_is_named_without_its_shard_suffix(tmp_path: Path, recorded_llama: Path, tiny_split_gguf: Path) -> None:
    done = dry_run(tmp_path, "cpu-only", "--gguf", str(tiny_split_gguf), llama=recorded_llama)

    assert done.returncode == 0, done.stderr
    assert "--alias tiny " in done.stdout and "tiny-00001-of-00003.gguf" in done.stdout


def test_llama_arg_parallel_sets_the_proxy_slots_too(tmp_path: Path, recorded_llama: Path, tiny_gguf: Path) -> None:
    settings = NodeSettings(
        gguf=str(tiny_gguf), llama_server=recorded_llama, hardware_fixture=FIXTURES / "cpu-only",
        llama_args=["--parallel", "2"], download_dir=tmp_path / "models",
    )  # fmt: skip
    launch: PreparedLaunch = prepare_launch(settings, dry_run=True)

    assert launch.settings.parallel == 2 and launch.plan is not None and launch.plan.parallel == 2
    # the one parse of --llama-arg: the plan leaves --parallel to the operator's own spelling
    assert launch.child.args.count("--parallel") == 1 and launch.child.args[launch.child.args.index("--parallel") + 1] == "2"


def test_a_hub_model_is_planned_from_its_header_once_on_disk_and_never_fetched(
    tmp_path: Path,
    recorded_llama: Path,
    hub: LocalHub,  # noqa: F811
) -> None:
    spec = f"{ROOT_SPLIT}:Q8_0"
    not_yet = dry_run(tmp_path, "cpu-only", "--gguf", spec, llama=recorded_llama, hub_endpoint=hub.endpoint)
    assert not_yet.returncode != 0
    assert "not downloaded yet" in not_yet.stderr and f"meshnet-gguf download {ROOT_SPLIT}" in not_yet.stderr
    assert hub.bytes_served(ROOT_SPLIT) == 0 and not [p for p in downloaded(tmp_path) if p.suffix == ".gguf"]

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHNET_", "HF_"))}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf-home"))
    fetch = [sys.executable, "-m", "meshnet_gguf", "download", spec, "--download-dir", str(tmp_path / "models")]
    subprocess.run(fetch, env=env, check=True, capture_output=True, timeout=DRY_RUN_TIMEOUT_S)
    hub.reset_counters()

    done = dry_run(tmp_path, "cpu-only", "--gguf", spec, llama=recorded_llama, hub_endpoint=hub.endpoint)
    assert done.returncode == 0, done.stderr
    assert hub.bytes_served(ROOT_SPLIT) == 0
    assert f"--alias {ROOT_SPLIT}:Q8_0" in done.stdout and "Tiny-Q8_0-00001-of-00003.gguf" in done.stdout
    assert "plan: CPU only" in done.stdout and "a dry run does not re-check sha256" in done.stdout


def test_serve_refuses_a_quant_that_cannot_fit_before_downloading_a_byte(tmp_path: Path, recorded_llama: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHNET_", "HF_"))}
    env.update(HF_ENDPOINT=CLOSED_HUB, HF_HOME=str(tmp_path / "hf-home"), MESHNET_HARDWARE_FIXTURE=str(FIXTURES / "strix-halo-128"))
    argv = [
        sys.executable, "-m", "meshnet_gguf", "serve", "--gguf", "deepseek-v4-flash", "--quant", "IQ4_XS",
        "--llama-server", str(recorded_llama), "--download-dir", str(tmp_path / "models"), "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S)

    assert done.returncode == 2
    assert "UD-IQ3_XXS fits" in done.stderr and "downloading" not in done.stderr
    assert downloaded(tmp_path) == []


def test_a_hardware_fixture_that_is_not_a_recorded_machine_is_a_clear_error(tmp_path: Path, recorded_llama: Path, tiny_gguf: Path) -> None:
    done = dry_run(tmp_path, str(tmp_path / "nowhere"), "--gguf", str(tiny_gguf), llama=recorded_llama)

    assert done.returncode == 2
    assert "MESHNET_HARDWARE_FIXTURE" in done.stderr and "not a recorded machine" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_repo_form_gets_the_same_advice_and_figures_as_the_catalog_form(tmp_path: Path, recorded_llama: Path) -> None:
    """DeepSeek-V4-Flash by catalog id and by repo id: one memory model, so one set of figures."""
    by_id = dry_run(tmp_path, "strix-halo-128", "--gguf", "deepseek-v4-flash:UD-IQ3_XXS", llama=recorded_llama)
    by_repo = dry_run(tmp_path, "strix-halo-128", "--gguf", "unsloth/DeepSeek-V4-Flash-GGUF:UD-IQ3_XXS", llama=recorded_llama)
    assert by_id.returncode == 0 and by_repo.returncode == 0, by_id.stderr + by_repo.stderr

    def figures(out: str) -> list[str]:
        lines = out.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("quants:"))
        advice = lines[start : start + 5]
        memory = [line for line in lines if line.startswith(("memory:", "  = weights"))]
        return advice + memory

    assert "<- best" in by_repo.stdout  # the repo form gives quant advice (the hub is closed: the catalog's quants)
    assert figures(by_repo.stdout) == figures(by_id.stdout)
    assert "107.8 GB at least: fits on the GPU <- best" in by_repo.stdout
