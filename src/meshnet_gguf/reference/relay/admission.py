"""Who may hold what at the relay: the one place its limits on strangers are decided.

A connection that has proved nothing yet is a stranger's. Limits are keyed by source
*network* (an IPv6 /64, an IPv4 prefix: `relay_networks`), never by address, since
anyone with a /64 has more addresses than any per-address limit. Strangers get, per
network, a bucket of tries (a network whose tries keep failing is reset at accept, before
a task or a byte of parsing is spent on it), and all of them together a relay-wide budget of
tries (so a flood from thousands of networks costs the relay a bounded share of its loop;
trackers' networks and admitted nodes' networks never draw on it), and a fair share of the places for connections
still in their handshake: each network holds at most its share, and when all are taken a
newcomer from a network holding fewer takes the heaviest network's oldest place. So a
tracker's CONNECT or a node's attach, which proves itself within a round trip, is never
starved by the half-sent requests of a few networks. Proving itself (an authorised
CONNECT, an attached tunnel or work connection) gives a connection's try back. A new
control connection is rate-limited per network; a new tunnel must fit under the relay's
total and, unless a trusted tracker admitted its node (`relay_admitted`: remembered past
a blip and a restart), among the few that may wait, provisional, shared fairly by network
the same way; a node's idle work connections are bounded. Each refusal is a `RelayRefusal`
(its code is what the relay answers with), logged at most once per interval and kind, so a
flood of strangers is not a flood of log lines.

Limits are keyed by source network here and nowhere else.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from meshnet_gguf.reference.relay.admitted import STATE_FILE_NAME, AdmittedNodes
from meshnet_gguf.reference.relay.config import RelayConfig
from meshnet_gguf.reference.relay.networks import FairShare, network_of

log = logging.getLogger(__name__)

# Source networks whose rate is remembered; past this, the ones with full buckets are forgotten.
MAX_RATE_LIMITED_PEERS = 100_000
# A network that presented a trusted tracker's CONNECT token is trusted this long after its last one.
TRUSTED_NETWORK_S = 600.0
# Trusted networks remembered at most (oldest forgotten first): a relay serves a few trackers.
MAX_TRUSTED_NETWORKS = 1024
# Places for the pending connections of trusted networks, apart from the strangers' (a tracker's burst of
# streams, each proving itself within a round trip); past them, a trusted connection waits among the strangers.
TRUSTED_PENDING_PLACES = 1024
# The key of the relay-wide budget: one bucket for every stranger network together.
ALL_STRANGERS = "*"
# A refusal logged under a flood: one line per kind per interval, with the count of those held back.
REFUSAL_LOG_INTERVAL_S = 10.0


class RelayRefusal(Exception):
    """The relay says no: `code` and `message` are what it answers (RelayRefused, or an HTTP error body)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Evictable(Protocol):
    """What holds a fairly shared place and can be made to give it up (a connection cut, a tunnel closed)."""

    def evict(self) -> None: ...


@dataclass(eq=False)
class PendingSlot:
    """One connection's place among the pending; given back once, when it has proved itself or ended."""

    places: FairShare[Evictable]
    network: str
    peer: str
    on_evict: Callable[[], None]

    def evict(self) -> None:
        self.on_evict()

    def release(self) -> None:
        self.places.leave(self.network, self)


class TrustedNetworks:
    """Networks a trusted tracker's token came from lately: a token only a tracker can sign is the proof."""

    def __init__(self, trusted_for_s: float = TRUSTED_NETWORK_S, max_networks: int = MAX_TRUSTED_NETWORKS) -> None:
        self.trusted_for_s, self.max_networks = trusted_for_s, max_networks
        self._until: dict[str, float] = {}  # network -> when its trust ends, oldest proof first

    def mark(self, network: str) -> None:
        self._until.pop(network, None)
        self._until[network] = time.monotonic() + self.trusted_for_s
        while len(self._until) > self.max_networks:
            del self._until[next(iter(self._until))]

    def __contains__(self, network: str) -> bool:
        until = self._until.get(network)
        if until is None:
            return False
        if until < time.monotonic():
            del self._until[network]
            return False
        return True


