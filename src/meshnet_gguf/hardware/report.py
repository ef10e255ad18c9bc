"""What this machine really has for llama-server: CPU, RAM, GPUs and an honest GPU memory budget.

Every source is optional, time-limited and never fatal: sysfs DRM and TTM,
`/proc/cpuinfo`, `/proc/meminfo`, the Vulkan ICD manifests, the actual
binary's `llama-server --list-devices`, `nvidia-smi` and `rocminfo`
(`sources` reads each one). This module merges their answers
into one report per GPU and decides what each GPU may honestly hold.

Unified memory (AMD APUs such as Strix Halo, Intel iGPUs, Apple silicon) is the
case that matters most: the GPU's "VRAM" is a firmware carve-out and the rest
comes from system RAM through GTT. Vulkan reports carve-out + GTT as device
memory, which on a 128 GB box with a 64 GB carve-out and a 110 GB GTT limit
claims 174 GB; loading that much has crashed machines. The budget here is the
carve-out plus the part of GTT that RAM can really give, minus a reserve.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from meshnet_gguf.common.units import GB, GiB, MiB, format_bytes
from meshnet_gguf.hardware.sources import (
    NVIDIA_SMI_QUERY,
    TTM_PAGE_BYTES,
    CommandRunner,
    CpuInfo,
    DrmCard,
    LlamaDevice,
    NvidiaGpu,
    RecordedCommands,
    RocmAgent,
    SourceLog,
    icd_vendors,
    parse_list_devices,
    parse_nvidia_smi,
    parse_rocminfo,
    read_cpu,
    read_drm_cards,
    read_memory,
    read_ttm_pages_limit,
    read_vulkan_icds,
    run_command,
    run_probe,
)

if TYPE_CHECKING:
    from meshnet_gguf.llama.binary import BinaryInfo

__all__ = [
    "GpuInfo",
    "HardwareReport",
    "MemoryCapacity",
    "format_table",
    "probe_configured",
    "probe_hardware",
    "probe_recorded",
]


# Vulkan instance creation loads every ICD; NVIDIA's can take seconds on a cold
# start. Beyond this the driver is wedged and the node should start without it.
LIST_DEVICES_TIMEOUT_S = 20.0
# nvidia-smi takes 1-3 s without persistence mode; rocminfo hangs when /dev/kfd is unusable.
NVIDIA_SMI_TIMEOUT_S = 10.0
ROCMINFO_TIMEOUT_S = 10.0

# RAM kept back from any model: the kernel, system services, this node and
# llama-server's host-side buffers (output/embedding copies, host compute
# buffer: 1-2 GiB for a 100 GB MoE). On unified memory the GPU's GTT share
# comes out of the same RAM, so this one reserve protects both.
SYSTEM_RESERVE_BYTES = 4 * GiB
# Kept free on a discrete GPU: driver context and display. Matches llama.cpp's
# own default `--fit-target` margin (1024 MiB).
DISCRETE_GPU_RESERVE_BYTES = 1 * GiB
# Raising the GTT limit needs a reboot: suggest it only when the GPU would gain at least this much.
GTT_HINT_MIN_GAIN_BYTES = 4 * GiB
# An AMD GPU whose VRAM is this small is a UMA carve-out, not a graphics card
# anyone would run a model on (typical carve-outs: 512 MiB to 2 GiB).
SMALL_CARVEOUT_MAX_BYTES = 2 * GiB

STRIX_HALO_PCI_ID = "1002:1586"
STRIX_HALO_GFX = "gfx1151"
# AMD APU iGPUs by PCI device id (Raven .. Strix Halo).
_AMD_APU_DEVICE_IDS = frozenset(
    {"0x15dd", "0x15d8", "0x1636", "0x1638", "0x164c", "0x15e7", "0x1681", "0x164e", "0x15bf", "0x15c8", "0x150e", "0x1586"}
)
_AMD_APU_GFX = frozenset({"gfx902", "gfx909", "gfx90c", "gfx1035", "gfx1036", "gfx1103", "gfx1150", "gfx1151", "gfx1152"})
# Intel discrete (Arc Alchemist 0x56xx, Battlemage 0xe2xx); every other Intel GPU is integrated.
_INTEL_DISCRETE_PREFIXES = ("0x56", "0xe2")


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class GpuInfo:
    vendor: str  # amd | nvidia | intel | apple | software | unknown
    name: str
    kind: str  # integrated | discrete | software
    unified: bool  # memory shared with the CPU's RAM
    backends: tuple[str, ...]  # what could drive it here: vulkan, rocm, cuda, metal
    memory_total_bytes: int | None  # as the driver reports it (over-counts on unified memory)
    memory_free_bytes: int | None
    budget_bytes: int  # what a model (weights + KV + compute) may honestly use on it
    # The part of the budget not taken from system RAM: all of it on a discrete
    # GPU, the free carve-out on unified memory (the rest of the budget is RAM).
    dedicated_bytes: int
    budget_basis: str  # how budget_bytes was reached, for operators
    llama_devices: tuple[LlamaDevice, ...] = ()
    pci_id: str | None = None  # "1002:1586"
    gfx_target: str | None = None
    vram_bytes: int | None = None  # sysfs mem_info_vram_total (a carve-out on APUs)
    gtt_bytes: int | None = None  # sysfs mem_info_gtt_total
    labels: tuple[str, ...] = ()  # e.g. "Strix Halo"

    @property
    def usable_by_binary(self) -> bool:
        return bool(self.llama_devices)


@dataclass(frozen=True)
class MemoryCapacity:
    """The most memory a model can occupy here, and how much of it the GPU can hold."""

    total_bytes: int
    gpu_bytes: int
    gpu_name: str | None
    unified: bool

    def describe(self) -> str:
        if self.gpu_bytes <= 0:
            return f"this box can hold {format_bytes(self.total_bytes)} in RAM (CPU only)"
        if self.unified and self.gpu_bytes >= self.total_bytes:
            return f"this box can give the GPU {format_bytes(self.gpu_bytes)}"
        return f"this box can hold {format_bytes(self.total_bytes)} ({format_bytes(self.gpu_bytes)} of it on the GPU)"


@dataclass(frozen=True)
class HardwareReport:
    cpu: CpuInfo
    ram_total_bytes: int
    ram_available_bytes: int
    gpus: tuple[GpuInfo, ...]
    # None: the binary was not probed (none given, or the probe failed); () : it sees no device.
    llama_devices: tuple[LlamaDevice, ...] | None
    # Environment the device list was taken under; device indexes mean something only with it.
    llama_devices_env: Mapping[str, str] = field(default_factory=dict)
    ttm_pages_limit_bytes: int | None = None
    vulkan_icds: tuple[str, ...] = ()
    probes: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    platform: str = "linux"

    @property
    def host_budget_bytes(self) -> int:
        """RAM a model may take on the CPU side (on unified memory the GPU's GTT share comes out of this too)."""
        return max(0, self.ram_available_bytes - SYSTEM_RESERVE_BYTES)

    def usable_gpus(self, *, include_software: bool = False) -> list[GpuInfo]:
        """GPUs a model could go to, best first: discrete before integrated, then the larger budget.

        Discrete first because an ordinary iGPU beside a graphics card (a
        desktop Ryzen's) shares the CPU's memory bandwidth and only slows the
        card down. When the binary was not probed, any real GPU counts (a
        matching binary can be installed); a software renderer counts only
        when asked for.
        """
        candidates = [g for g in self.gpus if include_software or g.kind != "software"]
        if self.llama_devices is not None:
            candidates = [g for g in candidates if g.usable_by_binary]
        return sorted(candidates, key=lambda g: (g.kind == "discrete", g.budget_bytes), reverse=True)

    def primary_gpu(self, *, include_software: bool = False) -> GpuInfo | None:
        usable = self.usable_gpus(include_software=include_software)
        return usable[0] if usable else None

    def capacity(self) -> MemoryCapacity:
        gpu = self.primary_gpu()
        host = self.host_budget_bytes
        if gpu is None:
            return MemoryCapacity(host, 0, None, False)
        # What the GPU cannot hold stays in RAM on the CPU side; on unified memory
        # the GPU's shared part already comes out of that same RAM.
        return MemoryCapacity(gpu.dedicated_bytes + host, gpu.budget_bytes, gpu.name, gpu.unified)

    def summary(self) -> str:
        """One log line: what the node will run on."""
        cores = f"{self.cpu.physical_cores or self.cpu.logical_cores} cores"
        parts = [
            f"CPU {self.cpu.model} ({cores})",
            f"RAM {_gib(self.ram_total_bytes)} ({_gib(self.ram_available_bytes)} available)",
        ]
        real_gpus = [g for g in self.gpus if g.kind != "software"]
        if not real_gpus:
            parts.append("no GPU: CPU only")
        for gpu in real_gpus:
            labels = f" [{', '.join(gpu.labels)}]" if gpu.labels else ""
            devices = ",".join(d.name for d in gpu.llama_devices) or "not visible to llama-server"
            memory = "unified" if gpu.unified else "dedicated"
            parts.append(
                f"GPU {gpu.name}{labels} {gpu.kind} {memory}, backends {'+'.join(gpu.backends) or 'none'}, "
                f"llama-server: {devices}, budget {format_bytes(gpu.budget_bytes)}"
            )
        return "; ".join(parts)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["host_budget_bytes"] = self.host_budget_bytes
        data["capacity"] = asdict(self.capacity())
        data["capacity"]["description"] = self.capacity().describe()
        for gpu, out in zip(self.gpus, data["gpus"]):
            for dev, dev_out in zip(gpu.llama_devices, out["llama_devices"]):
                dev_out["backend"] = dev.backend
        if self.llama_devices is not None:
            for dev, dev_out in zip(self.llama_devices, data["llama_devices"]):
                dev_out["backend"] = dev.backend
        return data


# --------------------------------------------------------------------------- merging sources


@dataclass
class _Gpu:
    """A physical GPU while the sources are merged into it."""

    vendor: str
    card: DrmCard | None = None
    nvidia: NvidiaGpu | None = None
    rocm: RocmAgent | None = None
    llama: list[LlamaDevice] = field(default_factory=list)


def _attach_by_vendor(gpus: list[_Gpu], vendor: str, index: int) -> _Gpu | None:
    """The `index`-th GPU of `vendor`: sources list GPUs of one vendor in the same (PCI) order."""
    same = [g for g in gpus if g.vendor == vendor]
    return same[index] if index < len(same) else None


def _merge(cards: list[DrmCard], nvidia: list[NvidiaGpu], rocm: list[RocmAgent], llama: Sequence[LlamaDevice]) -> list[_Gpu]:
    gpus = [_Gpu(c.vendor, card=c) for c in cards]
    for i, smi in enumerate(nvidia):
        target = _attach_by_vendor(gpus, "nvidia", i)
        if target is None:  # no sysfs (containers): nvidia-smi alone still proves the GPU
            target = _Gpu("nvidia")
            gpus.append(target)
        target.nvidia = smi
    for i, agent in enumerate(rocm):
        target = _attach_by_vendor(gpus, "amd", i)
        if target is None:
            target = _Gpu("amd")
            gpus.append(target)
        target.rocm = agent
    # Each backend numbers its devices on its own (Vulkan0, ROCm0 can be one GPU).
    per_backend_vendor: dict[tuple[str, str], int] = {}
    for dev in llama:
        vendor = dev.vendor
        key = (dev.backend, vendor)
        index = per_backend_vendor.get(key, 0)
        per_backend_vendor[key] = index + 1
        target = None if vendor in ("software", "unknown") else _attach_by_vendor(gpus, vendor, index)
        if target is None:
            target = _Gpu(vendor)
            gpus.append(target)
        target.llama.append(dev)
    return gpus


def _is_strix_halo(gpu: _Gpu, cpu: CpuInfo) -> bool:
    if gpu.card and gpu.card.pci_id == STRIX_HALO_PCI_ID:
        return True
    if gpu.rocm and gpu.rocm.gfx == STRIX_HALO_GFX:
        return True
    names = " ".join(d.description for d in gpu.llama).lower()
    if any(s in names for s in ("8060s", "8050s", "gfx1151")):
        return True
    # Without sysfs (a container) the CPU's name still gives the APU away.
    return gpu.vendor == "amd" and gpu.card is None and "ryzen ai max" in cpu.model.lower()


def _integrated(gpu: _Gpu, reported_total: int | None) -> bool:
    card = gpu.card
    if gpu.vendor == "apple":
        return True
    if gpu.vendor == "intel":
        return not (card and card.device_id.startswith(_INTEL_DISCRETE_PREFIXES))
    if gpu.vendor != "amd":
        return False
    if card and card.device_id in _AMD_APU_DEVICE_IDS:
        return True
    if gpu.rocm and gpu.rocm.gfx in _AMD_APU_GFX:
        return True
    if card and card.vram_total is not None:
        if card.vram_total <= SMALL_CARVEOUT_MAX_BYTES:
            return True
        # RADV folds GTT into the device heap only on APUs: a reported size far
        # beyond the VRAM means the GPU maps system memory as its own.
        if reported_total is not None and card.gtt_total and reported_total > card.vram_total + card.gtt_total // 2:
            return True
    return False


def _gpu_name(gpu: _Gpu, cpu: CpuInfo, strix_halo: bool) -> str:
    if gpu.nvidia:
        return gpu.nvidia.name
    if gpu.llama:
        return gpu.llama[0].description
    if gpu.rocm and gpu.rocm.marketing_name and gpu.rocm.marketing_name != "AMD Radeon Graphics":
        return gpu.rocm.marketing_name
    # An APU's CPU string names its iGPU: "AMD RYZEN AI MAX+ 395 w/ Radeon 8060S".
    match = re.search(r"w/\s*(Radeon [\w ]+?)\s*$", cpu.model)
    if gpu.vendor == "amd" and match and (strix_halo or (gpu.card and gpu.card.device_id in _AMD_APU_DEVICE_IDS)):
        return f"AMD {match.group(1)}"
    if strix_halo:
        return "AMD Radeon 8060S/8050S (Strix Halo)"
    if gpu.card:
        return f"{gpu.vendor.upper()} GPU {gpu.card.pci_id}"
    return f"{gpu.vendor} GPU"


def _unified_budget(vram: int, gtt: int | None, reported_total: int | None, ttm_limit: int | None, host_budget: int) -> tuple[int, str]:
    """Carve-out + the GTT that RAM can really back, never the carve-out + GTT sum Vulkan reports."""
    limits: list[tuple[int, str]] = [(host_budget, f"RAM available minus {format_bytes(SYSTEM_RESERVE_BYTES)} reserve")]
    if gtt is not None:
        limits.append((gtt, "GTT size"))
    elif reported_total is not None:
        limits.append((max(0, reported_total - vram), "driver-reported shared memory"))
    if ttm_limit is not None:
        limits.append((ttm_limit, "ttm pages_limit"))
    shared, basis = min(limits, key=lambda item: item[0])
    budget = vram + max(0, shared)
    carve = f"carve-out {format_bytes(vram)} + " if vram else ""
    return budget, f"{carve}shared {format_bytes(max(0, shared))} capped by {basis}"


def _build_gpu(
    gpu: _Gpu,
    cpu: CpuInfo,
    ram_total: int,
    host_budget: int,
    ttm_limit: int | None,
    icd_vendors: set[str],
    platform: str,
    log: SourceLog,
) -> GpuInfo:
    card = gpu.card
    reported = max((d.total_bytes for d in gpu.llama), default=None)
    reported_free = max((d.free_bytes for d in gpu.llama), default=None)
    if gpu.nvidia:
        reported, reported_free = gpu.nvidia.total, gpu.nvidia.free
    strix_halo = _is_strix_halo(gpu, cpu)
    software = gpu.vendor == "software"
    integrated = software or strix_halo or _integrated(gpu, reported)
    kind = "software" if software else "integrated" if integrated else "discrete"

    backends = {d.backend for d in gpu.llama}
    if gpu.nvidia:
        backends.add("cuda")
    if gpu.rocm:
        backends.add("rocm")
    if gpu.vendor in icd_vendors:
        backends.add("vulkan")
    if gpu.vendor == "apple" or platform == "darwin":
        backends.add("metal")

    vram = card.vram_total if card else None
    if integrated:
        carve_out = vram or 0
        if card and card.vram_used is not None and vram is not None:
            carve_out = max(0, vram - card.vram_used)
        budget, basis = _unified_budget(carve_out, card.gtt_total if card else None, reported, ttm_limit, host_budget)
        dedicated = carve_out
        # The false sum: more "GPU memory" than the whole box has (carve-out + RAM).
        if reported is not None and reported > (vram or 0) + ram_total:
            log.notes.append(
                f"{_gpu_name(gpu, cpu, strix_halo)}: the driver reports {_gib(reported)} of GPU memory, more than "
                f"this box has (carve-out + RAM); the honest budget is {format_bytes(budget)} ({basis})."
            )
    else:
        free = reported_free if reported_free is not None else (vram - (card.vram_used or 0) if card and vram else None)
        if free is None:
            budget, basis = 0, "memory unknown (no driver tool answered)"
        else:
            budget = max(0, free - DISCRETE_GPU_RESERVE_BYTES)
            basis = f"free {format_bytes(free)} minus {format_bytes(DISCRETE_GPU_RESERVE_BYTES)} reserve"
        dedicated = budget

    labels = ["Strix Halo"] if strix_halo else []
    if integrated and not software:
        labels.append("APU" if gpu.vendor == "amd" else "iGPU")
    return GpuInfo(
        vendor=gpu.vendor,
        name=_gpu_name(gpu, cpu, strix_halo),
        kind=kind,
        unified=integrated,
        backends=tuple(sorted(backends)),
        memory_total_bytes=reported if reported is not None else vram,
        memory_free_bytes=reported_free,
        budget_bytes=budget,
        dedicated_bytes=dedicated,
        budget_basis=basis,
        llama_devices=tuple(gpu.llama),
        pci_id=card.pci_id if card else None,
        gfx_target=gpu.rocm.gfx if gpu.rocm else None,
        vram_bytes=vram,
        gtt_bytes=card.gtt_total if card else None,
        labels=tuple(labels),
    )


def _gtt_hint(gpus: list[GpuInfo], ttm_limit: int | None, ram_total: int, host_budget: int, log: SourceLog) -> None:
    """An APU left at the kernel's default GTT limit (half of RAM) can hold far less than the box has."""
    if any(g.kind == "discrete" for g in gpus):
        return  # models go to the discrete card; the iGPU's limit does not matter
    for gpu in gpus:
        if gpu.vendor != "amd" or not gpu.unified or gpu.gtt_bytes is None:
            continue
        limit = min(gpu.gtt_bytes, ttm_limit or gpu.gtt_bytes)
        if limit + GTT_HINT_MIN_GAIN_BYTES < host_budget:
            # A boot parameter outlives today's free memory, so it is sized from total RAM.
            pages = max(0, ram_total - SYSTEM_RESERVE_BYTES) // TTM_PAGE_BYTES
            log.notes.append(
                f"{gpu.name} may map only {_gib(limit)} of system memory (GTT / ttm pages_limit), less than the "
                f"{_gib(host_budget)} RAM could give it. To let the GPU hold larger models, boot with "
                f"ttm.pages_limit={pages} (4 KiB pages) and reboot."
            )


def probe_hardware(
    binary: BinaryInfo | None = None,
    *,
    device_env: Mapping[str, str] | None = None,
    root: Path = Path("/"),
    run: CommandRunner = run_command,
    platform: str = sys.platform,
) -> HardwareReport:
    """Probe this machine. Never raises for a missing or failing source; `probes` says what answered.

    `device_env` is added to the binary's environment for `--list-devices`,
    e.g. `GGML_VK_VISIBLE_DEVICES=0` to reveal a software Vulkan device that
    ggml hides by default; the report keeps it so a plan launches under the
    same view of the devices.
    """
    root = Path(root)
    log = SourceLog()
    cpu = read_cpu(root)
    ram_total, ram_available = read_memory(root, log)
    host_budget = max(0, ram_available - SYSTEM_RESERVE_BYTES)
    ttm_limit = read_ttm_pages_limit(root)
    cards = read_drm_cards(root, log)
    icds = read_vulkan_icds(root)

    llama: tuple[LlamaDevice, ...] | None = None
    list_env = dict(device_env or {})
    if binary is not None:
        base = os.environ if root == Path("/") else {}
        out = run_probe(
            log,
            "llama-server --list-devices",
            run,
            [str(binary.path), "--list-devices"],
            binary.environment({**base, **list_env}),
            LIST_DEVICES_TIMEOUT_S,
        )
        if out is not None:
            llama = parse_list_devices(out)
            log.status["llama-server --list-devices"] = f"ok: {len(llama)} device(s)"
    else:
        log.status["llama-server --list-devices"] = "skipped: no llama-server given"

    nvidia_out = run_probe(
        log,
        "nvidia-smi",
        run,
        ["nvidia-smi", f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
        None,
        NVIDIA_SMI_TIMEOUT_S,
    )
    rocm_out = run_probe(log, "rocminfo", run, ["rocminfo"], None, ROCMINFO_TIMEOUT_S)

    merged = _merge(
        cards,
        parse_nvidia_smi(nvidia_out) if nvidia_out else [],
        parse_rocminfo(rocm_out) if rocm_out else [],
        llama or (),
    )
    gpus = [_build_gpu(g, cpu, ram_total, host_budget, ttm_limit, icd_vendors(icds), platform, log) for g in merged]
    _gtt_hint(gpus, ttm_limit, ram_total, host_budget, log)
    return HardwareReport(
        cpu=cpu,
        ram_total_bytes=ram_total,
        ram_available_bytes=ram_available,
        gpus=tuple(gpus),
        llama_devices=llama,
        llama_devices_env=list_env,
        ttm_pages_limit_bytes=ttm_limit,
        vulkan_icds=icds,
        probes=dict(log.status),
        notes=tuple(log.notes),
        platform=platform,
    )


def probe_recorded(box: Path, binary: BinaryInfo | None = None) -> HardwareReport:
    """Probe a machine recorded as files instead of this one: a testing and diagnosis aid.

    `box` is laid out like `tests/fixtures/hardware/<box>`: `root/` holds the
    sysfs, proc and Vulkan ICD files the probes read, `commands/<name>.txt` what
    `llama-server --list-devices`, `nvidia-smi` and `rocminfo` printed there (a
    command without a file was not installed). The binary's own `--help` is
    still this machine's. Raises FileNotFoundError when `box` has no `root/`.
    """
    box = Path(box).expanduser()
    if not (box / "root").is_dir():
        raise FileNotFoundError(
            f"{box} is not a recorded machine: it needs a root/ folder (sysfs, proc) and commands/ (see tests/fixtures/hardware/<box>)"
        )
    commands = box / "commands"
    # Recorded as llama-server.txt whatever this machine's binary is called.
    replace = {binary.path.name: commands / "llama-server.txt"} if binary is not None else None
    return probe_hardware(binary, root=box / "root", run=RecordedCommands(commands, replace=replace), platform="linux")


def probe_configured(binary: BinaryInfo | None, fixture: Path | None = None) -> HardwareReport:
    """This machine, or the recorded one the `hardware_fixture` setting (MESHNET_HARDWARE_FIXTURE) names."""
    return probe_recorded(fixture, binary) if fixture is not None else probe_hardware(binary)


# --------------------------------------------------------------------------- formatting


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _rows(report: HardwareReport) -> list[tuple[str, str]]:
    rows = [
        ("CPU", f"{report.cpu.model} ({report.cpu.physical_cores or '?'} cores, {report.cpu.logical_cores} threads)"),
        ("RAM", f"{_gib(report.ram_total_bytes)} total, {_gib(report.ram_available_bytes)} available"),
    ]
    if report.ttm_pages_limit_bytes:
        rows.append(("TTM limit", _gib(report.ttm_pages_limit_bytes)))
    if not report.gpus:
        rows.append(("GPU", "none: models run on the CPU"))
    for i, gpu in enumerate(report.gpus):
        label = f"GPU {i}"
        labels = f" [{', '.join(gpu.labels)}]" if gpu.labels else ""
        rows.append((label, f"{gpu.name}{labels}"))
        rows.append(("  type", f"{gpu.vendor} {gpu.kind}, {'unified memory' if gpu.unified else 'dedicated memory'}"))
        if gpu.pci_id or gpu.gfx_target:
            rows.append(("  id", " ".join(x for x in (gpu.pci_id, gpu.gfx_target) if x)))
        rows.append(("  backends", ", ".join(gpu.backends) or "none"))
        devices = ", ".join(f"{d.name} ({_gib(d.total_bytes)} reported, {_gib(d.free_bytes)} free)" for d in gpu.llama_devices)
        rows.append(("  llama-server", devices or "not visible"))
        if gpu.vram_bytes is not None:
            gtt = f", GTT {_gib(gpu.gtt_bytes)}" if gpu.gtt_bytes is not None else ""
            rows.append(("  sysfs", f"VRAM {_gib(gpu.vram_bytes)}{gtt}"))
        rows.append(("  budget", f"{format_bytes(gpu.budget_bytes)} = {_gib(gpu.budget_bytes)} ({gpu.budget_basis})"))
    rows.append(("capacity", report.capacity().describe()))
    rows.append(("Vulkan ICDs", ", ".join(report.vulkan_icds) or "none found"))
    for name, status in report.probes.items():
        rows.append((f"probe {name}", status))
    return rows


def format_table(report: HardwareReport) -> str:
    rows = _rows(report)
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.extend(f"note: {note}" for note in report.notes)
    return "\n".join(lines)


def machine_budget_bytes(binary: BinaryInfo | None = None) -> int:
    """Memory a model may occupy here (RAM plus what the GPU llama-server sees can hold): the fit hints' budget."""
    return int(probe_hardware(binary).capacity().total_bytes)
