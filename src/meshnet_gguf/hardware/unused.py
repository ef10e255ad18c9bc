"""A GPU nobody uses, named: each GPU or Vulkan driver on this box that the chosen llama-server cannot use,
with what it would take to use it, in one line each (`meshnet-gguf hardware` and `doctor` print them).

What the binary can use is asked, never assumed: the devices it lists (`--list-devices`, already in the
`HardwareReport`) and the GPU backends it was built with (`llama.features.built_backends`: its build
record, the backend libraries beside it, or its own bytes). `explain_unused` is the pure part: a report
and a few facts of the box (`BoxFacts`) in, the lines out, so recorded machines test every case.
`find_unused` reads those facts here (or below a recorded machine's root).

Nothing new is said where the binary already drives a GPU, besides a real GPU it leaves out; an
integrated GPU beside a discrete card is left alone (it would only share the CPU's memory bandwidth).
llvmpipe (Mesa's `lvp` Vulkan driver) is named for what it is, a software rasterizer no faster than the
CPU, never as a GPU to use: ggml hides such CPU-type Vulkan devices unless GGML_VK_VISIBLE_DEVICES is set.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from meshnet_gguf.hardware.report import GpuInfo, HardwareReport
from meshnet_gguf.hardware.sources import icd_vendors
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.features import BuiltBackends, built_backends
from meshnet_gguf.llama.gpu_toolchains import find_hipcc, find_nvcc

__all__ = [
    "BUILD_CUDA",
    "BUILD_ROCM",
    "BUILD_VULKAN",
    "GLVND_PACKAGES",
    "BoxFacts",
    "UnusedGpu",
    "explain_unused",
    "find_unused",
    "format_unused",
    "read_box_facts",
]

# The commands that make a llama-server for a GPU (`build-llama-server --backend`), and what each needs.
BUILD_CUDA = "meshnet-gguf build-llama-server --backend cuda"
BUILD_VULKAN = "meshnet-gguf build-llama-server --backend vulkan"
BUILD_ROCM = "meshnet-gguf build-llama-server --backend rocm"
CUDA_TOOLKIT_PACKAGES = (
    "the CUDA toolkit's nvcc: Debian/Ubuntu apt install nvidia-cuda-toolkit, NVIDIA's cuda-toolkit package, or pip install nvidia-cuda-nvcc"
)
HIP_PACKAGES = "ROCm's hipcc: Debian 13/Ubuntu 24.04 apt install hipcc libhipblas-dev librocblas-dev, or AMD's rocm-hip-sdk"
# The Vulkan backend's build needs the loader's headers, a shader compiler and SPIR-V headers; on Debian 12 and
# Ubuntu 22.04 too (their older headers are patched before the build).
VULKAN_BUILD_PACKAGES = "libvulkan-dev glslc spirv-headers"
MESA_VULKAN_PACKAGE = "mesa-vulkan-drivers"
# NVIDIA's Vulkan ICD (libGLX_nvidia.so.0) loads through libglvnd; without these the GPU vanishes from Vulkan (FACTS.md).
GLVND_PACKAGES = "libglvnd0 libglx0 libegl1 libgl1 libopengl0 libgles2 libvulkan1"
GLVND_LIBRARIES = ("libGLdispatch.so.0", "libGLX.so.0")
NVIDIA_ICD_PACKAGES = "Debian: apt install nvidia-vulkan-icd; Ubuntu: the libnvidia-gl package of your driver version"
# Where distributions keep shared libraries, below the root read.
LIBRARY_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "usr/lib", "lib/x86_64-linux-gnu")
# Where a recorded machine's GPU compilers are looked for (this machine's: as the build looks, `gpu_toolchains`).
RECORDED_TOOL_DIRS = ("usr/bin", "usr/local/bin", "usr/local/cuda/bin", "opt/cuda/bin", "opt/rocm/bin")
DRM_CLASS_DIR = "sys/class/drm"
KFD_DEVICE = "dev/kfd"
SOFTWARE_RASTERIZER = "a software rasterizer, no faster than the CPU"
_VENDOR_NAMES = {"amd": "AMD", "nvidia": "NVIDIA", "intel": "Intel"}
_BACKEND_NAMES = {"vulkan": "Vulkan", "cuda": "CUDA", "rocm": "ROCm"}

Kind = Literal["gpu", "driver", "software"]


@dataclass(frozen=True)
class UnusedGpu:
    """One GPU or Vulkan driver the chosen llama-server does not use: `kind` gpu (a real one, left to the CPU),
    driver (a Vulkan ICD for GPUs this binary cannot drive), software (llvmpipe: nothing to gain)."""

    subject: str
    kind: Kind
    why: str
    fix: str  # "" where there is nothing to do

    def line(self) -> str:
        return f"{self.subject}: {self.why}; " + (f"to use it: {self.fix}" if self.fix else "nothing to do")


@dataclass(frozen=True)
class BoxFacts:
    """What `explain_unused` needs besides the report: read here by `read_box_facts`, recorded in tests."""

    built: BuiltBackends | None  # None: the binary could not be read, so its backends are unknown
    sysfs_drm: bool  # /sys/class/drm could be read: the GPUs it lists are all there are
    kfd: bool  # /dev/kfd: the kernel's ROCm compute device
    missing_glvnd: tuple[str, ...]  # libglvnd's libraries that NVIDIA's Vulkan driver needs and are absent
    nvcc: bool
    hipcc: bool


# --------------------------------------------------------------------------- the pure part


def explain_unused(report: HardwareReport, facts: BoxFacts) -> tuple[UnusedGpu, ...]:
    """Each GPU or Vulkan driver here the binary cannot use, and what would use it. Nothing when the binary was not
    asked for its devices (`report.llama_devices` None): what it can use is then unknown."""
    if report.llama_devices is None:
        return ()
    backends = _Backends(facts.built, frozenset(d.backend for d in report.llama_devices))
    real = [g for g in report.gpus if g.kind != "software"]
    used = [g for g in real if g.usable_by_binary]
    card = any(g.kind == "discrete" for g in real)
    found: list[UnusedGpu] = []
    for gpu in real:
        # An iGPU beside a graphics card would only share the CPU's memory bandwidth: the card is the one to name.
        if gpu.usable_by_binary or (gpu.kind == "integrated" and card):
            continue
        found.append(_unused_gpu(gpu, report, facts, backends))
    if not used:
        found += _drivers_without_gpu(report, facts, backends)
    if not real:  # beside a real GPU, its own line says what to do
        found += _software_renderers(report, backends)
    return tuple(found)


class _Backends:
    """What the binary can drive: the backends of the devices it listed, and those it was built with."""

    def __init__(self, built: BuiltBackends | None, listed: frozenset[str]) -> None:
        self.built = built
        self.listed = listed

    def has(self, backend: str) -> bool:
        return backend in self.listed or (self.built is not None and backend in self.built.gpu)

    def lacks(self, *names: str) -> str:
        """`this llama-server has no CUDA and no Vulkan (its build.json says cpu)`; or that it lists no device and its
        backends are unknown."""
        if self.built is None:
            return (
                "this llama-server lists no device for it, and which GPU backends it was built with is unknown (its file could not be read)"
            )
        return f"this llama-server has {' and '.join(f'no {_BACKEND_NAMES[n]}' for n in names)} ({self.built.basis})"


def _unused_gpu(gpu: GpuInfo, report: HardwareReport, facts: BoxFacts, backends: _Backends) -> UnusedGpu:
    if gpu.vendor == "nvidia":
        return _nvidia(gpu, report, facts, backends)
    if gpu.vendor in ("amd", "intel"):
        return _mesa(gpu, report, facts, backends)
    return UnusedGpu(gpu.name, "gpu", "llama-server lists no device for it, so models run on the CPU", "a llama-server built for this GPU")


def _cuda_build(facts: BoxFacts) -> str:
    return f"{BUILD_CUDA} (needs {CUDA_TOOLKIT_PACKAGES})" if not facts.nvcc else f"{BUILD_CUDA} (nvcc is installed)"


def _vulkan_build(extra_packages: str = "") -> str:
    return f"{BUILD_VULKAN} (apt install {VULKAN_BUILD_PACKAGES}{f' {extra_packages}' if extra_packages else ''})"


def _nvidia(gpu: GpuInfo, report: HardwareReport, facts: BoxFacts, backends: _Backends) -> UnusedGpu:
    has_icd = any("nvidia" in icd.lower() for icd in report.vulkan_icds)
    if backends.has("cuda"):
        return UnusedGpu(
            gpu.name, "gpu",
            "this llama-server has CUDA but lists no device for it: the NVIDIA driver did not give CUDA the GPU "
            "(a driver older than the build's CUDA, or a kernel module of another driver version)",
            "update the NVIDIA driver so `nvidia-smi` and the kernel module agree and support the build's CUDA version, then reboot",
        )  # fmt: skip
    if backends.has("vulkan"):
        if facts.missing_glvnd:
            missing = ", ".join(facts.missing_glvnd)
            why = (
                f"this llama-server's Vulkan lists no device for it: NVIDIA's Vulkan driver (libGLX_nvidia.so.0) needs "
                f"libglvnd, and {missing} {'is' if len(facts.missing_glvnd) == 1 else 'are'} missing"
            )
            fix = f"install the GL vendor libraries: apt install {GLVND_PACKAGES} (Fedora: dnf install libglvnd-glx libglvnd-egl vulkan-loader)"
        elif not has_icd:
            why = "this llama-server's Vulkan lists no device for it: NVIDIA's Vulkan ICD manifest (nvidia_icd.json) is not installed"
            fix = f"install the NVIDIA driver's Vulkan part ({NVIDIA_ICD_PACKAGES})"
        else:
            why = (
                "this llama-server's Vulkan lists no device for it, though libglvnd and NVIDIA's Vulkan ICD are installed: "
                "usually the driver's libraries and its kernel module are of different versions"
            )
            fix = "reinstall the NVIDIA driver so libnvidia-* and the kernel module match, then reboot"
        return UnusedGpu(gpu.name, "gpu", why, f"{fix}; or {_cuda_build(facts)}")
    why = f"{backends.lacks('cuda', 'vulkan')}, so models run on the CPU"
    vulkan = _vulkan_build(GLVND_PACKAGES if facts.missing_glvnd else "")
    if not has_icd:
        vulkan += f" with NVIDIA's Vulkan ICD ({NVIDIA_ICD_PACKAGES})"
    return UnusedGpu(gpu.name, "gpu", why, f"{_cuda_build(facts)}, or {vulkan}")


def _mesa(gpu: GpuInfo, report: HardwareReport, facts: BoxFacts, backends: _Backends) -> UnusedGpu:
    """AMD and Intel GPUs: Vulkan through Mesa (RADV, ANV); AMD's also through ROCm where /dev/kfd is."""
    has_icd = gpu.vendor in icd_vendors(report.vulkan_icds)
    rocm = gpu.vendor == "amd" and facts.kfd and not backends.has("rocm")
    hip = f", or {BUILD_ROCM} (/dev/kfd is here; " + ("hipcc is installed)" if facts.hipcc else f"needs {HIP_PACKAGES})") if rocm else ""
    if backends.has("vulkan"):
        if not has_icd:
            why = f"this llama-server's Vulkan lists no device for it: no Mesa Vulkan driver for {_VENDOR_NAMES[gpu.vendor]} GPUs is installed"
            fix = f"apt install {MESA_VULKAN_PACKAGE} (Fedora: dnf install {MESA_VULKAN_PACKAGE})"
        else:
            why = "this llama-server's Vulkan lists no device for it although Mesa's driver is installed: this user may not open /dev/dri/renderD*"
            fix = "add the user that runs the node to the render and video groups (sudo usermod -aG render,video USER)"
        return UnusedGpu(gpu.name, "gpu", why, fix + hip)
    if backends.has("rocm"):
        why = "this llama-server's ROCm lists no device for it (ROCm supports only some GPUs)"
    else:
        why = f"{backends.lacks('vulkan', *(('rocm',) if gpu.vendor == 'amd' else ()))}, so models run on the CPU"
    return UnusedGpu(gpu.name, "gpu", why, _vulkan_build("" if has_icd else MESA_VULKAN_PACKAGE) + hip)


