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
# Log text compiled into every Vulkan backend (static builds have no separate library to look for).
_VULKAN_MARKER = b"ggml_vulkan"
_VULKAN_LIBRARY_GLOB = "libggml-vulkan*.so*"
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


def _has_vulkan(path: Path, library_dirs: tuple[Path, ...]) -> bool:
    try:
        stat = path.stat()
    except OSError:  # a recorded machine's binary, or none: nothing to look at
        return False
    return _vulkan_cached(path, stat.st_mtime_ns, stat.st_size, library_dirs)


@lru_cache(maxsize=8)
def _vulkan_cached(path: Path, _mtime_ns: int, _size: int, library_dirs: tuple[Path, ...]) -> bool:
    record = path.parent / BUILD_INFO_FILE
    if record.is_file():
        try:
            return json.loads(record.read_text()).get("backend") == "vulkan"
        except (OSError, ValueError, AttributeError):
            pass
    for folder in {path.parent, *library_dirs}:
        if any(folder.glob(_VULKAN_LIBRARY_GLOB)):
            return True
    try:
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(_VULKAN_MARKER) != -1
    except (OSError, ValueError):
        return False
