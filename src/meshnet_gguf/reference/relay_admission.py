"""Who may hold what at the relay: the one place its limits on strangers are decided.

A connection that has proved nothing yet is a stranger's. Strangers get, per source
address, a bucket of tries (a source whose tries keep failing is reset at accept, before
a task or a byte of parsing is spent on it) and a bound on connections still in their
handshake, beside a bound for all sources together. Proving itself (an authorised CONNECT,
an attached tunnel or work connection) gives a connection's try back. A new control
connection is rate-limited per source; a new tunnel must fit under the relay's total and
under the few that may wait, provisional, for a trusted tracker; a node's idle work
connections are bounded. Each refusal is a `RelayRefusal` (its code is what the relay
answers with), logged at most once per interval and kind, so a flood of strangers is not
a flood of log lines.

Limits are keyed by source address here and nowhere else.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from meshnet_gguf.reference.relay_config import RelayConfig

log = logging.getLogger(__name__)

# Source addresses whose rate is remembered; past this, the ones with full buckets are forgotten.
MAX_RATE_LIMITED_PEERS = 100_000
# A refusal logged under a flood: one line per kind per interval, with the count of those held back.
REFUSAL_LOG_INTERVAL_S = 10.0


class RelayRefusal(Exception):
    """The relay says no: `code` and `message` are what it answers (RelayRefused, or an HTTP error body)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class PendingCount:
    """Counts connections that have proved nothing yet, per source address and in all."""

    def __init__(self, per_peer: int, total: int) -> None:
        self.per_peer, self.total = per_peer, total
        self.by_peer: dict[str, int] = {}
        self.count = 0

    def enter(self, peer: str) -> bool:
        if self.count >= self.total or self.by_peer.get(peer, 0) >= self.per_peer:
            return False
        self.count += 1
        self.by_peer[peer] = self.by_peer.get(peer, 0) + 1
        return True

    def leave(self, peer: str) -> None:
        self.count -= 1
        left = self.by_peer[peer] - 1
        if left:
            self.by_peer[peer] = left
        else:
            del self.by_peer[peer]  # the map holds only peers with a connection pending: it cannot grow without bound


@dataclass(eq=False)
class PendingSlot:
    """One connection's place among the pending; given back once, when it has proved itself or ended."""

    pending: PendingCount
    peer: str
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.pending.leave(self.peer)


class RateLimit:
    """A token bucket per source address, with a bounded memory of addresses."""

    def __init__(self, per_s: float, burst: int) -> None:
        self.per_s, self.burst = per_s, burst
        self._buckets: dict[str, tuple[float, float]] = {}

    def allow(self, peer: str) -> bool:
        now = time.monotonic()
        tokens, at = self._buckets.get(peer, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.per_s)
        if tokens < 1:
            self._buckets[peer] = (tokens, now)
            return False
        self._buckets[peer] = (tokens - 1, now)
        if len(self._buckets) > MAX_RATE_LIMITED_PEERS:
            refill_s = self.burst / self.per_s
            self._buckets = {p: (n, a) for p, (n, a) in self._buckets.items() if now - a < refill_s}
        return True

    def give_back(self, peer: str) -> None:
        """Returns the token `allow` took, to a peer whose attempt turned out to be a fair one."""
        bucket = self._buckets.get(peer)
        if bucket is not None:
            self._buckets[peer] = (min(float(self.burst), bucket[0] + 1), bucket[1])


class RefusalLog:
    """Logs refusals of one kind at most once per interval, with the number held back since: a flood of
    strangers must not become a flood of log lines (each costs the event loop the honest splices run on)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def log(self, level: int, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.interval_s) < self.interval_s:
            self._held[kind] += 1
            return
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        if held:
            message += " (and %d more refused so since the last such line)"
            args = (*args, held)
        log.log(level, message, *args)


class RelayAdmission:
    """The relay's limits, applied in the order a connection meets them."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.pending = PendingCount(config.max_pending_per_peer, config.max_pending)
        self.attach_rate = RateLimit(config.tunnel_attaches_per_s, config.tunnel_attach_burst)
        self.stranger_rate = RateLimit(config.stranger_connections_per_s, config.stranger_connection_burst)
        self.refusals = RefusalLog(REFUSAL_LOG_INTERVAL_S)
        self.reset_at_accept = 0

    def may_connect(self, peer: str) -> bool:
        """At accept: False when `peer`'s strangers have spent their tries (the relay then resets the connection)."""
        if self.stranger_rate.allow(peer):
            return True
        self.reset_at_accept += 1
        self.refusals.log(logging.WARNING, "reset_at_accept", "%s: too many connections that proved nothing; reset at accept", peer)
        return False

    def enter_pending(self, peer: str) -> PendingSlot | None:
        """A place among the connections that have proved nothing, or None when `peer` or the relay has none left."""
        return PendingSlot(self.pending, peer) if self.pending.enter(peer) else None

    def connect_proved(self, slot: PendingSlot) -> None:
        """An authorised CONNECT: no longer a stranger's, and its try given back at once (a tracker's long
        streams must not drain its bucket)."""
        slot.release()
        self.stranger_rate.give_back(slot.peer)

    def check_new_control(self, peer: str) -> None:
        """Before a control connection's proof is even checked: new tunnels per source are rate-limited."""
        if not self.attach_rate.allow(peer):
            raise RelayRefusal("rate_limited", f"at most {self.config.tunnel_attaches_per_s:g} new tunnels per second from one address")

    def check_new_tunnel(self, tunnels: int, provisional: int) -> None:
        """A proved node that holds no tunnel yet: under the relay's total, and under the provisional ones."""
        if tunnels >= self.config.max_tunnels:
            raise RelayRefusal("too_many_tunnels", f"this relay holds its limit of {self.config.max_tunnels} tunnels")
        if provisional >= self.config.max_provisional_tunnels:
            raise RelayRefusal("too_many_provisional", "too many tunnels wait for a tracker to admit them; retry later")

    def control_attached(self, slot: PendingSlot) -> None:
        self.stranger_rate.give_back(slot.peer)

    def check_work(self, slot: PendingSlot, idle: int) -> None:
        """A work connection proved by its node's own key: its try given back (a full pool is the node's race,
        not a stranger's try), then the node's idle work connections bounded."""
        self.stranger_rate.give_back(slot.peer)
        if not self.may_park(idle):
            raise RelayRefusal("work_pool_full", f"at most {self.config.max_idle_work} idle work connections per node")

    def may_park(self, idle: int) -> bool:
        return idle < self.config.max_idle_work


__all__ = ["PendingSlot", "RelayAdmission", "RelayRefusal"]
