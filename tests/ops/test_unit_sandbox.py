"""The service's sandbox: systemd's own exposure score for the unit, the GPU still reachable,
and the node started under exactly that sandbox (by this machine's systemd, or one booted in a container)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.ops.unit import GPU_DEVICES, UNIT_NAME, plan_install

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
SYSTEMD_RUN = shutil.which("systemd-run")
# systemd-analyze security: below 1 SAFE, below 5 OK; a node sandboxed as tightly as a GPU allows scores this.
MAX_EXPOSURE = 2.5
# Directives that shape the service's life rather than its sandbox; the sandbox test sets its own.
_NOT_SANDBOX = {
    "Type", "NotifyAccess", "ExecStart", "Environment", "TimeoutStartSec", "TimeoutStopSec", "WatchdogSec", "Restart",
    "RestartSec", "KillMode", "KillSignal", "User", "Group", "SupplementaryGroups", "StateDirectory", "ReadWritePaths",
    # The test's model and state live under the test's temporary folder, which PrivateTmp would hide.
    "PrivateTmp",
}  # fmt: skip
START_TIMEOUT_S = 120


def _service_lines(settings: NodeSettings) -> list[tuple[str, str]]:
    unit = plan_install(settings, user_mode=False).files[1].content
    section = unit.split("[Service]", 1)[1].split("[Install]", 1)[0]
    return [(k, v) for k, _, v in (line.partition("=") for line in section.splitlines() if "=" in line)]


def _unit_file(tmp_path: Path, settings: NodeSettings) -> Path:
    path = tmp_path / UNIT_NAME
    path.write_text(plan_install(settings, user_mode=False).files[1].content)
    return path


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed (Debian package `systemd`; CI installs it)")
def test_systemd_scores_the_unit_at_most_2_5(tmp_path: Path) -> None:
    assert SYSTEMD_ANALYZE is not None
    unit = _unit_file(tmp_path, NodeSettings(gguf="owner/name:Q4_K_M"))  # type: ignore[call-arg]
    done = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert found is not None, done.stdout + done.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE, done.stdout


def test_the_sandbox_admits_the_gpu_and_nothing_else_privileged() -> None:
    lines = _service_lines(NodeSettings(gguf="owner/name:Q4_K_M"))  # type: ignore[call-arg]
    entries: dict[str, list[str]] = {}
    for key, value in lines:
        entries.setdefault(key, []).append(value)
    assert entries["CapabilityBoundingSet"] == [""] and entries["AmbientCapabilities"] == [""]
    assert entries["SystemCallFilter"][0] == "@system-service"
    assert set(entries["RestrictAddressFamilies"][0].split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert entries["ProtectProc"] == ["invisible"] and entries["UMask"] == ["0077"]
    assert entries["DevicePolicy"] == ["closed"]
    allowed = [value.split()[0] for value in entries["DeviceAllow"]]
    assert "char-drm" in allowed and "/dev/kfd" in allowed  # Vulkan/ROCm render nodes and ROCm's compute node
    assert allowed == list(GPU_DEVICES)
    # What would hide the GPU or break the drivers stays off.
    for hides_the_gpu in ("PrivateDevices", "MemoryDenyWriteExecute", "PrivateUsers", "ProcSubset"):
        assert hides_the_gpu not in entries, hides_the_gpu


def _systemd_runs_here() -> bool:
    return SYSTEMD_RUN is not None and Path("/run/systemd/system").is_dir()


def _sandboxed_node_argv(settings: NodeSettings, port: int, unit: str, workdir: Path, *, private_tmp: bool) -> list[str]:
    """`systemd-run` starting `serve` under the unit's sandbox, its model and state in `workdir`."""
    skipped = _NOT_SANDBOX if not private_tmp else _NOT_SANDBOX - {"PrivateTmp"}
    properties = [f"{k}={v}" for k, v in _service_lines(settings) if k not in skipped]
    return [
        "systemd-run", f"--unit={unit}", "--collect", "--quiet", "-p", "Type=notify", "-p", "NotifyAccess=main",
        "-p", f"ReadWritePaths={workdir}", *(x for p in properties for x in ("-p", p)),
        f"--setenv=PYTHONPATH={os.pathsep.join(sys.path)}",
        "--", sys.executable, "-m", "meshnet_gguf", "serve", "--gguf", str(workdir / "tiny.gguf"),
        "--llama-server", str(workdir / "llama-server"), "--port", str(port), "--state-dir", str(workdir / "state"),
    ]  # fmt: skip


