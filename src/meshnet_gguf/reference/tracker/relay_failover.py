"""Which of a node's relays the tracker dials, and moving to the next when one fails (protocol 9.7).

A node may hold a tunnel at several relays and announce them all (`NodeAnnouncement.relays`). Every
connection the tracker opens to such a node is one CONNECT through one relay; when that CONNECT
fails — the relay refuses the TCP connection, answers 404 (no tunnel there any more), 502/503/504,
closes without an answer, or the node's TLS inside never completes — the tracker dials the next
relay. That is safe because a dial ends before the request's first byte is written: the node saw
nothing, so nothing can be run or billed twice. A request already written on a connection is never
sent again (that is the caller's rule: `Http1Client` retries only a pooled connection that got no
byte back, and it opens the fresh one through this order too).

The order is the announced one, except that the relay that last carried a connection goes first:
after a relay dies, every later dial starts at the one that works instead of paying the dead one's
refusal (or its connect timeout, for a relay that went silent) again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

import anyio

log = logging.getLogger(__name__)

Relay = TypeVar("Relay")
Dialled = TypeVar("Dialled")


class RelayOrder(Generic[Relay]):
    """One node's relays, in the order to try them for the next connection."""

    def __init__(self, relays: Sequence[Relay]) -> None:
        if not relays:
            raise ValueError("a relayed node has at least one relay")
        self.relays: tuple[Relay, ...] = tuple(relays)
        self._preferred = 0  # index of the relay that carried the last connection

    def order(self) -> list[Relay]:
        """The relay that worked last, then the others in the order the node announced them."""
        first = self.relays[self._preferred]
        return [first, *(r for n, r in enumerate(self.relays) if n != self._preferred)]

    def worked(self, relay: Relay) -> None:
        """`relay` carried a connection: dial it first from now on."""
        self._preferred = self.relays.index(relay)


async def dial_in_order(
    relays: RelayOrder[Relay],
    dial: Callable[[Relay], Awaitable[Dialled]],
    failed_before_sending: tuple[type[BaseException], ...],
    *,
    each_timeout_s: float | None = None,
    node_id: str = "",
) -> Dialled:
    """`dial(relay)` through each relay in turn until one works. `failed_before_sending`: the errors a
    dial can end in before any byte of a request left (anything else, cancellation included, is raised
    at once). `each_timeout_s` bounds one relay's try, so a silent relay leaves time for the next.
    When every relay fails, the last failure is raised: the caller reads it as a node that saw nothing."""
    order = relays.order()
    for n, relay in enumerate(order):
        try:
            if each_timeout_s is None:
                connection = await dial(relay)
            else:
                with anyio.fail_after(each_timeout_s):
                    connection = await dial(relay)
        except failed_before_sending as exc:
            if n + 1 == len(order):
                raise
            log.warning(
                "node %s: CONNECT through %s failed (%s: %s); trying %s",
                node_id,
                _name(relay),
                type(exc).__name__,
                exc,
                _name(order[n + 1]),
            )
            continue
        relays.worked(relay)
        return connection
    raise AssertionError("unreachable: a RelayOrder is never empty")


def _name(relay: object) -> str:
    return str(getattr(relay, "url", relay))


__all__ = ["RelayOrder", "dial_in_order"]
