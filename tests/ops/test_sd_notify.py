"""The notify protocol against a real AF_UNIX datagram socket, as systemd would hold it."""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnet_gguf.ops.sd_notify import SystemdNotifier, watchdog_interval


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = tmp_path / "notify.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    server.settimeout(2)
    yield server, str(path)
    server.close()


def _receive(server: socket.socket) -> list[str]:
    return server.recv(4096).decode().split("\n")


def test_ready_status_watchdog_stopping_arrive_as_datagrams(notify_socket: tuple[socket.socket, str]) -> None:
    server, path = notify_socket
    notifier = SystemdNotifier(path)
    assert notifier.enabled

    assert notifier.status("loading model 40%")
    assert _receive(server) == ["STATUS=loading model 40%"]
    assert notifier.ready("serving tiny-llama")
    assert _receive(server) == ["READY=1", "STATUS=serving tiny-llama"]
    assert notifier.watchdog()
    assert _receive(server) == ["WATCHDOG=1"]
    assert notifier.extend_timeout(90)
    assert _receive(server) == ["EXTEND_TIMEOUT_USEC=90000000"]
    assert notifier.stopping("draining 3 requests")
    assert _receive(server) == ["STOPPING=1", "STATUS=draining 3 requests"]
    notifier.close()


def test_status_with_newlines_cannot_inject_assignments(notify_socket: tuple[socket.socket, str]) -> None:
    server, path = notify_socket
    notifier = SystemdNotifier(path)
    notifier.status("line one\nREADY=1")
    assert _receive(server) == ["STATUS=line one READY=1"]
    notifier.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux-only")
def test_abstract_namespace_socket() -> None:
    name = f"meshnet-test-{uuid.uuid4().hex}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(b"\0" + name.encode())
    server.settimeout(2)
    try:
        notifier = SystemdNotifier(f"@{name}")
        assert notifier.ready()
        assert _receive(server) == ["READY=1"]
        notifier.close()
    finally:
        server.close()


def test_no_op_outside_systemd() -> None:
    notifier = SystemdNotifier.from_environment({})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.watchdog() is False


def test_missing_socket_is_reported_not_raised(tmp_path: Path) -> None:
    notifier = SystemdNotifier(str(tmp_path / "gone.sock"))
    assert notifier.enabled
    assert notifier.ready() is False


def test_from_environment_can_hide_the_socket_from_children(notify_socket: tuple[socket.socket, str]) -> None:
    server, path = notify_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1", "OTHER": "x"}
    notifier = SystemdNotifier.from_environment(env, unset=True)
    assert env == {"OTHER": "x"}
    assert notifier.ready()
    assert _receive(server) == ["READY=1"]
    notifier.close()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "me"}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval(env) == expected
