"""What a llama-server build can do besides serving a model: a web UI, llama.cpp RPC, Vulkan.

Builds differ: the bundled wheel has all three; a build made here has RPC, a web
UI when npm was there to build it, and Vulkan when the headers allowed. A
feature the binary lacks is refused before launch with the fix, and the node's
page links no chat that is not there. Each feature is read from where it is
cheapest to know: `--help` (RPC), the files beside the binary or its own bytes
(Vulkan), and the run probe's look at `/` (the web UI).
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from meshnet_gguf.llama.binary import BUILD_INFO_FILE, BUILD_TIME_TEXT, BinaryInfo

RPC_SERVER_NAME = "ggml-rpc-server"
# Each GPU backend a build may hold: the library a shared or GGML_BACKEND_DL build ships it in, and log text
# compiled into it (a static build has no separate library to look for). ggml-cuda prints
# "found %d CUDA devices" and, compiled for HIP, "found %d ROCm devices".
_BACKEND_SIGNS = {
    "vulkan": ("libggml-vulkan*.so*", b"ggml_vulkan"),
    "cuda": ("libggml-cuda*.so*", b"found %d CUDA devices"),
    "rocm": ("libggml-hip*.so*", b"found %d ROCm devices"),
}
# What a build record's "backend" says of the GPU backends it was built with.
_RECORDED_BACKENDS = {"cpu": frozenset(), "vulkan": frozenset({"vulkan"}), "cuda": frozenset({"cuda"}), "rocm": frozenset({"rocm"})}
REBUILD_FIX = (
    "build one that has it: meshnet-gguf build-llama-server --force "
    f"(RPC always; the web UI when npm is installed: apt-get install npm; {BUILD_TIME_TEXT})"
)


@dataclass(frozen=True)
class BinaryFeatures:
    web_ui: bool | None  # None: not known (the run probe did not reach `/`)
    rpc: bool  # `--rpc` in llama-server and a ggml-rpc-server beside it
    vulkan: bool

    def describe(self) -> str:
        """`web UI, RPC, no Vulkan`: the words doctor, `serve --dry-run` and the node page use."""
        ui = "web UI unknown" if self.web_ui is None else "web UI" if self.web_ui else "no web UI"
        return ", ".join([ui, "RPC" if self.rpc else "no RPC", "Vulkan" if self.vulkan else "no Vulkan"])


def binary_features(binary: BinaryInfo, web_ui: bool | None) -> BinaryFeatures:
    return BinaryFeatures(web_ui=web_ui, rpc=_has_rpc(binary), vulkan=_has_vulkan(binary.path, binary.library_dirs))


def missing_rpc(binary: BinaryInfo) -> str:
    """Why a pool (llama-server `--rpc`) or a worker (ggml-rpc-server) cannot run on this binary."""
    if not binary.supports("--rpc"):
        return f"llama-server {binary.path} was built without RPC (no --rpc): it cannot use pool workers. Fix: {REBUILD_FIX}"
    return f"there is no {RPC_SERVER_NAME} beside {binary.path}. Fix: {REBUILD_FIX}"


def _has_rpc(binary: BinaryInfo) -> bool:
    return binary.supports("--rpc") and binary.path.with_name(RPC_SERVER_NAME).is_file()


@dataclass(frozen=True)
class BuiltBackends:
    """The GPU backends a llama-server was built with (vulkan, cuda, rocm; none: a CPU build), and how that is known."""

    gpu: frozenset[str]
    basis: str  # "its build.json says cpu", "libggml-vulkan.so is beside it", "its own bytes"

    def describe(self) -> str:
        """`no GPU backend (its build.json says cpu)`, `Vulkan (libggml-vulkan.so is beside it)`."""
        names = {"vulkan": "Vulkan", "cuda": "CUDA", "rocm": "ROCm"}
        have = " and ".join(names[b] for b in sorted(self.gpu)) or "no GPU backend"
        return f"{have} ({self.basis})"


def built_backends(binary: BinaryInfo) -> BuiltBackends | None:
    """What the binary was built to drive: its build record's "backend" where there is one, else the backend
    libraries beside it, else its own bytes. None where the binary cannot be read (a recorded machine's)."""
    try:
        stat = binary.path.stat()
    except OSError:
        return None
    return _built_cached(binary.path, stat.st_mtime_ns, stat.st_size, binary.library_dirs)


def _has_vulkan(path: Path, library_dirs: tuple[Path, ...]) -> bool:
    try:
        stat = path.stat()
    except OSError:  # a recorded machine's binary, or none: nothing to look at
        return False
    built = _built_cached(path, stat.st_mtime_ns, stat.st_size, library_dirs)
    return built is not None and "vulkan" in built.gpu


@lru_cache(maxsize=8)
def _built_cached(path: Path, _mtime_ns: int, _size: int, library_dirs: tuple[Path, ...]) -> BuiltBackends | None:
    record = path.parent / BUILD_INFO_FILE
    if record.is_file():
        try:
            recorded = json.loads(record.read_text()).get("backend")
        except (OSError, ValueError, AttributeError):
            recorded = None
        if recorded in _RECORDED_BACKENDS:
            return BuiltBackends(_RECORDED_BACKENDS[recorded], f"its {BUILD_INFO_FILE} says {recorded}")
    libraries = {
        backend: library.name
        for backend, (pattern, _) in _BACKEND_SIGNS.items()
        for folder in sorted({path.parent, *library_dirs})
        for library in sorted(folder.glob(pattern))[:1]
    }
    if libraries:
        return BuiltBackends(frozenset(libraries), f"{', '.join(sorted(set(libraries.values())))} beside it")
    try:
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            found = frozenset(backend for backend, (_, marker) in _BACKEND_SIGNS.items() if data.find(marker) != -1)
    except (OSError, ValueError):
        return None
    return BuiltBackends(found, "read from its own bytes")
