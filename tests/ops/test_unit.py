"""The systemd unit and config that `service install` writes, checked by systemd's own verifier."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshnet_gguf.cli import app
from meshnet_gguf.common.atomic_file import TEMP_SUFFIX
from meshnet_gguf.common.settings import CONFIG_FILE_ENV, NodeSettings
from meshnet_gguf.ops.unit import (
    SERVICE_USER,
    UNIT_NAME,
    apply_plan,
    describe_status,
    parse_show,
    plan_install,
    plan_uninstall,
    service_command,
)

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed (Debian package `systemd`; CI installs it)"
)
# Folders outside any home and any temp dir, as on a typical node install.
NEUTRAL_INTERPRETER = [Path("/usr/bin/python3")]


def _unit_entries(text: str) -> dict[str, list[str]]:
    """`Key=value` lines of a unit as key -> values (keys may repeat)."""
    entries: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith(("#", "[")):
            entries.setdefault(key, []).append(value)
    return entries


def _verify(unit_path: Path, *, user: bool, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    argv = [SYSTEMD_ANALYZE, *(["--user"] if user else []), "verify", "--man=no", str(unit_path)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)


def _write_unit(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "units" / UNIT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _settings(**values: object) -> NodeSettings:
    return NodeSettings(**values)  # type: ignore[arg-type]


def test_system_unit_has_the_promised_directives() -> None:
    settings = _settings(gguf="owner/name:Q4_K_M", drain_grace_s=45, stop_timeout_s=10)
    plan = plan_install(settings, user_mode=False, interpreter=NEUTRAL_INTERPRETER)
    unit = _unit_entries(plan.files[1].content)
    assert unit["Type"] == ["notify"]
    assert unit["NotifyAccess"] == ["main"]
    assert unit["Restart"] == ["on-failure"]
    assert unit["KillMode"] == ["mixed"]
    assert int(unit["TimeoutStopSec"][0]) > 45 + 10
    assert int(unit["TimeoutStartSec"][0]) >= 15 * 60
    assert int(unit["WatchdogSec"][0]) > 0
    assert unit["NoNewPrivileges"] == ["yes"]
    assert unit["ProtectSystem"] == ["strict"]
    assert unit["PrivateTmp"] == ["yes"]
    assert unit["ProtectHome"] == ["yes"]
    assert unit["User"] == [SERVICE_USER]
    assert set(unit["SupplementaryGroups"][0].split()) == {"render", "video"}
    assert "PrivateDevices" not in unit  # would hide /dev/dri and /dev/kfd
    assert unit["ReadWritePaths"] == ["/var/lib/meshnet-gguf"]
    assert unit["StateDirectory"] == ["meshnet-gguf"]
    assert unit["ExecStart"][0].endswith(" serve")
    assert unit["Environment"][0] == f"{CONFIG_FILE_ENV}=/etc/meshnet-gguf/node.toml"


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_the_system_unit(tmp_path: Path) -> None:
    settings = _settings(gguf="owner/name:Q4_K_M", port=8090)
    plan = plan_install(settings, user_mode=False)
    unit_path = _write_unit(tmp_path, plan.files[1].content)
    done = _verify(unit_path, user=False)
    assert done.returncode == 0, done.stderr
    # verify warns (exit 0) about unknown keys; any line about our unit is a defect.
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if UNIT_NAME in line]
    assert complaints == []


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_the_user_unit(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    (tmp_path / "run").mkdir(mode=0o700)
    plan = plan_install(_settings(gguf="owner/name"), user_mode=True, environ=env)
    unit_path = _write_unit(tmp_path, plan.files[0].content)
    done = _verify(unit_path, user=True, env=env)
    assert done.returncode == 0, done.stderr
    assert [line for line in (done.stdout + done.stderr).splitlines() if UNIT_NAME in line] == []


@needs_systemd_analyze
def test_verify_is_not_vacuous(tmp_path: Path) -> None:
    """The same check fails on a unit whose ExecStart cannot run, so passing above means something."""
    plan = plan_install(_settings(), user_mode=False, command=[str(tmp_path / "no-such-meshnet-gguf")])
    done = _verify(_write_unit(tmp_path, plan.files[1].content), user=False)
    assert done.returncode != 0
    assert "no-such-meshnet-gguf" in done.stdout + done.stderr


def test_exec_start_is_this_installations_executable() -> None:
    command = service_command()
    assert Path(command[0]).is_absolute()
    assert os.access(command[0], os.X_OK)
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "serve" in done.stdout


def test_paths_with_spaces_and_percent_are_escaped(tmp_path: Path) -> None:
    odd = tmp_path / "my models 100%"
    plan = plan_install(_settings(download_dir=odd), user_mode=False, command=["/opt/mesh net/bin/meshnet-gguf"], interpreter=[])
    unit = _unit_entries(plan.files[1].content)
    assert unit["ExecStart"] == ['"/opt/mesh net/bin/meshnet-gguf" serve']
    assert f'"{odd.parent}/my models 100%%"' in unit["ReadWritePaths"][0]


@pytest.mark.parametrize(
    ("download_dir", "interpreter", "expected"),
    [
        ("/srv/meshnet/models", NEUTRAL_INTERPRETER, "yes"),
        ("/home/alice/models", NEUTRAL_INTERPRETER, "read-only"),
        ("/srv/meshnet/models", [Path("/root/.pyenv/versions/3.11/bin/python3.11")], "read-only"),
    ],
)
def test_protect_home_only_where_the_node_needs_nothing_from_homes(download_dir: str, interpreter: list[Path], expected: str) -> None:
    plan = plan_install(_settings(download_dir=download_dir), user_mode=False, interpreter=interpreter)
    unit = _unit_entries(plan.files[1].content)
    assert unit["ProtectHome"] == [expected]
    assert download_dir in unit["ReadWritePaths"][0].split()


def test_operator_chosen_dirs_are_writable_and_created_for_the_service_user() -> None:
    plan = plan_install(_settings(download_dir="/srv/models", state_dir="/srv/meshnet-state"), user_mode=False, interpreter=[])
    unit = _unit_entries(plan.files[1].content)
    assert sorted(unit["ReadWritePaths"][0].split()) == ["/srv/meshnet-state", "/srv/models"]
    assert "StateDirectory" not in unit
    assert sorted(map(str, plan.directories)) == ["/srv/meshnet-state", "/srv/models"]
    assert plan.directory_owner == SERVICE_USER
    assert plan.prepare_commands == [["systemd-sysusers", "/etc/sysusers.d/meshnet-gguf.conf"]]


def test_warnings_name_paths_the_service_cannot_see(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    plan = plan_install(_settings(gguf=str(model)), user_mode=False, interpreter=[])
    assert any("PrivateTmp" in w and str(model) in w for w in plan.warnings)


def test_config_round_trips_through_meshnet_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What install writes is what the service's `NodeSettings()` reads back."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    chosen = _settings(gguf="m.gguf", port=9123, parallel=2, llama_args=["-lv", "4"], api_key="s3cret", drain_grace_s=12.5)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    plan = plan_install(chosen, user_mode=True, environ=env, interpreter=[])
    config = next(f for f in plan.files if f.path.name == "node.toml")
    config_path = tmp_path / "node.toml"
    config_path.write_text(config.content)
    for name in list(os.environ):
        if name.startswith("MESHNET_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(CONFIG_FILE_ENV, str(config_path))
    loaded = NodeSettings()
    assert loaded.gguf == str(model)  # made absolute: the service does not run from the operator's cwd
    assert (loaded.port, loaded.parallel, loaded.llama_args) == (9123, 2, ["-lv", "4"])
    assert loaded.api_key == "s3cret" and loaded.drain_grace_s == 12.5
    assert loaded.download_dir.is_absolute() and loaded.state_dir.is_absolute()
    # Secrets are in the file (the service needs them) but never in --dry-run output.
    assert "s3cret" not in plan.describe(chosen)


class RecordingRunner:
    """systemctl needs a running systemd (PID 1), which test machines lack; record instead."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.commands.append(list(argv))
        return subprocess.CompletedProcess(list(argv), 0, "", "")