class RateLimit:
    """A token bucket per source network, with a bounded memory of networks."""

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

    def remaining(self, peer: str) -> float:
        """The tries `peer` has left now (a full bucket for one never seen)."""
        tokens, at = self._buckets.get(peer, (float(self.burst), time.monotonic()))
        return min(float(self.burst), tokens + (time.monotonic() - at) * self.per_s)

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
        self.pending: FairShare[Evictable] = FairShare(config.max_pending, config.pending_per_network)
        self.trusted = TrustedNetworks()
        self.trusted_pending: FairShare[Evictable] = FairShare(TRUSTED_PENDING_PLACES, TRUSTED_PENDING_PLACES)
        self.provisional: FairShare[Evictable] = FairShare(config.max_provisional_tunnels, config.provisional_per_network)
        self.admitted = AdmittedNodes(Path(config.state_dir) / STATE_FILE_NAME if config.state_dir else None, config.admitted_remembered_s)
        self.attach_rate = RateLimit(config.tunnel_attaches_per_s, config.tunnel_attach_burst)
        self.stranger_rate = RateLimit(config.stranger_connections_per_s, config.stranger_connection_burst)
        self.relay_stranger_rate = RateLimit(config.relay_stranger_connections_per_s, config.relay_stranger_connection_burst)
        self.refusals = RefusalLog(REFUSAL_LOG_INTERVAL_S)
        self.reset_at_accept = 0
        self.evicted = 0

    def network_of(self, peer: str) -> str:
        return network_of(peer, self.config.ipv4_network_prefix)

    def may_connect(self, network: str, peer: str) -> bool:
        """At accept: False when `network`'s strangers have spent their tries, or all strangers together the relay's
        (the relay then resets the connection). A trusted tracker's network meets neither; an admitted node's network
        only its own bucket, whose tries its proved connections give back."""
        if network in self.trusted:
            return True
        if not self.stranger_rate.allow(network):
            return self._reset(peer, network, "too many connections that proved nothing from this network")
        if self.admitted.hosts_admitted(network) or self.relay_stranger_rate.allow(ALL_STRANGERS):
            return True
        self.stranger_rate.give_back(network)  # the relay's budget refused it, not its network's: that try is not spent
        return self._reset(peer, network, "too many connections that proved nothing from all networks")

    def _reset(self, peer: str, network: str, why: str) -> bool:
        self.reset_at_accept += 1
        self.refusals.log(logging.WARNING, "reset_at_accept", "%s (%s): %s; reset at accept", peer, network, why)
        return False

    def enter_pending(self, network: str, peer: str, on_evict: Callable[[], None]) -> PendingSlot | None:
        """A place among the connections that have proved nothing, or None when `network` holds its share or is among
        the heaviest of a full relay. `on_evict` cuts this connection if a lighter network's newcomer needs its place.
        A trusted network's connection takes one of its own places first."""
        if network in self.trusted:
            trusted_slot = PendingSlot(self.trusted_pending, network, peer, on_evict)
            if self.trusted_pending.enter(network, trusted_slot)[0]:
                return trusted_slot
        slot = PendingSlot(self.pending, network, peer, on_evict)
        entered, evicted = self.pending.enter(network, slot)
        if evicted is not None:
            self._evict(evicted, "pending", f"unproved connection from {getattr(evicted, 'peer', '?')} cut for a newcomer from {network}")
        return slot if entered else None

    def connect_proved(self, slot: PendingSlot) -> None:
        """An authorised CONNECT: no longer a stranger's, and its try given back at once (a tracker's long
        streams must not drain its bucket); its network trusted from now on for a while."""
        slot.release()
        self.stranger_rate.give_back(slot.network)
        self.trusted.mark(slot.network)

    def check_new_control(self, network: str) -> None:
        """Before a control connection's proof is even checked: new tunnels per source network are rate-limited."""
        if not self.attach_rate.allow(network):
            raise RelayRefusal("rate_limited", f"at most {self.config.tunnel_attaches_per_s:g} new tunnels per second from one network")

    def check_new_tunnel(self, tunnels: int) -> None:
        """A proved node that holds no tunnel yet: under the relay's total."""
        if tunnels >= self.config.max_tunnels:
            raise RelayRefusal("too_many_tunnels", f"this relay holds its limit of {self.config.max_tunnels} tunnels")

    def enter_provisional(self, network: str, tunnel: Evictable) -> None:
        """A tunnel whose node no trusted tracker has admitted takes a place among the provisional, fairly by network."""
        entered, evicted = self.provisional.enter(network, tunnel)
        if evicted is not None:
            self._evict(evicted, "provisional", f"provisional tunnel closed for a newcomer from {network}")
        if not entered:
            raise RelayRefusal("too_many_provisional", "too many tunnels from your network wait for a tracker to admit them; retry later")

    def leave_provisional(self, network: str, tunnel: Evictable) -> None:
        self.provisional.leave(network, tunnel)

    def _evict(self, holder: Evictable, kind: str, message: str) -> None:
        self.evicted += 1
        self.refusals.log(logging.INFO, f"evicted_{kind}", "%s", message)
        holder.evict()

    def control_attached(self, slot: PendingSlot) -> None:
        self.stranger_rate.give_back(slot.network)

    def check_work(self, slot: PendingSlot, idle: int) -> None:
        """A work connection proved by its node's own key: its try given back (a full pool is the node's race,
        not a stranger's try), then the node's idle work connections bounded."""
        self.stranger_rate.give_back(slot.network)
        if not self.may_park(idle):
            raise RelayRefusal("work_pool_full", f"at most {self.config.max_idle_work} idle work connections per node")

    def may_park(self, idle: int) -> bool:
        return idle < self.config.max_idle_work


__all__ = ["Evictable", "PendingSlot", "RelayAdmission", "RelayRefusal", "TrustedNetworks"]
