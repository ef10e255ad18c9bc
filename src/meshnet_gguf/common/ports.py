"""Loopback ports for private listeners (llama-server, probes)."""

from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"
LOOPBACK_IPV6 = "::1"


def is_wildcard(host: str) -> bool:
    """Whether a listener on `host` listens on every address: "", 0.0.0.0, :: or any spelling of them,
    an IPv4-mapped one (::ffff:0.0.0.0) included. A name is no wildcard."""
    return wildcard_loopback(host) is not None


def wildcard_loopback(host: str) -> str | None:
    """The loopback address that reaches a listener on the wildcard `host` (127.0.0.1, or ::1 for an IPv6-only
    one), or None when `host` is no wildcard."""
    if host == "":
        return LOOPBACK
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:0.0.0.0 listens as the IPv4 wildcard does
    if not address.is_unspecified:
        return None
    return LOOPBACK if address.version == 4 else LOOPBACK_IPV6


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
