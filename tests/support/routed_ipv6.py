"""A whole IPv6 /64 for an attacker, on this machine: a network namespace joined to the host by a veth pair,
with a /64 routed into it, so that one process can open connections from any of its 2^64 addresses.

The host side of the veth has `<net>:1::1/64` (where the relay listens); the namespace has `<net>:1::2` and
every address of `<net>:2::/64` (nonlocal bind on, so no address needs adding). Sockets are made in the
namespace by one short-lived thread that enters it (a network namespace is per thread on Linux) and leaves
again; a socket keeps the namespace it was made in. Needs root and iproute2; everything is deleted after.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

CLONE_NEWNET = 0x40000000
IP_TIMEOUT_S = 10
T = TypeVar("T")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=IP_TIMEOUT_S)


@dataclass(frozen=True)
class RoutedSlash64:
    namespace: str
    host_address: str  # on the host's end of the veth: where a relay listens for the namespace to reach it
    attacker_prefix: str  # `<net>:2::`: append a hex suffix for an address of the routed /64

    def address(self, i: int) -> str:
        return f"{self.attacker_prefix}{i:x}"

    def run_inside(self, work: Callable[[], T]) -> T:
        """`work()` on a thread inside the namespace (sockets it makes live there); its result or its exception."""
        libc = ctypes.CDLL(None, use_errno=True)
        result: list[T] = []
        failure: list[BaseException] = []

        def inside() -> None:
            home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            target = os.open(f"/run/netns/{self.namespace}", os.O_RDONLY)
            try:
                if libc.setns(target, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns into the test namespace")
                try:
                    result.append(work())
                finally:
                    if libc.setns(home, CLONE_NEWNET) != 0:  # never leave a thread behind in the namespace
                        raise OSError(ctypes.get_errno(), "setns back home")
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                failure.append(exc)
            finally:
                os.close(home)
                os.close(target)

        thread = threading.Thread(target=inside)
        thread.start()
        thread.join()
        if failure:
            raise failure[0]
        return result[0]

    def connect_from(self, sources: list[str], port: int) -> list[socket.socket]:
        """A connected TCP socket to the host side, port `port`, from each address in `sources` (blocking sockets);
        a connection the far side resets before `connect` returns (a relay resetting at accept a network out of
        tries, on a loaded box) is left out."""

        def connect_all() -> list[socket.socket]:
            opened = []
            for source in sources:
                sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
                sock.settimeout(5)
                sock.bind((source, 0))
                try:
                    sock.connect((self.host_address, port))
                except (ConnectionResetError, ConnectionRefusedError):
                    sock.close()
                    continue
                opened.append(sock)
            return opened

        return self.run_inside(connect_all)


@contextlib.contextmanager
def routed_slash64() -> Iterator[RoutedSlash64]:
    """Builds the namespace and routes; raises `RuntimeError` with why when this machine cannot."""
    if shutil.which("ip") is None:
        raise RuntimeError("`ip` (iproute2) is not installed: cannot build a network namespace")
    if os.geteuid() != 0:
        raise RuntimeError("network namespaces need root (CI runs as root); not root here")
    tag = uuid.uuid4().hex[:6]
    name = f"relay-v6-{os.getpid()}-{tag}"
    host_if, ns_if = f"r6{tag}h", f"r6{tag}n"
    net = f"fd{random.randrange(0, 256):02x}:{random.randrange(0, 65536):x}:{random.randrange(0, 65536):x}"  # a random ULA /48
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        raise RuntimeError(f"`ip netns add` is not available here: {getattr(exc, 'stderr', b'') or exc!r}") from None
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{net}:1::1/64", "dev", host_if, "nodad")
        _ip("link", "set", host_if, "up")
        _ip("-n", name, "addr", "add", f"{net}:1::2/64", "dev", ns_if, "nodad")
        _ip("-n", name, "link", "set", ns_if, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", name, "-6", "route", "add", "local", f"{net}:2::/64", "dev", "lo")
        _ip("-6", "route", "add", f"{net}:2::/64", "via", f"{net}:1::2", "dev", host_if)
        subprocess.run(["ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv6.ip_nonlocal_bind=1"], check=True,
                       capture_output=True, timeout=IP_TIMEOUT_S)  # fmt: skip
        yield RoutedSlash64(name, f"{net}:1::1", f"{net}:2::")
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=IP_TIMEOUT_S)  # takes its route along
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=IP_TIMEOUT_S)
