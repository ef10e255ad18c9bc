"""Run the node unattended under systemd: plan, write and remove its unit and config.

`plan_install` turns the node's settings into everything an install writes
(unit, TOML config read through `MESHNET_CONFIG`, a sysusers.d entry for the
dedicated user) and the commands it runs; `apply_plan` carries it out. Keeping
the plan a value lets `--dry-run` print exactly what would happen and lets the
tests check the unit with `systemd-analyze verify` without touching the system.

Why the unit looks the way it does:
- `Type=notify` + `NotifyAccess=main`: systemd learns "started" from the node's
  READY=1, sent only once llama-server answers /health, never from a fork; a
  llama-server child cannot speak for the node.
- `TimeoutStartSec` bounds a stuck start; the node extends it
  (`EXTEND_TIMEOUT_USEC`) while a download or a model load still progresses,
  so a 100 GB model is never killed for being slow, only for being stuck.
- `WatchdogSec`: the node's own main loop pings while healthy; a wedged node is
  restarted by `Restart=on-failure`.
- `KillMode=mixed`: SIGTERM reaches the node alone, which drains in-flight
  streams and then stops llama-server itself; whatever is left after
  `TimeoutStopSec` (drain grace + child stop + margin) is SIGKILLed.
- `/dev/dri` and `/dev/kfd` are reachable (no `PrivateDevices`; `DevicePolicy=closed`
  with an allow-list of the GPU nodes instead) and the user is in `render` and
  `video`, so Vulkan and ROCm see the GPU. Everything else is as tight as that
  allows: no capabilities, `@system-service` system calls, four address families,
  other processes invisible, `UMask=0077` (`systemd-analyze security` scores it
  1.7, where a plain unit scores 9.6).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from meshnet_gguf.common.atomic_file import write_atomically
from meshnet_gguf.common.settings import CONFIG_FILE_ENV, NodeSettings

SERVICE_NAME = "meshnet-gguf"
UNIT_NAME = f"{SERVICE_NAME}.service"
SERVICE_USER = "meshnet"
SYSTEM_STATE_DIR = Path("/var/lib") / SERVICE_NAME
SYSTEM_CONFIG_DIR = Path("/etc") / SERVICE_NAME
CONFIG_FILE_NAME = "node.toml"
DEVICE_GROUPS = ("render", "video")
# The devices the sandbox admits (DevicePolicy=closed adds only null, zero, random and the like):
# every DRM node under /dev/dri (Vulkan, and ROCm's render nodes), ROCm's /dev/kfd, NVIDIA's
# control, per-GPU and unified-memory nodes (its Vulkan driver opens them). A group whose
# driver is not loaded is skipped by systemd with a note.
GPU_DEVICES = ("char-drm", "/dev/kfd", "char-nvidiactl", "char-nvidia-frontend", "char-nvidia-uvm", "char-nvidia-caps")

# Long enough for a big model read from a slow disk before the first progress
# report extends it; a start that shows no progress for this long is stuck.
START_TIMEOUT_S = 30 * 60
# The node pings every half of this. A minute of an unresponsive event loop is
# a wedged node, not a slow request (requests never block the loop).
WATCHDOG_S = 60
# Room after the drain grace and llama-server's SIGTERM->SIGKILL window for the
# usage flush and process exit.
STOP_MARGIN_S = 15
RESTART_DELAY_S = 5
# Five failed starts in ten minutes is a broken setup: stop restarting and let
# `systemctl status` show why, instead of burning the GPU in a loop.
START_LIMIT_BURST = 5
START_LIMIT_INTERVAL_S = 600
# 256 concurrent streams hold two sockets each, plus model shards and logs.
OPEN_FILES_LIMIT = 65536
SYSTEMCTL_TIMEOUT_S = 60.0

HOME_ROOTS = (Path("/home"), Path("/root"), Path("/run/user"))
TEMP_ROOTS = (Path("/tmp"), Path("/var/tmp"))
# Settings that must be absolute in a config the service reads from another cwd.
_PATH_SETTINGS = ("llama_server", "download_dir", "state_dir")
_SECRET_SETTINGS = ("api_key", "enrolment_secret")

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


class ServiceError(RuntimeError):
    """An install, uninstall or status step failed; the message says which and what to do."""


@dataclass(frozen=True)
class ServiceLayout:
    """Where a system or a user install puts its files."""

    user_mode: bool
    unit_path: Path
    config_path: Path
    sysusers_path: Path | None
    default_state_dir: Path
    default_download_dir: Path

    @classmethod
    def system(cls) -> ServiceLayout:
        return cls(
            user_mode=False,
            unit_path=Path("/etc/systemd/system") / UNIT_NAME,
            config_path=SYSTEM_CONFIG_DIR / CONFIG_FILE_NAME,
            sysusers_path=Path("/etc/sysusers.d") / f"{SERVICE_NAME}.conf",
            default_state_dir=SYSTEM_STATE_DIR,
            default_download_dir=SYSTEM_STATE_DIR / "models",
        )

    @classmethod
    def user(cls, environ: Mapping[str, str] | None = None) -> ServiceLayout:
        env = os.environ if environ is None else environ
        config_home = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        defaults = NodeSettings.model_fields
        return cls(
            user_mode=True,
            unit_path=config_home / "systemd" / "user" / UNIT_NAME,
            config_path=config_home / SERVICE_NAME / CONFIG_FILE_NAME,
            sysusers_path=None,
            default_state_dir=defaults["state_dir"].get_default(call_default_factory=True),
            default_download_dir=defaults["download_dir"].get_default(call_default_factory=True),
        )

    def systemctl(self, *args: str) -> list[str]:
        return ["systemctl", *(["--user"] if self.user_mode else []), *args]


@dataclass(frozen=True)
class PlannedFile:
    path: Path
    content: str
    mode: int
    group: str | None = None  # chgrp to this group (the service user's) so it can read a 0640 file
    secret: bool = False  # print with secrets blanked in --dry-run


@dataclass(frozen=True)
class ServicePlan:
    """Paths are as on the target system; `root` is where that system's `/` is (tests: a temp dir)."""

    layout: ServiceLayout
    files: list[PlannedFile] = field(default_factory=list)
    directories: list[Path] = field(default_factory=list)
    directory_owner: str | None = None
    # Run after the files are written and before directories are made: creates the user.
    prepare_commands: list[list[str]] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)
    removals: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    root: Path = Path("/")

    def on_disk(self, path: Path) -> Path:
        return self.root / path.relative_to("/")

    def describe(self, settings: NodeSettings | None = None) -> str:
        """What `apply_plan` would do, for `--dry-run` (secrets blanked)."""
        lines: list[str] = []
        for planned in self.files:
            content = _blank_secrets(planned.content, settings) if planned.secret else planned.content
            lines += [f"# write {planned.path} (mode {planned.mode:o})", content.rstrip(), ""]
        lines += ["$ " + " ".join(command) for command in self.prepare_commands]
        owner = f", owner {self.directory_owner}" if self.directory_owner else ""
        lines += [f"# create {directory}{owner}" for directory in self.directories]
        lines += [f"# remove {path}" for path in self.removals]
        lines += ["$ " + " ".join(command) for command in self.commands]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines) + "\n"


