"""The llama-server child process itself: spawn it, stop it, reap one an earlier run left behind.

Also the two things the kernel and the file system do for us around the child: the
parent-death signal (the child dies with the node, even on kill -9) and the private folder
its UNIX socket lives in. The restart loop that uses these is `supervisor`; the warm-up
after load is `warmup`.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import psutil

from meshnet_gguf.common.settings import LLAMA_STOP_TIMEOUT_S
from meshnet_gguf.llama.binary import BinaryInfo

log = logging.getLogger(__name__)

API_KEY_ENV = "LLAMA_API_KEY"  # llama-server reads its key from here: never on argv, never in logs
# The node's own settings (the enrolment secret, the API key among them) are not llama-server's business.
NODE_ENV_PREFIX = "MESHNET_"
# After SIGTERM, llama-server gets this long to exit before SIGKILL: the node's setting's default.
STOP_TIMEOUT_S = LLAMA_STOP_TIMEOUT_S
PIDFILE_NAME = "llama-server.pid"
# llama-server listens on a UNIX socket in this private folder of the state dir, so only
# this user can reach it (a loopback port can be raced for, and reached, by any local user).
SOCKET_DIR_NAME = "run"
SOCKET_NAME = "llama-server.sock"
SOCKET_DIR_MODE = 0o700
# sun_path holds 108 bytes with its terminating NUL; a longer path falls back to loopback TCP.
MAX_SOCKET_PATH_BYTES = 107
# A build that can listen on a UNIX socket says so in its --host help line.
_UNIX_SOCKET_HELP_MARK = "unix socket"
# create_time from /proc has 10 ms resolution; anything closer is the same process.
_CREATE_TIME_TOLERANCE_S = 0.05
_PR_SET_PDEATHSIG = 1


class ChildFailed(RuntimeError):
    """llama-server could not be brought (back) to ready; the message carries its last log lines."""


@dataclass(frozen=True)
class ChildSpec:
    binary: BinaryInfo
    args: Sequence[str]  # everything but host, port and key, which the supervisor owns
    env: Mapping[str, str] = field(default_factory=dict)


async def spawn(argv: Sequence[str], env: Mapping[str, str]) -> asyncio.subprocess.Process:
    """Start a child in its own process group, output piped, killed by the kernel when the node dies."""
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=dict(env),
        start_new_session=True,  # own process group: stop() signals the child and anything it spawned
        preexec_fn=die_with_parent(os.getpid()),
    )


async def terminate(proc: asyncio.subprocess.Process, stop_timeout_s: float, name: str = "llama-server") -> None:
    """SIGTERM to the child's group, SIGKILL after `stop_timeout_s`; then SIGKILL to what it left."""
    if proc.returncode is None:
        signal_group(proc.pid, signal.SIGTERM)
        with anyio.move_on_after(stop_timeout_s):
            await proc.wait()
        if proc.returncode is None:
            log.warning("%s (pid %s) ignored SIGTERM for %.0f s; killing", name, proc.pid, stop_timeout_s)
    # Also after a crash: helpers it left in its group must not linger.
    signal_group(proc.pid, signal.SIGKILL)
    await proc.wait()