def _drivers_without_gpu(report: HardwareReport, facts: BoxFacts, backends: _Backends) -> list[UnusedGpu]:
    """Vulkan drivers for GPUs none of which was seen, where the binary has no Vulkan and no GPU list could be read
    (no /sys/class/drm: a container or some VMs), so such a GPU may be here and would go unused."""
    if facts.sysfs_drm or backends.has("vulkan"):
        return []
    seen = {g.vendor for g in report.gpus}
    by_vendor: dict[str, list[str]] = {}
    for icd in report.vulkan_icds:
        for vendor in sorted(icd_vendors([icd]) - {"software"} - seen):
            by_vendor.setdefault(vendor, []).append(icd)
    if backends.built is not None:
        why = f"this llama-server was built without Vulkan ({backends.built.basis})"
    else:
        why = "this llama-server lists no Vulkan device and whether it was built with Vulkan is unknown"
    return [
        UnusedGpu(
            f"{', '.join(icds)} (Vulkan driver for {_VENDOR_NAMES[vendor]} GPUs)",
            "driver",
            f"{why}, so a GPU this driver runs would go unused; whether one is here is unknown "
            f"(/{DRM_CLASS_DIR} could not be read, and no {_VENDOR_NAMES[vendor]} GPU answered)",
            _vulkan_build(),
        )
        for vendor, icds in sorted(by_vendor.items())
    ]


