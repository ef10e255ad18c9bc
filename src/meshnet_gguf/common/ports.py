"""Loopback ports for private listeners (llama-server, probes)."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_local_port() -> int:
    """A port free on 127.0.0.1 right now (the kernel's pick; the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def local_port_taken(port: int) -> bool:
    """Whether something already listens on 127.0.0.1:`port` (a bind would fail)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return True
    return False


def free_local_port_pair() -> int:
    """A free loopback port whose successor is free too (a pool worker's status endpoint is its RPC port + 1)."""
    while True:
        port = free_local_port()
        if not local_port_taken(port + 1):
            return port
