#!/usr/bin/env python3
"""A network link with latency, loss and reordering, in user space: `tc netem` for kernels without it.

    python netem_wire.py NS_A IF_A NS_B IF_B

Creates one TUN device in each network namespace (`NS_A`, `NS_B`: names under /run/netns, or "-" for
the namespace this process started in) and carries every IP packet from one to the other, through a
delay line: each packet is held `delay_ms` (plus up to `jitter_ms` more), dropped with probability
`loss`, or with probability `reorder` sent at once, overtaking the packets held before it (what netem's
`reorder` does). The same settings apply in both directions, so `delay_ms` 40 is 80 ms of round trip.

The kernel this project's machines run has no `sch_netem` (CONFIG_NET_SCH_NETEM is not set), so
`tc qdisc add ... netem` answers "Specified qdisc kind is unknown"; TUN is built in. TCP on either side
sees what it would see on a lossy, slow link: its own retransmissions, RTO and reordering.

Prints `ready` once both devices exist (the caller then gives them addresses). Reads settings as JSON
lines on stdin, e.g. `{"delay_ms": 40, "jitter_ms": 0, "loss": 0.01, "reorder": 0.02}`; unknown keys are
refused on stderr. The devices are not persistent: they vanish when this process ends, however it ends.
Standard library only, so it starts at once and never waits on the caller's imports.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import json
import os
import random
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
# An IP packet on these links is at most the TUN's MTU (1,500); a read of 64 KiB takes any.
READ_BYTES = 65536
# Packets read from one device per wake-up, so one busy direction cannot starve the other.
READS_PER_WAKE = 64
# Packets held in the delay line at most (both directions); beyond it a packet is dropped, as a
# router's full queue does. 40 ms of a fast stream is a few hundred packets.
MAX_HELD = 20_000
# The longest the loop sleeps with nothing due, so a closed stdin (the parent gone) is seen promptly.
IDLE_WAKE_S = 0.5
SETTING_KEYS = {"delay_ms", "jitter_ms", "loss", "reorder"}


def open_tun(namespace: str, name: str, home_ns: int) -> int:
    """A TUN device `name` created in `namespace`; this thread returns to `home_ns` afterwards."""
    libc = ctypes.CDLL(None, use_errno=True)
    if namespace != "-":
        ns_fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
        try:
            if libc.setns(ns_fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {namespace}")
        finally:
            os.close(ns_fd)
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    finally:
        if libc.setns(home_ns, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back")
    return fd


class Wire:
    def __init__(self, a: int, b: int) -> None:
        self.fds = (a, b)
        self.delay_s = 0.0
        self.jitter_s = 0.0
        self.loss = 0.0
        self.reorder = 0.0
        self.held: list[tuple[float, int, int, bytes]] = []  # (due, order, to_fd, packet)
        self.order = 0
        self.rng = random.Random()

    def configure(self, settings: dict[str, float]) -> None:
        unknown = set(settings) - SETTING_KEYS
        if unknown:
            print(f"netem_wire: unknown settings {sorted(unknown)}", file=sys.stderr, flush=True)
            return
        self.delay_s = float(settings.get("delay_ms", self.delay_s * 1000)) / 1000
        self.jitter_s = float(settings.get("jitter_ms", self.jitter_s * 1000)) / 1000
        self.loss = float(settings.get("loss", self.loss))
        self.reorder = float(settings.get("reorder", self.reorder))

    def take(self, packet: bytes, to_fd: int, now: float) -> None:
        if self.loss and self.rng.random() < self.loss:
            return
        if len(self.held) >= MAX_HELD:
            return
        if self.reorder and self.rng.random() < self.reorder:
            due = now
        else:
            due = now + self.delay_s + (self.rng.random() * self.jitter_s if self.jitter_s else 0.0)
        self.order += 1
        heapq.heappush(self.held, (due, self.order, to_fd, packet))

    def send_due(self, now: float) -> None:
        while self.held and self.held[0][0] <= now:
            _, _, to_fd, packet = heapq.heappop(self.held)
            try:
                os.write(to_fd, packet)
            except OSError:
                pass  # the device is down or full: the packet is lost, as on a wire

    def run(self) -> None:
        a, b = self.fds
        stdin = sys.stdin.fileno()
        pending = b""
        while True:
            now = time.monotonic()
            self.send_due(now)
            timeout = IDLE_WAKE_S if not self.held else max(0.0, min(IDLE_WAKE_S, self.held[0][0] - now))
            readable, _, _ = select.select([a, b, stdin], [], [], timeout)
            now = time.monotonic()
            for fd in readable:
                if fd == stdin:
                    chunk = os.read(stdin, 4096)
                    if not chunk:
                        return  # the parent is gone: the devices go with this process
                    pending += chunk
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        if line.strip():
                            self.configure(json.loads(line))
                    continue
                to_fd = b if fd == a else a
                for _ in range(READS_PER_WAKE):
                    try:
                        packet = os.read(fd, READ_BYTES)
                    except BlockingIOError:
                        break
                    self.take(packet, to_fd, now)


def main(argv: list[str]) -> int:
    ns_a, if_a, ns_b, if_b = argv
    home_ns = os.open("/proc/self/ns/net", os.O_RDONLY)
    wire = Wire(open_tun(ns_a, if_a, home_ns), open_tun(ns_b, if_b, home_ns))
    print("ready", flush=True)
    wire.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