def test_user_install_and_uninstall_write_and_remove_real_files(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    settings = _settings(gguf="owner/name", api_key="k", download_dir=tmp_path / "models", state_dir=tmp_path / "state")
    runner = RecordingRunner()
    plan = plan_install(settings, user_mode=True, environ=env, start=False)
    apply_plan(plan, runner)

    unit_path = tmp_path / "config" / "systemd" / "user" / UNIT_NAME
    config_path = tmp_path / "config" / "meshnet-gguf" / "node.toml"
    assert unit_path.read_text() == plan.files[0].content
    assert stat.S_IMODE(config_path.stat().st_mode) == 0o600  # holds the API key
    assert (tmp_path / "models").is_dir() and (tmp_path / "state").is_dir()
    assert runner.commands == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", UNIT_NAME],
    ]
    assert not list(tmp_path.rglob(f"*{TEMP_SUFFIX}"))

    runner = RecordingRunner()
    apply_plan(plan_uninstall(user_mode=True, environ=env), runner)
    assert not unit_path.exists() and not config_path.exists()
    assert (tmp_path / "models").is_dir()  # models are never deleted by uninstall
    assert runner.commands == [
        ["systemctl", "--user", "disable", "--now", UNIT_NAME],
        ["systemctl", "--user", "daemon-reload"],
    ]