def _software_renderers(report: HardwareReport, backends: _Backends) -> list[UnusedGpu]:
    listed = [d for d in report.llama_devices or () if d.vendor == "software"]
    found = []
    for icd in report.vulkan_icds:
        if "software" not in icd_vendors([icd]):
            continue
        if listed:
            seen = f"llama-server lists it as {', '.join(d.name for d in listed)} (GGML_VK_VISIBLE_DEVICES is set), but it is {SOFTWARE_RASTERIZER}"
        elif backends.has("vulkan"):
            seen = f"{SOFTWARE_RASTERIZER}, so not a GPU to use (ggml hides it unless GGML_VK_VISIBLE_DEVICES is set)"
        else:
            seen = f"{SOFTWARE_RASTERIZER}, so not a GPU to use (and this llama-server has no Vulkan to see it)"
        found.append(UnusedGpu(f"{icd} (Mesa llvmpipe)", "software", seen, ""))
    return found


def format_unused(unused: tuple[UnusedGpu, ...]) -> str:
    """One line each, as `hardware` prints them below its table."""
    return "\n".join(f"unused: {u.line()}" for u in unused)


# --------------------------------------------------------------------------- reading the box


def _compiler_here(root: Path, env: Mapping[str, str] | None) -> Callable[[str], bool]:
    """Whether a GPU compiler is installed: found as the build finds it on this machine, else in a recorded root."""
    if root == Path("/"):
        finders = {"nvcc": find_nvcc, "hipcc": find_hipcc}
        return lambda name: finders[name](env) is not None
    return lambda name: any(os.access(root / directory / name, os.X_OK) for directory in RECORDED_TOOL_DIRS)


def read_box_facts(binary: BinaryInfo | None, root: Path = Path("/"), env: Mapping[str, str] | None = None) -> BoxFacts:
    """The box's facts that `explain_unused` needs, read below `root` (a recorded machine's, or this one)."""
    root = Path(root)
    tool = _compiler_here(root, env)
    return BoxFacts(
        built=built_backends(binary) if binary is not None else None,
        sysfs_drm=(root / DRM_CLASS_DIR).is_dir(),
        kfd=(root / KFD_DEVICE).exists(),
        missing_glvnd=tuple(lib for lib in GLVND_LIBRARIES if not any((root / d / lib).exists() for d in LIBRARY_DIRS)),
        nvcc=tool("nvcc"),
        hipcc=tool("hipcc"),
    )


def find_unused(report: HardwareReport, binary: BinaryInfo | None, root: Path = Path("/")) -> tuple[UnusedGpu, ...]:
    """The GPUs and Vulkan drivers here that `binary` cannot use, one `UnusedGpu` each (see `explain_unused`)."""
    return explain_unused(report, read_box_facts(binary, root))