def _blank_secrets(text: str, settings: NodeSettings | None) -> str:
    if settings is None:
        return text
    for name in _SECRET_SETTINGS:
        value = getattr(settings, name, None)
        if value:
            text = text.replace(value, "[REDACTED]")
    return text


# --- what the service runs ------------------------------------------------------


def service_command() -> list[str]:
    """The `meshnet-gguf` of this installation (the venv's script), else `python -m meshnet_gguf`."""
    beside_python = Path(sys.executable).parent / SERVICE_NAME
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return [str(beside_python.absolute())]
    on_path = shutil.which(SERVICE_NAME)
    if on_path:
        return [str(Path(on_path).absolute())]
    return [str(Path(sys.executable).absolute()), "-m", "meshnet_gguf"]


def interpreter_paths() -> list[Path]:
    """Where this Python really lives: a venv's python is often a link into a home folder."""
    return [Path(sys.executable).resolve(), Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()]


def _is_under(path: Path, roots: Iterable[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


# --- config file -------------------------------------------------------------------


def config_values(settings: NodeSettings, layout: ServiceLayout) -> dict[str, Any]:
    """The settings the operator chose, made absolute, with the service's own directories."""
    chosen = settings.model_dump(mode="json", include=set(settings.model_fields_set))
    values: dict[str, Any] = {k: v for k, v in chosen.items() if v is not None}
    for name, default in (("download_dir", layout.default_download_dir), ("state_dir", layout.default_state_dir)):
        values[name] = str(Path(values.get(name) or default).expanduser().absolute())
    for name in _PATH_SETTINGS:
        if name in values:
            values[name] = str(Path(values[name]).expanduser().absolute())
    gguf = values.get("gguf")
    if isinstance(gguf, str) and Path(gguf).expanduser().exists():
        # A local file given relative to the operator's shell; the service runs from /.
        values["gguf"] = str(Path(gguf).expanduser().absolute())
    if "models" in values:  # the models beside the first: TOML has no null, and their files too are found from /
        values["models"] = [_model_entry_values(entry) for entry in values["models"]]
    return values


def _model_entry_values(entry: Mapping[str, Any]) -> dict[str, Any]:
    kept = {k: v for k, v in entry.items() if v is not None}
    if Path(kept["gguf"]).expanduser().exists():
        kept["gguf"] = str(Path(kept["gguf"]).expanduser().absolute())
    return kept


def render_config(values: Mapping[str, Any]) -> str:
    header = (
        f"# {SERVICE_NAME} node settings, read by the service through ${CONFIG_FILE_ENV}.\n"
        "# Keys are NodeSettings fields; MESHNET_* environment variables override them. Every key, with\n"
        "# its meaning and default: docs/meshnet-gguf.example.toml in the meshnet-gguf repository.\n"
    )
    return header + tomli_w.dumps(dict(values))


# --- unit file ------------------------------------------------------------------------


def _quote(value: str) -> str:
    """One unit-file word: `%` and `$` escaped, quoted when it holds spaces or quotes."""
    escaped = value.replace("%", "%%").replace("$", "$$")
    if any(c.isspace() for c in escaped) or '"' in escaped or "\\" in escaped:
        return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return escaped


def _writable_dirs(paths: Iterable[Path]) -> list[Path]:
    """Distinct directories, without those already inside another one listed."""
    unique = sorted({p.absolute() for p in paths}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in unique:
        if not any(path == k or k in path.parents for k in kept):
            kept.append(path)
    return kept


# A system install runs as its own user, in the groups that may open the GPU's device nodes;
# the node's unit and the worker's share these lines.
SERVICE_ACCOUNT = (
    f"User={SERVICE_USER}",
    f"Group={SERVICE_USER}",
    f"SupplementaryGroups={' '.join(DEVICE_GROUPS)}",
)
# The kernel's tunables, modules, log and cgroup tree are out of a service's reach; the node's
# unit and the worker's share these lines.
KERNEL_PROTECTION = (
    "ProtectKernelTunables=yes",
    "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes",
    "ProtectControlGroups=yes",
)


def render_unit(
    *,
    command: Sequence[str],
    config_path: Path,
    writable_dirs: Sequence[Path],
    settings: NodeSettings,
    user_mode: bool,
    protect_home: str,
    state_directory: str | None,
) -> str:
    stop_timeout = int(settings.drain_grace_s + settings.stop_timeout_s + STOP_MARGIN_S)
    exec_start = " ".join(_quote(part) for part in [*command, "serve"])
    unit = [
        "[Unit]",
        "Description=Meshnet GGUF node (llama-server behind a metering OpenAI proxy)",
        # The tracker and the hub are remote; a user manager has no such target.
        *([] if user_mode else ["Wants=network-online.target", "After=network-online.target"]),
        f"StartLimitIntervalSec={START_LIMIT_INTERVAL_S}",
        f"StartLimitBurst={START_LIMIT_BURST}",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        f"ExecStart={exec_start}",
        f"Environment={_quote(f'{CONFIG_FILE_ENV}={config_path}')}",
        "Environment=PYTHONUNBUFFERED=1",
        f"TimeoutStartSec={START_TIMEOUT_S}",
        f"TimeoutStopSec={stop_timeout}",
        f"WatchdogSec={WATCHDOG_S}",
        "Restart=on-failure",
        f"RestartSec={RESTART_DELAY_S}",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        f"LimitNOFILE={OPEN_FILES_LIMIT}",
        "NoNewPrivileges=yes",
    ]
    if not user_mode:
        unit += [
            *SERVICE_ACCOUNT,
        ]
        if state_directory:
            unit.append(f"StateDirectory={state_directory}")
        unit += [
            "ProtectSystem=strict",
            f"ReadWritePaths={' '.join(_quote(str(d)) for d in writable_dirs)}",
            f"ProtectHome={protect_home}",
            "PrivateTmp=yes",
            # Files the node writes (identity key, ledger, downloads) are its user's alone.
            "UMask=0077",
            # No capability at all: the node binds an unprivileged port and runs as its own user.
            "CapabilityBoundingSet=",
            "AmbientCapabilities=",
            # The node, Python, llama-server and the GPU drivers use the ordinary service calls only
            # (@resources among them: ggml pins threads and sets their priority); a denied call
            # fails with EPERM rather than killing the process, so a driver's probe degrades.
            "SystemCallFilter=@system-service",
            "SystemCallFilter=~@privileged",
            "SystemCallErrorNumber=EPERM",
            # HTTP on IPv4/6, llama-server's UNIX socket and systemd's notify socket, and
            # netlink for getaddrinfo's view of the host's addresses.
            "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
            # Other users' processes are invisible; /proc's system files (meminfo, cpuinfo) stay
            # readable (no ProcSubset=pid): the hardware probe plans from them.
            "ProtectProc=invisible",
            # No PrivateDevices (it would hide the GPU): a device allow-list instead. /dev/dri
            # (DRM, Vulkan), /dev/kfd (ROCm), and NVIDIA's nodes for its Vulkan driver.
            "DevicePolicy=closed",
            *(f"DeviceAllow={device} rw" for device in GPU_DEVICES),
            "RemoveIPC=yes",
            "PrivateMounts=yes",
            *KERNEL_PROTECTION,
            "ProtectClock=yes",
            "ProtectHostname=yes",
            "RestrictSUIDSGID=yes",
            "RestrictRealtime=yes",
            "RestrictNamespaces=yes",
            "LockPersonality=yes",
            "SystemCallArchitectures=native",
            # No MemoryDenyWriteExecute: GPU drivers compile shaders into executable memory.
        ]
    unit += install_section(user_mode)
    return "\n".join(unit)


def install_section(user_mode: bool) -> list[str]:
    """The unit's closing [Install] section: started with the user's session or at boot."""
    return ["", "[Install]", f"WantedBy={'default.target' if user_mode else 'multi-user.target'}", ""]


def render_sysusers() -> str:
    return (
        f"# The dedicated user of the {SERVICE_NAME} system service (systemd-sysusers).\n"
        f'u {SERVICE_USER} - "Meshnet GGUF node" {SYSTEM_STATE_DIR} /usr/sbin/nologin\n'
    )


# --- plans ---------------------------------------------------------------------------


def plan_install(
    settings: NodeSettings,
    *,
    user_mode: bool,
    root: Path = Path("/"),
    environ: Mapping[str, str] | None = None,
    start: bool = True,
    command: Sequence[str] | None = None,
    interpreter: Sequence[Path] | None = None,
) -> ServicePlan:
    """Everything `service install` writes and runs, for these settings.

    `command` (what ExecStart runs) and `interpreter` (the paths it needs to
    read) default to this installation."""
    layout = ServiceLayout.user(environ) if user_mode else ServiceLayout.system()
    command = list(command or service_command())
    values = config_values(settings, layout)
    download_dir, state_dir = Path(values["download_dir"]), Path(values["state_dir"])
    writable = _writable_dirs([download_dir, state_dir])
    readable = [Path(command[0]), Path(command[0]).resolve(), *(interpreter_paths() if interpreter is None else interpreter)]
    if isinstance(values.get("gguf"), str) and Path(values["gguf"]).is_absolute():
        readable.append(Path(values["gguf"]))
    if "llama_server" in values:
        readable.append(Path(values["llama_server"]))

    warnings: list[str] = []
    if not settings.gguf and not settings.demo:
        warnings.append("no model: the service would fail at every start; pass --gguf MODEL (or --demo)")
    # Read-only, not hidden, when the interpreter, model or data live in a home
    # folder: the node must reach them; ReadWritePaths reopens the writable ones.
    protect_home = "read-only" if _is_under_any_home([*writable, *readable]) else "yes"
    if not user_mode:
        warnings += _unreachable_for_service_user(readable + writable)
        warnings += _hidden_by_private_tmp(readable + writable)

    uses_default_state = state_dir == SYSTEM_STATE_DIR or SYSTEM_STATE_DIR in state_dir.parents
    unit = render_unit(
        command=command,
        config_path=layout.config_path,
        writable_dirs=writable,
        settings=settings,
        user_mode=user_mode,
        protect_home=protect_home,
        state_directory=SYSTEM_STATE_DIR.name if (not user_mode and uses_default_state) else None,
    )
    files = [
        PlannedFile(layout.unit_path, unit, 0o644),
        PlannedFile(
            layout.config_path,
            render_config(values),
            0o600 if user_mode else 0o640,
            group=None if user_mode else SERVICE_USER,
            secret=True,
        ),
    ]
    prepare: list[list[str]] = []
    if layout.sysusers_path is not None:
        files.insert(0, PlannedFile(layout.sysusers_path, render_sysusers(), 0o644))
        prepare.append(["systemd-sysusers", str(layout.sysusers_path)])
    commands = [layout.systemctl("daemon-reload"), layout.systemctl("enable", *(["--now"] if start else []), UNIT_NAME)]
    if user_mode:
        warnings.append(
            "a user service starts at boot only with lingering on: run `loginctl enable-linger` once; "
            "your user also needs the render and video groups for the GPU"
        )
    return ServicePlan(
        layout=layout,
        files=files,
        directories=writable,
        directory_owner=None if user_mode else SERVICE_USER,
        prepare_commands=prepare,
        commands=commands,
        warnings=warnings,
        root=root,
    )


def plan_uninstall(*, user_mode: bool, root: Path = Path("/"), environ: Mapping[str, str] | None = None) -> ServicePlan:
    """Stop and disable the service and remove its unit and config. Models and state are kept."""
    layout = ServiceLayout.user(environ) if user_mode else ServiceLayout.system()
    removals = [layout.unit_path, layout.config_path]
    if layout.sysusers_path is not None:
        removals.append(layout.sysusers_path)
    return ServicePlan(
        layout=layout,
        # Stop first: the node drains while its unit file still exists.
        prepare_commands=[layout.systemctl("disable", "--now", UNIT_NAME)],
        commands=[layout.systemctl("daemon-reload")],
        removals=removals,
        root=root,
        warnings=[
            "downloaded models and the node's state (identity, ledger) are kept; delete them by hand if unwanted"
            + ("" if user_mode else f"; the `{SERVICE_USER}` user is kept too")
        ],
    )


def _is_under_any_home(paths: Iterable[Path]) -> bool:
    return any(_is_under(p.absolute(), HOME_ROOTS) for p in paths)


def _unreachable_for_service_user(paths: Iterable[Path]) -> list[str]:
    """Folders that deny "others" entry on the way to a path the dedicated user needs."""
    blocked: dict[Path, list[Path]] = {}
    for path in paths:
        for parent in [*reversed(path.absolute().parents)][1:]:
            try:
                mode = parent.stat().st_mode
            except OSError:
                break  # not created yet: install creates it
            if not mode & 0o001:
                blocked.setdefault(parent, []).append(path)
                break
    return [
        f"the `{SERVICE_USER}` user cannot enter {parent}, which holds {', '.join(sorted({str(p) for p in needed}))}: "
        f"install {SERVICE_NAME} and its models somewhere world-readable (a venv under /opt), or use --user"
        for parent, needed in sorted(blocked.items())
    ]


def _hidden_by_private_tmp(paths: Iterable[Path]) -> list[str]:
    return [
        f"{path} is under a temporary folder, which the service sees empty (PrivateTmp=yes): move it elsewhere"
        for path in sorted({p.absolute() for p in paths})
        if _is_under(path, TEMP_ROOTS)
    ]


# --- carrying a plan out ---------------------------------------------------------------


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S, check=False)


def apply_plan(plan: ServicePlan, runner: Runner = run_command) -> None:
    """Write files, run the prepare commands (user creation), make directories, fix
    ownership, remove what goes, then run the systemctl commands."""
    for planned in plan.files:
        # Written aside and renamed, with its mode set before any content is visible.
        write_atomically(plan.on_disk(planned.path), planned.content, mode=planned.mode)
    for command in plan.prepare_commands:
        _run_checked(runner, command)
    for directory in plan.directories:
        target = plan.on_disk(directory)
        target.mkdir(parents=True, exist_ok=True)
        if plan.directory_owner:
            shutil.chown(target, user=plan.directory_owner, group=plan.directory_owner)
    for planned in plan.files:
        if planned.group:
            shutil.chown(plan.on_disk(planned.path), group=planned.group)
    for path in plan.removals:
        plan.on_disk(path).unlink(missing_ok=True)
    for command in plan.commands:
        _run_checked(runner, command)


def _run_checked(runner: Runner, command: Sequence[str]) -> None:
    try:
        done = runner(command)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServiceError(f"`{' '.join(command)}` could not run: {exc}") from exc
    if done.returncode != 0:
        output = (done.stderr or done.stdout or "").strip()
        raise ServiceError(f"`{' '.join(command)}` failed ({done.returncode}): {output}")


# --- status --------------------------------------------------------------------------------

STATUS_PROPERTIES = (
    "LoadState",
    "UnitFileState",
    "ActiveState",
    "SubState",
    "StatusText",
    "MainPID",
    "NRestarts",
    "ExecMainStartTimestamp",
    "Result",
)


def parse_show(output: str) -> dict[str, str]:
    """`systemctl show -p A -p B` output (`A=...` lines) as a dict."""
    values: dict[str, str] = {}
    for line in output.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key] = value
    return values


def service_status(layout: ServiceLayout, runner: Runner = run_command) -> dict[str, str]:
    argv = layout.systemctl("show", UNIT_NAME, *[f"--property={p}" for p in STATUS_PROPERTIES])
    try:
        done = runner(argv)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServiceError(f"cannot ask systemd about {UNIT_NAME}: {exc}") from exc
    if done.returncode != 0:
        raise ServiceError(f"`{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()}")
    return parse_show(done.stdout)


def describe_status(properties: Mapping[str, str]) -> str:
    if properties.get("LoadState") == "not-found":
        return f"{UNIT_NAME} is not installed (meshnet-gguf service install)"
    active = properties.get("ActiveState", "unknown")
    sub = properties.get("SubState", "")
    lines = [f"{UNIT_NAME}: {active}{f' ({sub})' if sub else ''}, {properties.get('UnitFileState', 'unknown')} at boot"]
    if properties.get("StatusText"):
        lines.append(f"  status:   {properties['StatusText']}")
    if properties.get("MainPID", "0") != "0":
        lines.append(f"  pid:      {properties['MainPID']}")
    if properties.get("ExecMainStartTimestamp"):
        lines.append(f"  since:    {properties['ExecMainStartTimestamp']}")
    if properties.get("NRestarts", "0") != "0":
        lines.append(f"  restarts: {properties['NRestarts']}")
    if properties.get("Result") not in (None, "", "success"):
        lines.append(f"  last result: {properties['Result']}")
    return "\n".join(lines)
