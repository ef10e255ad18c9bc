"""Which of llama.cpp's release builds suit this box, most capable first.

    ROCm installed (hipcc, rocminfo, /opt/rocm or $ROCM_PATH)      ─► the ROCm build
    a GPU (AMD, NVIDIA, Intel) and a Vulkan driver for it           ─► the Vulkan build
    always, last                                                   ─► the CPU build

llama.cpp's Linux release builds load each backend as a module at run time
(`GGML_BACKEND_DL`), so a GPU build whose GPU library cannot load still runs on
the CPU; the choice only decides what is downloaded first. Read from the files
alone (sysfs, the Vulkan ICD manifests), in microseconds, no GPU library loaded.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from meshnet_gguf.llama.release_assets import CPU, MACOS, ROCM, VULKAN

ROCM_PATH_ENV_VAR = "ROCM_PATH"
ROCM_DEFAULT_DIR = "opt/rocm"
ROCM_TOOLS = ("hipcc", "rocminfo")
# Display controllers that run llama.cpp compute, by PCI vendor; the rest (BMC graphics, virtio) drive a console.
GPU_VENDORS = {"0x1002": "AMD", "0x10de": "NVIDIA", "0x8086": "Intel"}
NVIDIA_DEVICE_NODE = "dev/nvidia0"
VULKAN_ICD_DIRS = ("usr/share/vulkan/icd.d", "etc/vulkan/icd.d", "usr/local/share/vulkan/icd.d")
# Mesa's CPU rasteriser (lavapipe): a Vulkan driver, but no GPU behind it.
SOFTWARE_ICD_PREFIXES = ("lvp",)


@dataclass(frozen=True)
class BackendChoice:
    backend: str
    why: str  # one clause: "ROCm is installed (/opt/rocm)"


def release_backends(root: Path = Path("/"), env: Mapping[str, str] | None = None) -> tuple[BackendChoice, ...]:
    """The release builds to try here, most capable first; the CPU build (on macOS, the Metal one) always last."""
    if platform.system() == "Darwin":
        return (BackendChoice(MACOS, "macOS (Metal)"),)
    env = os.environ if env is None else env
    chosen = []
    rocm = _rocm_installed(root, env)
    if rocm is not None:
        chosen.append(BackendChoice(ROCM, f"ROCm is installed ({rocm})"))
    gpus = _gpu_vendors(root)
    icds = _hardware_icds(root)
    if gpus and icds:
        chosen.append(BackendChoice(VULKAN, f"an {'/'.join(sorted(gpus))} GPU with a Vulkan driver ({', '.join(icds)})"))
    elif gpus:
        chosen.append(BackendChoice(VULKAN, f"an {'/'.join(sorted(gpus))} GPU, though no Vulkan driver is installed yet"))
    reason = "no GPU build suits this box" if not chosen else "if no GPU build runs here"
    chosen.append(BackendChoice(CPU, reason))
    return tuple(chosen)


def _rocm_installed(root: Path, env: Mapping[str, str]) -> str | None:
    given = env.get(ROCM_PATH_ENV_VAR)
    for folder in filter(None, [Path(given) if given else None, root / ROCM_DEFAULT_DIR]):
        if folder.is_dir():
            return str(folder)
    if root == Path("/"):
        for tool in ROCM_TOOLS:
            found = shutil.which(tool, path=env.get("PATH"))
            if found:
                return found
    return None


def _gpu_vendors(root: Path) -> set[str]:
    vendors = set()
    drm = root / "sys/class/drm"
    try:
        cards = [p for p in drm.iterdir() if re.fullmatch(r"card\d+", p.name)]
    except OSError:
        cards = []
    for card in cards:
        try:
            vendor = (card / "device" / "vendor").read_text().strip().lower()
        except OSError:
            continue
        if vendor in GPU_VENDORS:
            vendors.add(GPU_VENDORS[vendor])
    if (root / NVIDIA_DEVICE_NODE).exists():
        vendors.add("NVIDIA")
    return vendors


def _hardware_icds(root: Path) -> list[str]:
    found = []
    for folder in VULKAN_ICD_DIRS:
        try:
            names = sorted(p.name for p in (root / folder).glob("*.json"))
        except OSError:
            continue
        found += [name for name in names if not name.lower().startswith(SOFTWARE_ICD_PREFIXES)]
    return found
