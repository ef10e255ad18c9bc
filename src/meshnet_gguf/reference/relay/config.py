"""What a reference relay is told: where it listens, whom it trusts, and every limit, each with its reason.

The limits on strangers (pending connections, rates, provisional tunnels), all per source
network, are applied by `relay_admission`; the tunnels' own (pings, idle work connections, waits) by `relay`.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnet_gguf.contract.relay_wire import RELAY_PING_INTERVAL_S, RELAY_PING_TIMEOUT_S
from meshnet_gguf.reference.relay.admitted import ADMITTED_REMEMBERED_S
from meshnet_gguf.reference.relay.networks import DEFAULT_IPV4_NETWORK_PREFIX, IPV4_NETWORK_PREFIXES

# Idle work connections kept per node: enough for a burst of requests to start without a
# round trip to the node; each costs one socket and ~2 kB here.
DEFAULT_MAX_IDLE_WORK = 16
# A CONNECT that finds no idle work connection waits this long for the node to dial one.
WORK_WAIT_TIMEOUT_S = 5.0
# A node must finish the upgrade and its attach proof in this time, or it is cut off.
HANDSHAKE_TIMEOUT_S = 10.0
# Bounds the relay's memory: one tunnel holds a control connection and up to DEFAULT_MAX_IDLE_WORK sockets.
DEFAULT_MAX_TUNNELS = 10_000
# Connections still in their head or attach handshake (nothing proved yet), per source network and in
# all: each may take HANDSHAKE_TIMEOUT_S, so without a bound a stranger holds every descriptor the relay has.
# A network is an IPv6 /64 or an IPv4 prefix (`relay_networks`): one address per limit is no limit to anyone
# holding a /64.
DEFAULT_MAX_PENDING_PER_NETWORK = 64
DEFAULT_MAX_PENDING = 4096
# No network holds more than this share of all pending places (4,096 / 64 = 64, the per-network bound): filling
# them takes 64 networks, and when they are full a newcomer from a network holding fewer takes the heaviest
# network's oldest place, so keeping a newcomer out takes one network per place, thousands of them.
PENDING_SHARE_DIVISOR = 64
# A tunnel is provisional until a trusted tracker CONNECTs to its node with a signed token, which a
# tracker does only for a node that presented its enrolment secret and signed registration (its control
# proof goes through the tunnel). Provisional tunnels are few and short-lived: a stranger's fresh keys
# can hold at most this many, each for at most the window, and never a slot among the admitted.
DEFAULT_MAX_PROVISIONAL_TUNNELS = 256
ADMISSION_WINDOW_S = 60.0
# No network holds more than this share of the provisional tunnels (256 / 16 = 16 waiting new nodes behind one
# NAT); when all are taken, a newcomer's network takes the heaviest network's oldest one, as for pending places.
PROVISIONAL_SHARE_DIVISOR = 16
# New control connections per source network: a node reconnects a few times a minute at worst; a
# NAT with many nodes behind it gets the burst.
TUNNEL_ATTACHES_PER_S = 2.0
TUNNEL_ATTACH_BURST = 20
# Connections that have proved nothing, per source network, as a token bucket taken at accept and given back
# when the connection proves itself (an authorised CONNECT, an attached tunnel or work connection). A network
# whose strangers keep failing runs dry, and its next connections are reset at accept: no task, no parse, no
# answer. The burst matches the per-network pending bound, so a tracker or a node, whose connections prove
# themselves, never meets it before that bound; a stranger gets this many tries a second once its burst is spent.
STRANGER_CONNECTIONS_PER_S = 8.0
STRANGER_CONNECTION_BURST = DEFAULT_MAX_PENDING_PER_NETWORK
# The same, relay-wide: every stranger network's tries together. Per-network buckets bound one network, but a
# thousand networks hold a thousand buckets, and each try they let in costs the relay a task, a parse, often a
# signature check, on the event loop its splices run on (measured: 0.3-0.6 ms a try, 70 % of a core at 1,100 tries
# a second). This bounds the strangers' share of the relay whatever the number of networks; past it they are reset
# at accept (~25 us). Trusted trackers' networks and the networks admitted nodes attach from never draw on it, so a
# flood cannot keep a tracker or an admitted node out; a new node competes with the flood for it, and its retries
# get in at the rate the budget leaves (128 a second is ~25 new nodes a second when no one floods).
RELAY_STRANGER_CONNECTIONS_PER_S = 128.0
# The burst is this many seconds of that rate: a relay restarted with many nodes to admit anew takes the first
# ones at once. `dev relay --stranger-tries-per-s` sets the rate and keeps this ratio.
RELAY_STRANGER_BURST_S = 8.0
RELAY_STRANGER_CONNECTION_BURST = round(RELAY_STRANGER_CONNECTIONS_PER_S * RELAY_STRANGER_BURST_S)


def relay_stranger_burst(tries_per_s: float) -> int:
    """The relay-wide burst that goes with a rate of strangers' tries (`RELAY_STRANGER_BURST_S` of it, at least one)."""
    return max(1, round(tries_per_s * RELAY_STRANGER_BURST_S))


