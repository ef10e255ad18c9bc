"""The systemd notify protocol (sd_notify(3)) over `NOTIFY_SOCKET`, without libsystemd.

A `Type=notify` unit is "started" only when the main process sends `READY=1`,
so systemd (and anything ordered after the node) learns the truth about
readiness instead of guessing from the fork. Outside systemd every call is a
cheap no-op, so callers never need to ask whether they run under it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager

log = logging.getLogger(__name__)

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"
_ENV_VARS = (NOTIFY_SOCKET_ENV, WATCHDOG_USEC_ENV, WATCHDOG_PID_ENV)

# systemd drains its notify socket promptly; if it ever does not, a bounded
# wait keeps a stuck manager from freezing the node's event loop.
SEND_TIMEOUT_S = 1.0
# While a long step runs before the node's loop exists (a first download of a
# 100 GB model), the start timeout is pushed out this far, this often.
PREPARE_EXTEND_S = 15 * 60
PREPARE_EXTEND_EVERY_S = 60.0
# sd_watchdog_enabled(3) recommends pinging at half the interval, so one late
# tick never trips the watchdog.
WATCHDOG_PING_FRACTION = 0.5


def watchdog_interval(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds within which systemd expects `WATCHDOG=1`, or None when no watchdog applies to us.

    Mirrors sd_watchdog_enabled(3): `WATCHDOG_USEC` is the interval, and when
    `WATCHDOG_PID` is set the watchdog is meant only for that process.
    """
    env = os.environ if environ is None else environ
    usec = env.get(WATCHDOG_USEC_ENV)
    if not usec:
        return None
    owner = env.get(WATCHDOG_PID_ENV)
    if owner:
        try:
            if int(owner) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1_000_000 if value > 0 else None


def _socket_address(raw: str) -> str | bytes | None:
    if raw.startswith("@"):
        # Abstract namespace: the kernel address starts with a NUL byte, not "@".
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    return None  # vsock and other forms: not used by a local systemd service


class SystemdNotifier:
    """Sends notify messages to systemd; silently does nothing when not started by it."""

    def __init__(self, socket_path: str | None = None) -> None:
        self._address = _socket_address(socket_path) if socket_path else None
        self._socket: socket.socket | None = None

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str] | None = None, *, unset: bool = False) -> SystemdNotifier:
        """Read `NOTIFY_SOCKET`; with `unset`, remove the notify variables so child processes
        (llama-server) do not inherit them and cannot speak for the node."""
        env = os.environ if environ is None else environ
        notifier = cls(env.get(NOTIFY_SOCKET_ENV))
        if unset:
            for name in _ENV_VARS:
                env.pop(name, None)
        return notifier

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Send `KEY=VALUE` lines as one datagram. Returns whether systemd got it."""
        if self._address is None or not assignments:
            return False
        message = "\n".join(assignments).encode()
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._socket.settimeout(SEND_TIMEOUT_S)
            self._socket.sendto(message, self._address)
        except OSError as exc:
            # Losing one STATUS line must not take the node down: log it and carry on.
            log.warning("systemd notify failed (%s): %s", assignments[0], exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *_status(status))

    def status(self, text: str) -> bool:
        return self.notify(*_status(text))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *_status(status))

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for `seconds` more of start (or stop) time: used while a big model is still
        making progress, so `TimeoutStartSec` catches a stuck start but not a slow one."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    @contextmanager
    def extending_start(
        self, status: str, *, extend_s: float = PREPARE_EXTEND_S, every_s: float = PREPARE_EXTEND_EVERY_S
    ) -> Iterator[None]:
        """Keep `TimeoutStartSec` from ending a long synchronous step (model download and
        checks) while it runs. That step bounds itself (the downloader gives up on a
        stalled transfer), so this timer cannot keep a stuck start alive forever."""
        if not self.enabled:
            yield
            return
        done = threading.Event()

        def extend() -> None:
            while True:
                self.notify(f"EXTEND_TIMEOUT_USEC={int(extend_s * 1_000_000)}", *_status(status))
                if done.wait(every_s):
                    return

        worker = threading.Thread(target=extend, name="systemd-start-extender", daemon=True)
        worker.start()
        try:
            yield
        finally:
            done.set()
            worker.join()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _status(text: str | None) -> tuple[str, ...]:
    if not text:
        return ()
    # The protocol is newline-separated assignments; a newline would start a bogus one.
    return ("STATUS=" + " ".join(text.splitlines()),)