def test_failed_systemctl_is_reported_with_its_output(tmp_path: Path) -> None:
    from meshnet_gguf.ops.unit import ServiceError

    def failing(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(list(argv), 1, "", "Failed to connect to bus: No medium found")

    plan = plan_install(_settings(), user_mode=True, environ={"XDG_CONFIG_HOME": str(tmp_path)}, interpreter=[])
    with pytest.raises(ServiceError, match="No medium found"):
        apply_plan(plan, failing)


# --- CLI ---------------------------------------------------------------------------


def test_cli_install_dry_run_takes_serve_options(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["service", "install", "--user", "--dry-run", "--gguf", "owner/name:Q4_K_M", "--port", "9005",
         "--llama-arg=-lv", "--llama-arg=4", "--api-key", "topsecret"],
        env={"XDG_CONFIG_HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "Type=notify" in result.output
    assert 'gguf = "owner/name:Q4_K_M"' in result.output and "port = 9005" in result.output
    assert '"-lv",' in result.output
    assert "topsecret" not in result.output
    assert not (tmp_path / "systemd").exists()  # a dry run writes nothing


def test_cli_install_writes_the_models_beside_the_first_as_serve_reads_them(tmp_path: Path) -> None:
    small = tmp_path / "small.gguf"
    small.write_bytes(b"GGUF")
    result = CliRunner().invoke(
        app,
        ["service", "install", "--user", "--dry-run", "--gguf", "owner/name:Q4_K_M", "--gguf", "small.gguf,ctx=2048,idle=60",
         "--gguf", "demo,pin"],
        env={"XDG_CONFIG_HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert 'gguf = "owner/name:Q4_K_M"' in result.output
    written = result.output[result.output.index("models = [") :]
    assert '{ gguf = "small.gguf", ctx_size = 2048, parallel = 1, pinned = false, idle_unload_s = 60.0 }' in written
    assert '{ gguf = "demo", parallel = 1, pinned = true }' in written  # no null in TOML: unset fields are left out


def test_cli_install_rejects_what_serve_rejects() -> None:
    result = CliRunner().invoke(app, ["service", "install", "--dry-run", "--no-such-option"])
    assert result.exit_code == 2


def test_every_serve_option_maps_to_a_setting() -> None:
    """A new `serve` flag must reach the service's config, not vanish silently."""
    from typer.main import get_command

    from meshnet_gguf.cli.service import _SERVE_NEGATING_FLAGS, _SERVE_ONLY_OPTIONS, _SERVE_OPTION_FIELDS

    serve = get_command(app).commands["serve"]  # type: ignore[attr-defined]
    for param in serve.params:
        name = str(param.name)
        if name in _SERVE_ONLY_OPTIONS:
            continue
        field = _SERVE_NEGATING_FLAGS.get(name) or _SERVE_OPTION_FIELDS.get(name, name)
        assert field in NodeSettings.model_fields, name


def test_cli_install_keeps_no_build(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["service", "install", "--user", "--dry-run", "--gguf", "owner/name:Q4_K_M", "--no-build"],
        env={"XDG_CONFIG_HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "build = false" in result.output


def test_the_unit_runs_the_llama_server_built_for_this_machine(tmp_path: Path, fake_llama_path: Path) -> None:
    # A build in the operator's data folder is what the node would run; the service (another user, another
    # environment) would not look there and would fall back to the bundled build this CPU may not run.
    built = tmp_path / "data" / "meshnet" / "llama-server" / "llama-server"
    built.parent.mkdir(parents=True)
    shutil.copy2(fake_llama_path, built)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = CliRunner().invoke(app, ["service", "install", "--user", "--dry-run", "--gguf", "owner/name:Q4_K_M"], env=env)
    assert result.exit_code == 0, result.output
    assert f'llama_server = "{built}"' in result.output
    # Without a build there, nothing is pinned: the node searches as usual.
    shutil.rmtree(tmp_path / "data")
    result = CliRunner().invoke(app, ["service", "install", "--user", "--dry-run", "--gguf", "owner/name:Q4_K_M"], env=env)
    assert result.exit_code == 0 and "llama_server" not in result.output


def test_status_from_systemctl_show_output() -> None:
    shown = parse_show(
        "LoadState=loaded\nUnitFileState=enabled\nActiveState=activating\nSubState=start\n"
        "StatusText=loading tensors 43% (1.2 GiB of 2.8 GiB), 12 s\nMainPID=4242\nNRestarts=1\n"
        "ExecMainStartTimestamp=Mon 2026-11-30 14:00:00 UTC\nResult=success\n"
    )
    text = describe_status(shown)
    assert "activating (start), enabled at boot" in text
    assert "loading tensors 43%" in text and "4242" in text and "restarts: 1" in text
    assert "not installed" in describe_status(parse_show("LoadState=not-found\nActiveState=inactive\n"))
