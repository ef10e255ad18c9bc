"""`service install --worker`: the pool worker's unit."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshnet_gguf.cli import app
from meshnet_gguf.ops.worker_unit import SYSTEM_CACHE_DIR, WORKER_UNIT_NAME, plan_worker_install


def test_the_system_unit_runs_the_worker_as_the_service_user_with_its_cache_its_only_writable_folder() -> None:
    plan = plan_worker_install(["--host", "10.0.0.2", "--node-key", "KEY"], user_mode=False, command=["/opt/venv/bin/meshnet-gguf"])
    unit = next(f for f in plan.files if f.path.name == WORKER_UNIT_NAME).content
    assert f"ExecStart=/opt/venv/bin/meshnet-gguf worker --host 10.0.0.2 --node-key KEY --cache-dir {SYSTEM_CACHE_DIR}" in unit
    assert "User=meshnet" in unit and f"ReadWritePaths={SYSTEM_CACHE_DIR}" in unit and "Restart=on-failure" in unit
    assert plan.directories == [SYSTEM_CACHE_DIR]
    assert ["systemctl", "enable", "--now", WORKER_UNIT_NAME] in plan.commands


def test_a_cache_folder_given_is_kept_and_a_user_unit_has_no_system_user(tmp_path: Path) -> None:
    plan = plan_worker_install(["--host", "10.0.0.2", "--cache-dir", str(tmp_path / "c")], user_mode=True, start=False)
    unit = plan.files[0].content
    assert "User=" not in unit and f"--cache-dir {tmp_path / 'c'}" in unit and plan.directories == [tmp_path / "c"]
    assert plan.commands[-1] == ["systemctl", "--user", "enable", WORKER_UNIT_NAME]


def test_a_bad_worker_option_fails_at_install_not_at_boot() -> None:
    result = CliRunner().invoke(app, ["service", "install", "--worker", "--dry-run", "--hots", "10.0.0.2"])
    assert result.exit_code != 0 and "No such option: --hots" in result.output


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_the_worker_unit_is_scored_by_systemd(tmp_path: Path) -> None:
    plan = plan_worker_install(["--host", "10.0.0.2", "--node-key", "KEY"], user_mode=False, command=["/bin/true"])
    unit = tmp_path / WORKER_UNIT_NAME
    unit.write_text(next(f for f in plan.files if f.path.name == WORKER_UNIT_NAME).content)
    done = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True, text=True, timeout=60)
    assert "Overall exposure level" in done.stdout + done.stderr, done.stdout + done.stderr
