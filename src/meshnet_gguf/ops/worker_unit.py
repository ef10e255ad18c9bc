"""The systemd unit of a pool worker (`meshnet-gguf worker` on the helper box): `service install --worker`.

A plain service (no readiness protocol: the worker's status endpoint says when it serves),
restarted on failure, with the node unit's hardening; its tensor cache is its one writable folder.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from meshnet_gguf.llama.rpc_worker import default_cache_dir
from meshnet_gguf.ops.unit import (
    KERNEL_PROTECTION,
    RESTART_DELAY_S,
    SERVICE_ACCOUNT,
    SERVICE_NAME,
    SERVICE_USER,
    SYSTEM_STATE_DIR,
    PlannedFile,
    ServiceLayout,
    ServicePlan,
    install_section,
    render_sysusers,
    service_command,
)

WORKER_UNIT_NAME = f"{SERVICE_NAME}-worker.service"
# The system install's tensor cache, when the worker's arguments name none.
SYSTEM_CACHE_DIR = SYSTEM_STATE_DIR / "rpc-cache"
STOP_TIMEOUT_S = 20


def worker_layout(user_mode: bool, environ: Mapping[str, str] | None = None) -> ServiceLayout:
    base = ServiceLayout.user(environ) if user_mode else ServiceLayout.system()
    return replace(base, unit_path=base.unit_path.with_name(WORKER_UNIT_NAME))


def render_worker_unit(*, command: Sequence[str], worker_args: Sequence[str], cache_dir: Path, user_mode: bool) -> str:
    exec_start = shlex.join([*command, "worker", *worker_args])
    unit = [
        "[Unit]",
        "Description=Meshnet GGUF pool worker (llama.cpp ggml-rpc-server lent to one node)",
        *([] if user_mode else ["Wants=network-online.target", "After=network-online.target"]),
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={exec_start}",
        "Environment=PYTHONUNBUFFERED=1",
        f"TimeoutStopSec={STOP_TIMEOUT_S}",
        "Restart=on-failure",
        f"RestartSec={RESTART_DELAY_S}",
        "KillMode=mixed",
        "NoNewPrivileges=yes",
    ]
    if not user_mode:
        unit += [
            *SERVICE_ACCOUNT,
            "ProtectSystem=strict",
            f"ReadWritePaths={shlex.quote(str(cache_dir))}",
            "ProtectHome=read-only",
            "PrivateTmp=yes",
            # No PrivateDevices: the worker lends /dev/dri and /dev/kfd devices.
            *KERNEL_PROTECTION,
            "RestrictSUIDSGID=yes",
            "RestrictNamespaces=yes",
            "LockPersonality=yes",
        ]
    unit += install_section(user_mode)
    return "\n".join(unit)


def plan_worker_install(
    worker_args: Sequence[str],
    *,
    user_mode: bool,
    start: bool = True,
    root: Path = Path("/"),
    environ: Mapping[str, str] | None = None,
    command: Sequence[str] | None = None,
) -> ServicePlan:
    """The unit for `meshnet-gguf worker ARGS`; a system install keeps its cache under the state dir."""
    layout = worker_layout(user_mode, environ)
    args = list(worker_args)
    if "--cache-dir" in args:
        cache_dir = Path(args[args.index("--cache-dir") + 1])
    elif user_mode:
        cache_dir = default_cache_dir()
    else:
        cache_dir = SYSTEM_CACHE_DIR
        if "--no-cache" not in args:
            args += ["--cache-dir", str(cache_dir)]
    unit = render_worker_unit(command=list(command or service_command()), worker_args=args, cache_dir=cache_dir, user_mode=user_mode)
    files = [PlannedFile(layout.unit_path, unit, 0o644)]
    prepare: list[list[str]] = []
    if layout.sysusers_path is not None:
        files.insert(0, PlannedFile(layout.sysusers_path, render_sysusers(), 0o644))
        prepare.append(["systemd-sysusers", str(layout.sysusers_path)])
    commands = [layout.systemctl("daemon-reload"), layout.systemctl("enable", *(["--now"] if start else []), WORKER_UNIT_NAME)]
    return ServicePlan(
        layout=layout, files=files, directories=[cache_dir], directory_owner=None if user_mode else SERVICE_USER,
        prepare_commands=prepare, commands=commands, root=root,
    )  # fmt: skip
