"""Which network a source address belongs to, and places shared fairly among networks.

A stranger's limits are keyed by network, not by address: anyone with an IPv6 /64 (what
one home or one cloud machine is given) has 2^64 addresses, so a limit per address is
no limit. IPv6 sources count per /64; IPv4 sources per a configurable prefix (/32 by
default: one NAT, one address; /24 where a hosting range is one operator). An IPv4
address mapped into IPv6 (`::ffff:a.b.c.d`, what a dual-stack listener reports for an
IPv4 peer) is the IPv4 address it maps.

`FairShare` holds a bounded number of places (connections that proved nothing, tunnels
waiting for a tracker): each network holds at most its share, and when every place is
taken a newcomer from a network that holds fewer than the heaviest takes that network's
oldest place. Honest peers prove themselves within a round trip, so the oldest place is
almost always a stranger's; and locking a newcomer out needs every place held by a
different network, i.e. as many networks as places.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Hashable
from typing import Generic, TypeVar

# One site's IPv6 allocation: the smallest block an ISP or a cloud gives one customer.
IPV6_NETWORK_PREFIX = 64
# IPv4 sources: one address is one network unless the operator says otherwise (e.g. /24 for hosting ranges).
DEFAULT_IPV4_NETWORK_PREFIX = 32
# Prefixes an operator may choose for IPv4: /16 would put a whole provider's customers in one network.
IPV4_NETWORK_PREFIXES = (32, 24)
# Addresses whose network is remembered: parsing one is most of what a reset at accept costs, and a flood's sources
# come back again and again. Bounded, least recently used first out.
NETWORK_CACHE_SIZE = 65_536

Holder = TypeVar("Holder", bound=Hashable)


@functools.lru_cache(maxsize=NETWORK_CACHE_SIZE)
def network_of(address: str, ipv4_prefix: int = DEFAULT_IPV4_NETWORK_PREFIX) -> str:
    """The network `address` counts in, as `a.b.c.d/p` or `x:y::/64`; an unparsable address is its own network."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # a scope id (fe80::1%eth0) names the link, not the host
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    prefix = ipv4_prefix if isinstance(ip, ipaddress.IPv4Address) else IPV6_NETWORK_PREFIX
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


class FairShare(Generic[Holder]):
    """At most `total` places, at most `per_network` of them per network; the heaviest network yields to a newcomer.

    Every operation is O(1): networks are kept in buckets by how many places they hold, so finding the
    heaviest under a flood from thousands of networks costs no scan.
    """

    def __init__(self, total: int, per_network: int) -> None:
        self.total, self.per_network = total, per_network
        self.count = 0
        self._held: dict[str, dict[Holder, None]] = {}  # network -> its holders, oldest first
        self._networks_by_count: dict[int, dict[str, None]] = {}
        self._heaviest = 0

    def held_by(self, network: str) -> int:
        return len(self._held.get(network, ()))

    def enter(self, network: str, holder: Holder) -> tuple[bool, Holder | None]:
        """(True, evicted or None) when `holder` got a place, taking it from `evicted` if all were taken; (False, None) if not."""
        mine = self.held_by(network)
        if mine >= self.per_network:
            return False, None
        evicted: Holder | None = None
        if self.count >= self.total:
            if self._heaviest <= mine:
                return False, None  # the newcomer's network is already among the heaviest: it is the one to wait
            heaviest = next(iter(self._networks_by_count[self._heaviest]))
            evicted = next(iter(self._held[heaviest]))
            self.leave(heaviest, evicted)
        self._move(network, mine, mine + 1)
        self._held.setdefault(network, {})[holder] = None
        self.count += 1
        return True, evicted

    def leave(self, network: str, holder: Holder) -> bool:
        """Gives `holder`'s place back; False when it held none (already evicted or never admitted)."""
        holders = self._held.get(network)
        if holders is None or holder not in holders:
            return False
        self._move(network, len(holders), len(holders) - 1)
        del holders[holder]
        if not holders:
            del self._held[network]  # only networks holding a place are kept: the map cannot grow without bound
        self.count -= 1
        return True

    def _move(self, network: str, before: int, after: int) -> None:
        if before:
            bucket = self._networks_by_count[before]
            del bucket[network]
            if not bucket:
                del self._networks_by_count[before]
        if after:
            self._networks_by_count.setdefault(after, {})[network] = None
        if after > self._heaviest:
            self._heaviest = after
        while self._heaviest and self._heaviest not in self._networks_by_count:
            self._heaviest -= 1  # counts move by one, so this steps down at most once per call


__all__ = ["DEFAULT_IPV4_NETWORK_PREFIX", "FairShare", "IPV4_NETWORK_PREFIXES", "IPV6_NETWORK_PREFIX", "network_of"]
