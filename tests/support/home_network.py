"""A volunteer's home network in namespaces: a node behind a router's NAT, on a slow, lossy link.

    home ns (the node)  ==wire==  router ns (MASQUERADE, strict conntrack)  --veth--  this namespace
                                                                                     (tracker, relay)
    client ns (a user)  ==wire==  this namespace

- The **router** masquerades the home network behind its one WAN address and forgets a mapping as a
  home router or a carrier NAT does: `flush_nat()` (`conntrack -F`, as after a router reboot), or an
  established TCP mapping idle past `nat_idle_timeout_s`. Its conntrack is strict
  (`nf_conntrack_tcp_loose=0`) and it drops packets of no mapping (ctstate INVALID) in both
  directions, without a reset: neither end hears that its connection is gone.
- Each **wire** (`netem_wire.py`, a TUN pair) holds the link's packets for a delay, drops some and
  reorders some; `set(delay_ms=40, loss=0.01, reorder=0.02)` changes it at run time.
- The tracker and relay listen on `host_ip`, this namespace's end of the WAN veth. The router's WAN
  address is what they see of every home connection.

Every name (namespaces, interfaces) carries this process's pid and a random tag; `close()` removes
exactly those, and ends the wires by PID. Needs root, `ip`, `iptables` and `conntrack`
(`HomeNetwork.missing()` says what is absent, for a skip).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

WIRE_SCRIPT = Path(__file__).with_name("netem_wire.py")
# Each `ip`/`iptables`/`conntrack` call: they return in milliseconds; a hung one fails the setup.
COMMAND_TIMEOUT_S = 10.0
# How long the wire gets to create its devices (a fresh interpreter, no imports beyond the stdlib).
WIRE_START_S = 10.0
CLONE_NEWNET = 0x40000000


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(list(argv), check=check, capture_output=True, timeout=COMMAND_TIMEOUT_S)


class Wire:
    """One emulated link between two namespaces; settings apply to both directions."""

    def __init__(self, ns_a: str, if_a: str, ns_b: str, if_b: str, log: Path) -> None:
        self.ns_a, self.if_a, self.ns_b, self.if_b = ns_a, if_a, ns_b, if_b
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(WIRE_SCRIPT), ns_a, if_a, ns_b, if_b],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], WIRE_START_S)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.close()
            raise RuntimeError(f"netem wire did not start: {line!r}; see {log}")
        self.settings: dict[str, float] = {"delay_ms": 0, "jitter_ms": 0, "loss": 0, "reorder": 0}

    def set(self, **settings: float) -> None:
        """delay_ms (each way), jitter_ms, loss (0..1), reorder (0..1): the keys given change, others stay."""
        assert self.proc.stdin is not None
        self.settings.update(settings)
        self.proc.stdin.write(json.dumps(settings).encode() + b"\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # by PID; its TUN devices vanish with it
        self.proc.wait(COMMAND_TIMEOUT_S)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._log.close()


class HomeNetwork:
    def __init__(self, workdir: Path, *, nat_idle_timeout_s: int | None = None) -> None:
        tag = uuid.uuid4().hex[:6]
        base = f"hn-{os.getpid()}-{tag}"
        self.home, self.router, self.client = f"{base}-home", f"{base}-rtr", f"{base}-cli"
        self._wan_host, self._wan_router = f"hw{tag}h", f"hw{tag}r"
        self._home_if, self._home_router_if = f"hh{tag}a", f"hh{tag}r"
        self._client_if, self._client_host_if = f"hc{tag}a", f"hc{tag}h"
        net = self._free_prefix()
        self.host_ip, self.router_wan_ip = f"{net}.1", f"{net}.2"
        self._router_home_ip, self.home_ip = f"{net}.5", f"{net}.6"
        self._host_client_ip, self.client_ip = f"{net}.9", f"{net}.10"
        self._made_ns: list[str] = []
        self._made_links: list[str] = []
        self.wires: list[Wire] = []
        try:
            self._build(workdir, nat_idle_timeout_s)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def missing() -> str | None:
        """Why this machine cannot build it, or None."""
        if os.geteuid() != 0:
            return "network namespaces and NAT need root (CI runs as root)"
        for tool in ("ip", "iptables", "conntrack"):
            if shutil.which(tool) is None:
                return f"`{tool}` is not installed (Debian: iproute2, iptables, conntrack; .ci/run installs them)"
        if not os.path.exists("/dev/net/tun"):
            return "/dev/net/tun is absent: the emulated links need TUN"
        return None

    @staticmethod
    def _free_prefix() -> str:
        """A 10.x.y.0/28 no address of this namespace is in (16 addresses: three /30 links)."""
        taken = _run("ip", "-o", "-4", "addr").stdout.decode()
        for _ in range(64):
            net = f"10.{random.randrange(16, 250)}.{random.randrange(0, 16) * 16}"
            if f" {net}." not in taken:
                return net
        raise RuntimeError("no free 10.x.y.0/28 found")

    def _build(self, workdir: Path, nat_idle_timeout_s: int | None) -> None:
        for ns in (self.home, self.router, self.client):
            _run("ip", "netns", "add", ns)
            self._made_ns.append(ns)
            self.ns_run(ns, "ip", "link", "set", "lo", "up")
        # WAN: this namespace <-> the router, a plain veth (the far side is "the internet").
        _run("ip", "link", "add", self._wan_host, "type", "veth", "peer", "name", self._wan_router)
        self._made_links.append(self._wan_host)
        _run("ip", "link", "set", self._wan_router, "netns", self.router)
        _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self._wan_host)
        _run("ip", "link", "set", self._wan_host, "up")
        self.ns_run(self.router, "ip", "addr", "add", f"{self.router_wan_ip}/30", "dev", self._wan_router)
        self.ns_run(self.router, "ip", "link", "set", self._wan_router, "up")
        self.ns_run(self.router, "ip", "route", "add", "default", "via", self.host_ip)
        # The home link and the client's: emulated wires.
        self.node_link = Wire(self.home, self._home_if, self.router, self._home_router_if, workdir / "wire-home.log")
        self.wires.append(self.node_link)
        self.ns_run(self.router, "ip", "addr", "add", f"{self._router_home_ip}/30", "dev", self._home_router_if)
        self.ns_run(self.router, "ip", "link", "set", self._home_router_if, "up")
        self.ns_run(self.home, "ip", "addr", "add", f"{self.home_ip}/30", "dev", self._home_if)
        self.ns_run(self.home, "ip", "link", "set", self._home_if, "up")
        self.ns_run(self.home, "ip", "route", "add", "default", "via", self._router_home_ip)
        self.client_link = Wire(self.client, self._client_if, "-", self._client_host_if, workdir / "wire-client.log")
        self.wires.append(self.client_link)
        _run("ip", "addr", "add", f"{self._host_client_ip}/30", "dev", self._client_host_if)
        _run("ip", "link", "set", self._client_host_if, "up")
        self.ns_run(self.client, "ip", "addr", "add", f"{self.client_ip}/30", "dev", self._client_if)
        self.ns_run(self.client, "ip", "link", "set", self._client_if, "up")
        self.ns_run(self.client, "ip", "route", "add", "default", "via", self._host_client_ip)
        # The router: forward, masquerade out of the WAN, and drop what belongs to no mapping, silently.
        r = self.router
        self.ns_run(r, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self.ns_run(r, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_loose=0")
        self.ns_run(r, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", self._wan_router, "-j", "MASQUERADE")
        for chain in ("FORWARD", "INPUT"):
            self.ns_run(r, "iptables", "-A", chain, "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP")
        # Nothing from the WAN may open a connection into the home network (a NAT's one-way door).
        self.ns_run(r, "iptables", "-A", "FORWARD", "-i", self._wan_router, "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP")
        if nat_idle_timeout_s is not None:
            self.set_nat_idle_timeout(nat_idle_timeout_s)

    # --- what tests do with it ------------------------------------------------------------------------
    def ns_run(self, ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return _run("ip", "netns", "exec", ns, *argv, check=check)

    def exec_prefix(self, ns: str) -> list[str]:
        """The argv prefix that runs a command in `ns` (`ip netns exec` execs it: its PID is the command's)."""
        return ["ip", "netns", "exec", ns]

    def flush_nat(self) -> None:
        """Forget every mapping at once, as a router reboot or a carrier NAT's sweep does."""
        self.ns_run(self.router, "conntrack", "-F", check=False)  # exits 1 when there was nothing to flush

    def nat_mappings(self) -> int:
        out = self.ns_run(self.router, "conntrack", "-L", check=False).stdout.decode()
        return sum(1 for line in out.splitlines() if line.startswith(("tcp", "udp")))

    def set_nat_idle_timeout(self, seconds: int) -> None:
        """How long the router keeps an established TCP mapping that carries nothing (its namespace only)."""
        self.ns_run(self.router, "sysctl", "-qw", f"net.netfilter.nf_conntrack_tcp_timeout_established={seconds}")

    def in_client_namespace(self) -> contextlib.AbstractContextManager[None]:
        """Run this thread in the client's namespace: sockets it opens are on the client's wire."""
        return self.in_namespace(self.client)

    def in_namespace(self, ns: str) -> contextlib.AbstractContextManager[None]:
        """Run this thread (only) in `ns` until the block ends; sockets opened meanwhile stay there."""
        return _thread_in_namespace(ns)

    def close(self) -> None:
        for wire in self.wires:
            with contextlib.suppress(Exception):
                wire.close()
        for link in self._made_links:
            _run("ip", "link", "del", link, check=False)
        for ns in self._made_ns:
            _run("ip", "netns", "del", ns, check=False)


@contextlib.contextmanager
def _thread_in_namespace(ns: str) -> Iterator[None]:
    """setns(2) for the calling thread only (Python 3.11 has no os.setns), and back afterwards."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {ns}")
        try:
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(target)
        os.close(home)