def _wait_ready(port: int) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + 30
    while True:
        try:
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            if health.status_code == 200 or time.monotonic() > deadline:
                return health.json()
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


@pytest.mark.slow
def test_the_node_starts_under_the_units_sandbox(tmp_path: Path, tiny_gguf: Path, fake_llama_path: Path) -> None:
    """Under this machine's systemd where it is the init system; else under a systemd booted in a
    container (`support.systemd_container`), with every sandbox directive the unit has, PrivateTmp too."""
    from support.systemd_container import WORKDIR_INSIDE, ContainerUnavailable, SystemdContainer, unavailable_reason

    port = free_local_port()
    unit = f"meshnet-sandbox-test-{port}"
    shutil.copy(tiny_gguf, tmp_path / "tiny.gguf")
    shutil.copy(fake_llama_path, tmp_path / "llama-server")  # a script naming this interpreter and the fake
    if _systemd_runs_here():
        settings = NodeSettings(gguf=str(tmp_path / "tiny.gguf"))  # type: ignore[call-arg]
        argv = _sandboxed_node_argv(settings, port, unit, tmp_path, private_tmp=False)
        started = subprocess.run(argv, capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False)
        try:
            assert started.returncode == 0, started.stderr  # Type=notify: returns once the node said READY=1
            assert _wait_ready(port)["state"] == "ready"
            assert oct((tmp_path / "state").stat().st_mode & 0o777) == "0o700"  # UMask=0077
        finally:
            subprocess.run(["systemctl", "stop", unit], capture_output=True, timeout=60, check=False)
        return
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"systemd is not the init system here, and {reason}")
    # The interpreter, its packages and this checkout, read-only at their own paths.
    here = Path(__file__).resolve().parents[2]
    if any(Path(p).is_relative_to("/tmp") for p in (here, sys.prefix, os.path.realpath(sys.executable))):
        pytest.skip("this checkout or its interpreter is under /tmp, which the unit's PrivateTmp=yes hides from the node")
    read_only = [here, Path(sys.prefix), Path(sys.base_prefix), Path(os.path.realpath(sys.executable)).parents[1]]
    try:
        container = SystemdContainer(unit, tmp_path, read_only)
    except ContainerUnavailable as exc:
        pytest.skip(f"systemd is not the init system here and cannot boot in a container either: {exc}")
    with container:
        settings = NodeSettings(gguf=str(WORKDIR_INSIDE / "tiny.gguf"))  # type: ignore[call-arg]
        argv = _sandboxed_node_argv(settings, port, unit, WORKDIR_INSIDE, private_tmp=True)
        started = container.run(argv, check=False, timeout=START_TIMEOUT_S)
        assert started.returncode == 0, started.stdout + started.stderr  # Type=notify: returns once READY=1
        shown = container.run(["systemctl", "show", unit, "-p", "ProtectSystem", "-p", "PrivateTmp", "-p", "DevicePolicy"])
        assert "ProtectSystem=strict" in shown.stdout and "PrivateTmp=yes" in shown.stdout, shown.stdout
        assert _wait_ready(port)["state"] == "ready"
        assert oct((tmp_path / "state").stat().st_mode & 0o777) == "0o700"  # UMask=0077
        container.run(["systemctl", "stop", unit], check=False, timeout=60)