def fair_share(total: int, per_network: int, divisor: int) -> int:
    """The most one network may hold of `total` places: its own bound, and never more than 1/`divisor` of all."""
    return max(1, min(per_network, total // divisor))


@dataclass(frozen=True)
class RelayConfig:
    host: str = "127.0.0.1"
    port: int = 8001
    ping_interval_s: float = RELAY_PING_INTERVAL_S
    ping_timeout_s: float = RELAY_PING_TIMEOUT_S
    max_idle_work: int = DEFAULT_MAX_IDLE_WORK
    work_wait_timeout_s: float = WORK_WAIT_TIMEOUT_S
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    max_tunnels: int = DEFAULT_MAX_TUNNELS
    max_pending_per_network: int = DEFAULT_MAX_PENDING_PER_NETWORK
    max_pending: int = DEFAULT_MAX_PENDING
    # IPv4 sources count per this prefix (32 or 24); IPv6 always per /64 (`relay_networks`).
    ipv4_network_prefix: int = DEFAULT_IPV4_NETWORK_PREFIX
    # Public keys (base64url) of the trackers whose CONNECT tokens this relay honours. Empty: an open
    # relay (local experiments): CONNECT needs no token and every tunnel is admitted at once.
    trusted_tracker_keys: tuple[str, ...] = ()
    # The URL nodes and trackers know this relay by (the audience of their tokens) [default: http://host:port].
    public_url: str | None = None
    max_provisional_tunnels: int = DEFAULT_MAX_PROVISIONAL_TUNNELS
    admission_window_s: float = ADMISSION_WINDOW_S
    tunnel_attaches_per_s: float = TUNNEL_ATTACHES_PER_S
    tunnel_attach_burst: int = TUNNEL_ATTACH_BURST
    stranger_connections_per_s: float = STRANGER_CONNECTIONS_PER_S
    stranger_connection_burst: int = STRANGER_CONNECTION_BURST
    relay_stranger_connections_per_s: float = RELAY_STRANGER_CONNECTIONS_PER_S
    relay_stranger_connection_burst: int = RELAY_STRANGER_CONNECTION_BURST
    # Serve https: a certificate chain (PEM) for the relay's host name and its key. Nodes and trackers check it
    # against the name in the relay's URL.
    tls_certificate_file: str | None = None
    tls_key_file: str | None = None
    # Where the relay keeps the nodes trackers admitted, so they stay admitted across a restart; None: in memory only.
    state_dir: str | None = None
    admitted_remembered_s: float = ADMITTED_REMEMBERED_S

    def __post_init__(self) -> None:
        if self.ipv4_network_prefix not in IPV4_NETWORK_PREFIXES:
            raise ValueError(f"ipv4_network_prefix must be one of {IPV4_NETWORK_PREFIXES}, not {self.ipv4_network_prefix}")

    @property
    def pending_per_network(self) -> int:
        return fair_share(self.max_pending, self.max_pending_per_network, PENDING_SHARE_DIVISOR)

    @property
    def provisional_per_network(self) -> int:
        return fair_share(self.max_provisional_tunnels, self.max_provisional_tunnels, PROVISIONAL_SHARE_DIVISOR)
