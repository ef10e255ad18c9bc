"""How both ends of a relay tunnel notice that the other has gone silent: TCP keep-alive and a user
timeout on the sockets that matter (docs/protocol.md 9.6).

A home router or a carrier-grade NAT that forgets a mapping (a reboot, its idle timer, `conntrack -F`)
drops that connection's packets from then on without a word to either end. A socket that only waits to
read then waits forever: measured behind a real MASQUERADE router, a node's idle tunnel took 15-23 s to
come back (the relay's ping interval plus its timeout), and a stream cut mid-way left the tracker's
client with no byte and no error for minutes (the relay read the node's side, which would never speak
again). So:

- **keep-alive**: a connection that has received nothing for `KEEPALIVE_IDLE_S` is probed every
  `KEEPALIVE_INTERVAL_S`; with no answer for `USER_TIMEOUT_S` the kernel ends it. The probes are
  answered by the peer's kernel, so a long prefill with no bytes never trips it, and they cost no
  wake-up of the event loop on either side.
- **user timeout**: data written and not acknowledged for `USER_TIMEOUT_S` ends the connection too (a
  sender's retransmissions would otherwise go on for ~15 minutes, `tcp_retries2`, holding a llama-server
  slot for a stream nobody receives).

So a silent drop is noticed within `NOTICED_WITHIN_S` (probed at most `KEEPALIVE_IDLE_S` after it, or a
ping sent just before that, unacknowledged for `USER_TIMEOUT_S`): under the ping interval (10 s), where
the pings alone took interval + timeout (20 s). On a lossy link: the probes fail only when three in a row
or their answers are lost (about once in 10^5 idle periods at 1 % loss each way); data survives four
retransmissions of an 80 ms link in 6 s. Set by the node on its control connection and on a work
connection once a stream uses it, and by the relay on a control connection and on both sides of a
splice.

An **idle work connection** carries nothing for up to an hour, so a NAT with a short idle timer forgets it
and the relay then splices a tracker to a dead connection (seen behind a router that forgets idle mappings
after 20 s: the next request waited 5 s for a TLS handshake that never came, then failed). The node probes
its idle work connections every `IDLE_WORK_KEEPALIVE_S`, which keeps their mappings alive; their death is
not urgent (the control connection's death ends them all), so the pace is gentler, and the relay, which
holds thousands of them, probes none: its kernel only answers.
"""

from __future__ import annotations

import socket
from typing import Protocol

# A connection that has received nothing for this long is probed. Well under the ping interval (10 s), so
# an idle control connection is probed between pings, and far under any NAT's idle timeout (30 s or more).
KEEPALIVE_IDLE_S = 3
# Between unanswered probes: ten round trips of a slow home link.
KEEPALIVE_INTERVAL_S = 1
# Unanswered probes before the kernel gives up (the user timeout below decides first on Linux): one lost
# probe, or its answer, is not death.
KEEPALIVE_PROBES = 3
# No answer to probes, or data unacknowledged, for this long ends a tunnel connection.
USER_TIMEOUT_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES
# The longest a silent drop goes unnoticed: the next probe, or a ping sent just before it, then the timeout.
NOTICED_WITHIN_S = KEEPALIVE_IDLE_S + USER_TIMEOUT_S
# An idle work connection is probed after this long without a byte: half the shortest NAT idle timer we
# serve behind (30 s, some carrier NATs), so a probe always comes before the mapping is forgotten.
IDLE_WORK_KEEPALIVE_S = 15


class _SetsOptions(Protocol):
    """A socket, or asyncio's `TransportSocket` wrapper of one."""

    def setsockopt(self, level: int, option: int, value: int, /) -> None: ...


def keep_alive(sock: _SetsOptions | None, idle_s: int = KEEPALIVE_IDLE_S) -> None:
    """Make `sock` notice a silent peer within NOTICED_WITHIN_S (probed after `idle_s` of silence); options the
    platform lacks are skipped. Called again with another `idle_s`, it changes the pace."""
    if sock is None:
        return
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (
        ("TCP_KEEPIDLE", idle_s),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_S * 1000),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            options.append((socket.IPPROTO_TCP, option, value))
    for level, option, value in options:
        try:
            sock.setsockopt(level, option, value)
        except OSError:
            pass  # a socket already closed, or an option this kernel refuses: the pings still bound the tunnel


__all__ = [
    "IDLE_WORK_KEEPALIVE_S",
    "NOTICED_WITHIN_S",
    "KEEPALIVE_IDLE_S",
    "KEEPALIVE_INTERVAL_S",
    "KEEPALIVE_PROBES",
    "USER_TIMEOUT_S",
    "keep_alive",
]
