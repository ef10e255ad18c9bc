"""`models`, `serve --dry-run` and `doctor` print one memory figure for one model on one box.

Each runs as an operator runs it, on a recorded box (`MESHNET_HARDWARE_FIXTURE`)
with a llama-server whose `--help` is a recorded release's, and nothing
downloaded: all three must give the launch plan's need (weights + KV cache for
the context the plan runs + compute buffers), the same context, and the same
prompt cache on top. A quant that cannot fit is planned (and forced) at the
least context, and argv's `--ctx-size` says the same.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.hardware_fixtures import FIXTURES, write_recorded_llama

CLOSED_HUB = "http://127.0.0.1:9"  # nothing listens: a command that tried the hub fails loudly
COMMAND_TIMEOUT_S = 120
# "needs 4.8 GB with 131072 tokens of context", optionally "+ 2.4 GB of RAM for the prompt cache"
NEED = re.compile(r"needs (?P<need>[\d.]+ [KMGT]?B) with (?P<ctx>\d+) tokens of context(?:.*?\+ (?P<cache>[\d.]+ [KMGT]?B) of RAM)?")


@pytest.fixture(scope="module")
def recorded_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_recorded_llama(tmp_path_factory.mktemp("recorded-bin"))


def run(tmp_path: Path, box: str, llama: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHNET_", "HF_"))}
    env.update(
        HF_ENDPOINT=CLOSED_HUB, HF_HOME=str(tmp_path / "hf-home"), MESHNET_LOG_FORMAT="text",
        MESHNET_HARDWARE_FIXTURE=str(FIXTURES / box), MESHNET_LLAMA_SERVER=str(llama),
        MESHNET_DOWNLOAD_DIR=str(tmp_path / "models"), MESHNET_STATE_DIR=str(tmp_path / "state"),
    )  # fmt: skip
    return subprocess.run([sys.executable, "-m", "meshnet_gguf", *args], env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)


def figures_in(text: str) -> tuple[str, int, str | None]:
    found = NEED.search(text)
    assert found, text
    return found["need"], int(found["ctx"]), found["cache"]


def models_row(table: str, quant: str) -> tuple[str, int, str | None]:
    line = next(line for line in table.splitlines() if f" {quant} " in line)
    # ... QUANT SIZE SHARDS NEEDS CONTEXT CACHE FITS: from the right, FITS, CACHE, CONTEXT, NEEDS.
    cells = re.split(r"\s{2,}", line.strip())
    cache = cells[-2]
    return cells[-4], int(cells[-3]), None if cache == "-" else cache


@pytest.mark.parametrize(
    ("box", "model", "quant"),
    [
        ("cpu-only", "demo", "Q4_K_M"),
        ("cpu-only", "deepseek-v4-flash", "UD-IQ2_XXS"),  # does not fit: planned at the least context
        ("strix-halo-128", "deepseek-v4-flash", "UD-IQ2_XXS"),  # fits: planned with what memory allows
    ],
)
def test_models_serve_and_doctor_print_the_plans_need_and_context(
    tmp_path: Path, recorded_llama: Path, box: str, model: str, quant: str
) -> None:
    listing = run(tmp_path, box, recorded_llama, "models")
    assert listing.returncode == 0, listing.stderr
    from_models = models_row(listing.stdout, quant)

    served = run(tmp_path, box, recorded_llama, "serve", "--dry-run", "--gguf", f"{model}:{quant}", "--force")
    assert served.returncode == 0, served.stderr
    memory_line = next(line for line in served.stdout.splitlines() if line.startswith("memory:"))
    from_serve = figures_in(memory_line)
    plan_line = next(line for line in served.stdout.splitlines() if line.startswith("plan:"))
    assert f"context {from_serve[1]} tokens" in plan_line
    assert f"--ctx-size {from_serve[1]} " in served.stdout
    # Every "context N = slots x tokens" reason names the context the plan runs, never another.
    for reason in re.findall(r"context (\d+) = ", served.stdout):
        assert int(reason) == from_serve[1], served.stdout

    checked = run(tmp_path, box, recorded_llama, "doctor", "--gguf", f"{model}:{quant}", "--json", "--offline")
    memory = next(f for f in json.loads(checked.stdout)["findings"] if f["check"] == "memory")
    from_doctor = figures_in(memory["summary"])

    assert from_models == from_serve == from_doctor
    # A figure that is a minimum (the quant advisor's) says so wherever it is printed.
    assert re.search(r"needs at least [\d.]+ [KMGT]?B", served.stdout), served.stdout


def test_a_dry_run_of_a_model_that_does_not_fit_prints_its_plan_and_the_refusal(tmp_path: Path, recorded_llama: Path) -> None:
    dry = run(tmp_path, "cpu-only", recorded_llama, "serve", "--dry-run", "--gguf", "deepseek-v4-flash:UD-IQ2_XXS")
    assert dry.returncode == 2  # as serving it would
    assert "plan: CPU only" in dry.stdout and "(DOES NOT FIT)" in dry.stdout and "command:" in dry.stdout
    assert "--force:" not in dry.stdout  # nothing was forced: the plan is shown, not tried
    refusal = dry.stderr.strip()
    assert refusal.startswith("error: UD-IQ2_XXS needs at least") and refusal.endswith("Pass --force to try anyway.")
    assert "\n" not in refusal and "Traceback" not in dry.stderr
    # Serving refuses for the same reason before any download, and --force plans the same launch.
    served = run(tmp_path, "cpu-only", recorded_llama, "serve", "--offline", "--gguf", "deepseek-v4-flash:UD-IQ2_XXS")
    assert served.returncode == 2 and refusal in served.stderr
    forced = run(tmp_path, "cpu-only", recorded_llama, "serve", "--dry-run", "--force", "--gguf", "deepseek-v4-flash:UD-IQ2_XXS")
    assert forced.returncode == 0 and forced.stdout.splitlines()[-1] == dry.stdout.splitlines()[-1]
