"""A throwaway systemd to start units under, where systemd is not this machine's init (a container).

`systemd-nspawn --boot` runs the installed systemd as PID 1 of a container whose
root is an empty tmpfs with this machine's `/usr` (`--volatile=yes`): nothing it
writes reaches this machine except through the folders bound in. It boots to
`sysinit.target` only, with systemd-tmpfiles masked: its boot-time clean of
`/tmp` must never meet a folder bound from here (bound at its own path under
`/tmp`, it would be emptied). The network is this machine's, so a unit's port is
reached from the test as usual. Units are started with `systemctl`/`systemd-run`
run inside it through `nsenter`; closing powers it off through systemd-nspawn
(its init is killed by pid if that does not end it in time).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

SYSTEMD_NSPAWN = shutil.which("systemd-nspawn")  # Debian package `systemd-container`
NSENTER = shutil.which("nsenter")
# Where the test's own folder appears inside: outside /tmp, whatever the container does there.
WORKDIR_INSIDE = Path("/meshnet-test")
BOOT_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
_BOOT_ARGS = (
    "systemd.unit=sysinit.target",
    "systemd.firstboot=off",
    "systemd.mask=systemd-tmpfiles-setup.service",
    "systemd.mask=systemd-tmpfiles-setup-dev.service",
    "systemd.mask=systemd-tmpfiles-clean.timer",
)


class ContainerUnavailable(RuntimeError):
    """systemd could not be booted in a container here; the message says why (the test skips with it)."""


def unavailable_reason() -> str | None:
    """Why a container cannot be tried here at all, or None."""
    if SYSTEMD_NSPAWN is None or NSENTER is None:
        return "systemd-nspawn not installed (Debian package `systemd-container`; CI installs it)"
    if os.geteuid() != 0:
        return "booting systemd in a container (systemd-nspawn) needs root"
    return None


class SystemdContainer:
    """systemd booted in a container, with `workdir` bound read-write at `WORKDIR_INSIDE` and `read_only` at their own paths."""

    def __init__(self, name: str, workdir: Path, read_only: Sequence[Path]) -> None:
        assert SYSTEMD_NSPAWN is not None and NSENTER is not None
        self.workdir = workdir
        self._log = workdir / "nspawn.log"
        binds = [f"--bind={workdir}:{WORKDIR_INSIDE}"]
        binds += [f"--bind-ro={path}" for path in _outermost(read_only) if not _under(path, Path("/usr"))]
        argv = [
            SYSTEMD_NSPAWN, "--quiet", "--directory=/", "--volatile=yes", f"--machine={name}", "--register=no",
            "--keep-unit", *binds, "--boot", "--", *_BOOT_ARGS,
        ]  # fmt: skip
        with self._log.open("w") as log:
            self._nspawn = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self._init: int | None = None
        try:
            self._wait_booted()
        except BaseException:
            self.close()
            raise

    def _wait_booted(self) -> None:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        state = ""
        while time.monotonic() < deadline:
            if self._nspawn.poll() is not None:
                raise ContainerUnavailable(f"systemd-nspawn exited {self._nspawn.returncode}: {self._log_tail()}")
            if self._init is None:
                children = psutil.Process(self._nspawn.pid).children()
                self._init = children[0].pid if children else None
            if self._init is not None:
                done = self.run(["systemctl", "is-system-running"], check=False, timeout=10)
                state = done.stdout.strip()
                if state in ("running", "degraded"):
                    return
            time.sleep(0.2)
        raise ContainerUnavailable(f"systemd in the container did not finish booting ({state or 'no state'}): {self._log_tail()}")

    def run(self, argv: Sequence[str], *, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside the container (its mounts and processes), as root."""
        assert NSENTER is not None and self._init is not None
        done = subprocess.run(
            [NSENTER, "-t", str(self._init), "-m", "-p", "--", *argv], capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done

    def close(self) -> None:
        """Power the container off (SIGTERM to systemd-nspawn), which then cleans up after it;
        its init killed by pid if it does not go in time."""
        if self._nspawn.poll() is None:
            self._nspawn.terminate()
            try:
                self._nspawn.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                if self._init is not None:
                    try:
                        os.kill(self._init, 9)  # PID 1 of its namespace: every process in it goes too
                    except ProcessLookupError:
                        pass
                self._nspawn.wait(timeout=STOP_TIMEOUT_S)
        self._init = None

    def _log_tail(self) -> str:
        return self._log.read_text(errors="replace")[-1500:] if self._log.exists() else ""

    def __enter__(self) -> SystemdContainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _outermost(paths: Sequence[Path]) -> list[Path]:
    """Existing folders, each once, none inside another (binding the outer one covers it)."""
    found = sorted({p.resolve() for p in paths if p.exists()}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in found:
        if not any(_under(path, outer) for outer in kept):
            kept.append(path)
    return kept
