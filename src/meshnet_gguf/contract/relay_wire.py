"""The relay's handshake on the wire (docs/protocol.md, "Relay"): the tunnel's path and upgrade, its timings and
limits, and the messages a node, a relay and a tracker exchange before any raw bytes (`relay_framing` frames them).
No I/O here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshnet_gguf.contract.protocol import WireModel

# A node dials the relay and upgrades one HTTP/1.1 connection per role to this protocol.
RELAY_TUNNEL_PATH = "/v1/relay/tunnel"
RELAY_UPGRADE_PROTOCOL = "meshnet-relay/1"
# A tracker's CONNECT carries `Proxy-Authorization: Bearer <token>` (RelayConnectClaims), good for one
# connection to one node through one relay, and short-lived.
RELAY_CONNECT_AUTH_SCHEME = "Bearer"
MAX_RELAY_CONNECT_TOKEN_LIFETIME_S = 60
# Trackers ask the relay for `CONNECT <node_id>:443`; the port is nominal, the node id picks the tunnel.
RELAY_CONNECT_PORT = 443
# The most a node may wait between pings; a tunnel silent for ping interval + timeout is dead.
RELAY_PING_INTERVAL_S = 10.0
RELAY_PING_TIMEOUT_S = 10.0
# One control or handshake message (a JSON line); an attach proof is ~400 bytes.
MAX_RELAY_MESSAGE_BYTES = 16 * 1024
# Request heads on the relay's port (CONNECT or the tunnel upgrade); real ones are ~200 bytes.
MAX_RELAY_HEAD_BYTES = 8 * 1024
# An attach proof only has to outlive one handshake.
RELAY_PROOF_LIFETIME_S = 60
RelayRole = Literal["control", "work"]


class RelayChallenge(WireModel):
    """relay -> node, first line after the upgrade: sign this nonce."""

    type: Literal["challenge"] = "challenge"
    nonce: str = Field(description="base64url of 32 random bytes, fresh per connection")


class RelayAttachClaims(WireModel):
    """Claims of the attach proof (EdDSA JWT signed with the node key)."""

    iss: str = Field(description="Node id")
    aud: str = Field(description="The relay this proof is for: relay_audience(its URL)")
    nonce: str = Field(description="The relay's challenge on this very connection")
    role: RelayRole
    iat: int
    exp: int


class RelayAttach(WireModel):
    """node -> relay: who I am, proved by signing the challenge."""

    type: Literal["attach"] = "attach"
    role: RelayRole
    node_id: str
    public_key: str = Field(description="Ed25519 public key, base64url raw; node_id must be derived from it")
    proof: str = Field(description="JWT whose claims are RelayAttachClaims")


class RelayAttached(WireModel):
    """relay -> node: the connection is accepted in its role."""

    type: Literal["attached"] = "attached"
    node_id: str
    role: RelayRole
    ping_interval_s: float = Field(RELAY_PING_INTERVAL_S, gt=0, le=RELAY_PING_INTERVAL_S * 2)
    ping_timeout_s: float = Field(RELAY_PING_TIMEOUT_S, gt=0)
    max_idle_work: int = Field(gt=0, description="Idle work connections the relay keeps for this node")


class RelayConnectClaims(WireModel):
    """Claims of a tracker's CONNECT token (EdDSA JWT signed with the tracker key)."""

    iss: str = Field(description="Tracker issuer (tracker_issuer_for its key)")
    aud: str = Field(description="The relay: relay_audience(the URL the node announced)")
    sub: str = Field(description="The node id the CONNECT names")
    jti: str = Field(description="Fresh per token: the relay accepts each once")
    iat: int
    exp: int


class RelayReady(WireModel):
    """node -> relay, on a work connection after `attached`: the node listens for TLS now; park me."""

    type: Literal["ready"] = "ready"


class RelayRefused(WireModel):
    """relay -> node, then the relay closes the connection."""

    type: Literal["refused"] = "refused"
    code: str = Field(
        description="bad_message, message_too_large, node_id_mismatch, bad_public_key, bad_proof, "
        "no_control_channel, work_pool_full, too_many_tunnels"
    )
    message: str


class RelayPing(WireModel):
    """Either side, on the control connection only. A ping is answered with a pong."""

    type: Literal["ping", "pong"]