def child_environment(inherited: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """llama-server's environment: the node's, without the node's own `MESHNET_*` settings, plus `extra`."""
    env = {k: v for k, v in inherited.items() if not k.upper().startswith(NODE_ENV_PREFIX)}
    env.update(extra)
    return env


# --- the socket folder --------------------------------------------------------------
def supports_unix_socket(binary: BinaryInfo) -> bool:
    """Whether this llama-server build can listen on a UNIX socket (`--host PATH.sock`)."""
    return _UNIX_SOCKET_HELP_MARK in binary.help_text.lower()


def socket_path_for(binary: BinaryInfo, state_dir: Path | None) -> Path | None:
    """Where llama-server should listen, or None for loopback TCP (no state dir, an older
    build, or a path too long for a socket address)."""
    if state_dir is None or not supports_unix_socket(binary):
        return None
    path = Path(state_dir).absolute() / SOCKET_DIR_NAME / SOCKET_NAME
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        log.info("state dir path too long for a UNIX socket; llama-server listens on loopback TCP")
        return None
    return path


def prepare_socket_dir(socket_path: Path) -> None:
    """Make the socket's folder ours alone, and remove a socket a killed run left behind
    (llama-server cannot bind over it). Refuses a folder someone else could have planted."""
    folder = socket_path.parent
    folder.mkdir(mode=SOCKET_DIR_MODE, parents=True, exist_ok=True)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ChildFailed(f"{folder} is not a folder owned by this user; refusing to put llama-server's socket there")
    if info.st_mode & 0o077:
        os.chmod(folder, SOCKET_DIR_MODE)
    remove_socket(socket_path)


def remove_socket(socket_path: Path | None) -> None:
    """Remove llama-server's socket once it has exited: it never removes its own, and a stale
    one would sit in the state dir until the next start."""
    if socket_path is not None:
        socket_path.unlink(missing_ok=True)


# --- the pidfile and the stale-child reaper ----------------------------------------------
def write_pidfile(pidfile: Path, pid: int, binary: Path) -> None:
    try:
        created = psutil.Process(pid).create_time()
    except psutil.Error:
        return
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "pid": pid,
        "create_time": created,
        "binary": str(binary),
        # The node that owns this child: a later run may end the child only once this node is gone.
        "owner_pid": os.getpid(),
        "owner_create_time": _OWN_CREATE_TIME,
    }
    pidfile.write_text(json.dumps(record))


async def reap_stale_child_in_thread(pidfile: Path | None, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """`reap_stale_child` off the event loop: it waits on the old process (up to 2 x `timeout_s`)."""
    return await anyio.to_thread.run_sync(reap_stale_child, pidfile, timeout_s)


def reap_stale_child(pidfile: Path | None, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """End the llama-server an earlier, killed run left behind; True when one was ended.
    Blocks while the old process exits: from async code, use `reap_stale_child_in_thread`.

    Identified by pid AND start time from our pidfile, so a recycled pid that now
    belongs to another process is never touched. A child whose owning node is
    still alive (another process) is never touched either: it is that node's,
    serving, not a leftover.
    """
    if pidfile is None or not pidfile.exists():
        return False
    try:
        record = json.loads(pidfile.read_text())
        proc = psutil.Process(int(record["pid"]))
        same = _same_process(proc, record["create_time"])
    except (ValueError, KeyError, TypeError, psutil.Error, OSError):
        same = False
    if not same:
        pidfile.unlink(missing_ok=True)
        return False
    owner = _live_owner(record)
    if owner is not None:
        log.warning("llama-server pid %s belongs to node pid %s, which is still running: leaving it alone", proc.pid, owner)
        return False
    log.warning("ending llama-server pid %s left by an earlier run", proc.pid)
    for stop in (proc.terminate, proc.kill):
        try:
            stop()
            proc.wait(timeout=timeout_s)
            break
        except psutil.NoSuchProcess:
            break
        except psutil.TimeoutExpired:
            continue
    else:
        # A zombie is dead already; anything else still holds memory and must be reported.
        if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            log.error("llama-server pid %s from an earlier run survived SIGKILL", proc.pid)
    pidfile.unlink(missing_ok=True)
    return True


def _same_process(proc: psutil.Process, recorded_create_time: object) -> bool:
    return abs(proc.create_time() - float(recorded_create_time)) < _CREATE_TIME_TOLERANCE_S  # type: ignore[arg-type]


def _live_owner(record: dict[str, object]) -> int | None:
    """The pid of the node that wrote `record`, when that node is alive and is not this process."""
    owner_pid = record.get("owner_pid")
    if not isinstance(owner_pid, int) or owner_pid == os.getpid():
        return None
    try:
        owner = psutil.Process(owner_pid)
        alive = _same_process(owner, record.get("owner_create_time")) and owner.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, TypeError, ValueError):
        return None
    return owner_pid if alive else None


def _own_create_time() -> float | None:
    try:
        return psutil.Process().create_time()
    except psutil.Error:
        return None


_OWN_CREATE_TIME = _own_create_time()


# --- signals --------------------------------------------------------------------------
def signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """Linux: have the kernel SIGKILL the child when the node dies, even by kill -9."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def set_parent_death_signal() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        # The parent may have died between fork and prctl: then nobody would kill us.
        if os.getppid() != parent_pid:
            os._exit(1)

    return set_parent_death_signal
