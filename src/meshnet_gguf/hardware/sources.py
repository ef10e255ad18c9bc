"""Read what each hardware source says, one small reader or parser per source.

Files are read below an injectable `root` and commands run through an
injectable `CommandRunner`, so tests replay trees and outputs recorded on other
machines (`RecordedCommands`). Nothing here raises for a missing or broken
source: readers return None or nothing, and `SourceLog` records what answered.
`report` merges the answers into one report.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Protocol, Sequence

from meshnet_gguf.common.units import GB, GiB, MiB

TTM_PAGE_BYTES = 4096

NVIDIA_SMI_QUERY = "index,name,memory.total,memory.free,pci.bus_id,driver_version"

# PCI vendors that run llama.cpp compute; anything else under /sys/class/drm
# (ASPEED/Matrox BMC graphics, virtio, bochs) only drives a console.
_COMPUTE_VENDORS = {"0x1002": "amd", "0x10de": "nvidia", "0x8086": "intel"}
_LLAMA_BACKENDS = {"vulkan": "vulkan", "cuda": "cuda", "rocm": "rocm", "hip": "rocm", "mtl": "metal", "metal": "metal"}
_LIST_DEVICE_RE = re.compile(r"^\s*(?P<name>[A-Za-z_]+\d*):\s+(?P<desc>.*)\s+\((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$")
_SOFTWARE_RENDERERS = ("llvmpipe", "lavapipe", "swiftshader", "softpipe")
_ICD_VENDOR_HINTS = {"radeon": "amd", "amd": "amd", "nvidia": "nvidia", "intel": "intel", "lvp": "software"}
_ICD_DIRS = ("usr/share/vulkan/icd.d", "etc/vulkan/icd.d", "usr/local/share/vulkan/icd.d")


@dataclass(frozen=True)
class LlamaDevice:
    """One line of `llama-server --list-devices`, e.g. `Vulkan0: llvmpipe (...) (2048 MiB, 2048 MiB free)`."""

    name: str
    description: str
    total_bytes: int
    free_bytes: int

    @property
    def backend(self) -> str:
        prefix = re.sub(r"\d+$", "", self.name).lower()
        return _LLAMA_BACKENDS.get(prefix, prefix)

    @property
    def vendor(self) -> str:
        return vendor_from_name(self.description)


@dataclass(frozen=True)
class CpuInfo:
    model: str
    logical_cores: int
    physical_cores: int | None


@dataclass(frozen=True)
class CommandOutput:
    returncode: int
    stdout: str


class CommandRunner(Protocol):
    """Runs argv and returns its output. Raises FileNotFoundError when the command does not exist
    and subprocess.TimeoutExpired when it overruns `timeout_s`."""

    def __call__(self, argv: Sequence[str], *, env: Mapping[str, str] | None, timeout_s: float) -> CommandOutput: ...


def run_command(argv: Sequence[str], *, env: Mapping[str, str] | None, timeout_s: float) -> CommandOutput:
    done = subprocess.run(
        list(argv),
        env=dict(env) if env is not None else None,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout_s,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    return CommandOutput(done.returncode, done.stdout + done.stderr)


class RecordedCommands:
    """Replays outputs recorded on another machine: `<dir>/<command name>.txt` holds what it printed.

    A command without a file behaves as not installed. `timeouts` names
    commands that behave as hung, to exercise the time limit.
    """

    def __init__(self, directory: Path, *, replace: Mapping[str, Path] | None = None, timeouts: Sequence[str] = ()):
        self.directory = Path(directory)
        self.replace = dict(replace or {})
        self.timeouts = set(timeouts)
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, argv: Sequence[str], *, env: Mapping[str, str] | None, timeout_s: float) -> CommandOutput:
        name = Path(argv[0]).name
        self.calls.append((list(argv), dict(env or {})))
        if name in self.timeouts:
            raise subprocess.TimeoutExpired(list(argv), timeout_s)
        recorded = self.replace.get(name, self.directory / f"{name}.txt")
        if not recorded.is_file():
            raise FileNotFoundError(argv[0])
        return CommandOutput(0, recorded.read_text())


class SourceLog:
    """What each source answered (for the report), and notes for the operator."""

    def __init__(self) -> None:
        self.status: dict[str, str] = {}
        self.notes: list[str] = []


def _read(root: Path, relative: str) -> str | None:
    try:
        return (root / relative).read_text(errors="replace")
    except OSError:
        return None


def _read_int(root: Path, relative: str) -> int | None:
    text = _read(root, relative)
    if text is None:
        return None
    try:
        return int(text.strip(), 0)
    except ValueError:
        return None


def run_probe(
    log: SourceLog, label: str, run: CommandRunner, argv: Sequence[str], env: Mapping[str, str] | None, timeout_s: float
) -> str | None:
    try:
        out = run(argv, env=env, timeout_s=timeout_s)
    except FileNotFoundError:
        log.status[label] = "not installed"
        return None
    except subprocess.TimeoutExpired:
        log.status[label] = f"timed out after {timeout_s:.0f} s"
        return None
    except OSError as exc:
        log.status[label] = f"could not run: {exc}"
        return None
    if out.returncode != 0:
        last = out.stdout.strip().splitlines()[-1:] or ["no output"]
        log.status[label] = f"exit {out.returncode}: {last[0][:200]}"
        return None
    log.status[label] = "ok"
    return out.stdout


def read_cpu(root: Path) -> CpuInfo:
    text = _read(root, "proc/cpuinfo") or ""
    model = None
    logical = 0
    cores: set[tuple[str, str]] = set()
    physical_id = core_id = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            logical += 1
        elif key in ("model name", "Model", "Hardware") and model is None:
            model = value
        elif key == "physical id":
            physical_id = value
        elif key == "core id":
            core_id = value
            cores.add((physical_id, core_id))
    if logical == 0:
        logical = (os.cpu_count() or 1) if root == Path("/") else 1
    return CpuInfo(model=model or "unknown CPU", logical_cores=logical, physical_cores=len(cores) or None)


def read_meminfo(root: Path) -> tuple[int, int] | None:
    text = _read(root, "proc/meminfo")
    if text is None:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[key.strip()] = int(fields[0]) * 1024  # /proc/meminfo says kB and means KiB
    total = values.get("MemTotal")
    if total is None:
        return None
    available = values.get("MemAvailable", values.get("MemFree", 0) + values.get("Cached", 0))
    return total, available


def read_memory(root: Path, log: SourceLog) -> tuple[int, int]:
    found = read_meminfo(root)
    if found is not None:
        log.status["/proc/meminfo"] = "ok"
        return found
    if root == Path("/"):
        try:
            import psutil

            vm = psutil.virtual_memory()
            log.status["/proc/meminfo"] = "absent; used psutil"
            return int(vm.total), int(vm.available)
        except Exception as exc:  # psutil is a dependency, but a broken platform must not stop the node
            log.status["/proc/meminfo"] = f"absent; psutil failed: {exc}"
    else:
        log.status["/proc/meminfo"] = "absent"
    return 0, 0


@dataclass
class DrmCard:
    card: str
    vendor: str  # "amd" | "nvidia" | "intel"
    pci_id: str
    device_id: str
    vram_total: int | None
    vram_used: int | None
    gtt_total: int | None


def read_drm_cards(root: Path, log: SourceLog) -> list[DrmCard]:
    drm = root / "sys/class/drm"
    try:
        names = sorted((p.name for p in drm.iterdir() if re.fullmatch(r"card\d+", p.name)), key=lambda n: int(n[4:]))
    except OSError:
        log.status["sysfs drm"] = "absent"
        return []
    cards: list[DrmCard] = []
    for name in names:
        base = f"sys/class/drm/{name}/device"
        vendor = (_read(root, f"{base}/vendor") or "").strip().lower()
        device = (_read(root, f"{base}/device") or "").strip().lower()
        if vendor not in _COMPUTE_VENDORS:
            continue
        cards.append(
            DrmCard(
                card=name,
                vendor=_COMPUTE_VENDORS[vendor],
                pci_id=f"{vendor[2:]}:{device[2:]}",
                device_id=device,
                vram_total=_read_int(root, f"{base}/mem_info_vram_total"),
                vram_used=_read_int(root, f"{base}/mem_info_vram_used"),
                gtt_total=_read_int(root, f"{base}/mem_info_gtt_total"),
            )
        )
    log.status["sysfs drm"] = f"{len(cards)} compute GPU(s) among {len(names)} card(s)"
    return cards


def parse_list_devices(text: str) -> tuple[LlamaDevice, ...]:
    """Parse `llama-server --list-devices`; `(none)` and log noise yield nothing."""
    devices = []
    for line in text.splitlines():
        match = _LIST_DEVICE_RE.match(line)
        if match:
            devices.append(
                LlamaDevice(
                    name=match["name"],
                    description=match["desc"].strip(),
                    total_bytes=int(match["total"]) * MiB,
                    free_bytes=int(match["free"]) * MiB,
                )
            )
    return tuple(devices)


@dataclass(frozen=True)
class NvidiaGpu:
    name: str
    total: int
    free: int
    bus_id: str


def parse_nvidia_smi(text: str) -> list[NvidiaGpu]:
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 6 or not fields[0].isdigit():
            continue
        # A name with a comma in it would shift the columns; the numbers are counted from the right.
        name = ", ".join(fields[1:-4])
        try:
            total, free = int(float(fields[-4])) * MiB, int(float(fields[-3])) * MiB
        except ValueError:
            continue
        gpus.append(NvidiaGpu(name, total, free, fields[-2]))
    return gpus


@dataclass(frozen=True)
class RocmAgent:
    gfx: str
    marketing_name: str


def parse_rocminfo(text: str) -> list[RocmAgent]:
    agents = []
    for block in re.split(r"\n\*+\s*\nAgent \d+\s*\n\*+\s*\n", "\n" + text):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.strip().partition(":")
            if sep and key not in fields:
                fields[key.strip()] = value.strip()
        if fields.get("Device Type") == "GPU" and fields.get("Name", "").startswith("gfx"):
            agents.append(RocmAgent(fields["Name"], fields.get("Marketing Name", fields["Name"])))
    return agents


def vendor_from_name(name: str) -> str:
    lowered = name.lower()
    if any(s in lowered for s in _SOFTWARE_RENDERERS):
        return "software"
    if any(s in lowered for s in ("nvidia", "geforce", "quadro", "tesla", "rtx")):
        return "nvidia"
    if any(s in lowered for s in ("amd", "radeon", "radv", "gfx")):
        return "amd"
    if "intel" in lowered:
        return "intel"
    if "apple" in lowered:
        return "apple"
    return "unknown"


def read_vulkan_icds(root: Path) -> tuple[str, ...]:
    found: list[str] = []
    for directory in _ICD_DIRS:
        try:
            found.extend(sorted(p.name for p in (root / directory).glob("*.json")))
        except OSError:
            continue
    return tuple(found)


def icd_vendors(icds: Sequence[str]) -> set[str]:
    vendors = set()
    for icd in icds:
        lowered = icd.lower()
        for hint, vendor in _ICD_VENDOR_HINTS.items():
            if lowered.startswith(hint):
                vendors.add(vendor)
    return vendors


def read_ttm_pages_limit(root: Path) -> int | None:
    pages = _read_int(root, "sys/module/ttm/parameters/pages_limit")
    return pages * TTM_PAGE_BYTES if pages else None
