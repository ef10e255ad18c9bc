"""What a reference tracker is told: its state dir, who may enrol, and its limits, each with its reason."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

from meshnet_gguf.contract.protocol import DEFAULT_HEARTBEAT_INTERVAL_S, MAX_ROUTE_LIFETIME_S, NODE_TTL_HEARTBEATS
from meshnet_gguf.reference.tracker.audits import AuditPolicy
from meshnet_gguf.reference.tracker.node_address import AddressPolicy

# Half the contract's ceiling: plenty for a request to reach its node, little to replay.
DEFAULT_ROUTE_LIFETIME_S = 30
# Health polls catch a node that heartbeats but cannot serve (llama-server restarting).
DEFAULT_HEALTH_POLL_INTERVAL_S = 5.0
# Same default as the node's own body limit: larger requests would be refused there anyway.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Applied when a client names no limit, so every route carries a finite max_tokens.
DEFAULT_MAX_TOKENS_CAP = 4096
# Longest any forwarded request may take, first byte to last: a stuck node frees the tracker.
# An hour covers a 32k-token answer at 10 tokens/s with room to spare.
DEFAULT_FORWARD_TOTAL_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class TrackerConfig:
    """`enrolment_secret` is required unless `open_enrolment` says anyone may register a node."""

    state_dir: Path
    enrolment_secret: str | None = None
    open_enrolment: bool = False
    addresses: AddressPolicy = AddressPolicy()
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    route_lifetime_s: int = DEFAULT_ROUTE_LIFETIME_S
    health_poll_interval_s: float = DEFAULT_HEALTH_POLL_INTERVAL_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP
    forward_total_timeout_s: float = DEFAULT_FORWARD_TOTAL_TIMEOUT_S
    # How https relays are checked [default: the system's CAs]; the relay's host name is always checked.
    relay_tls: ssl.SSLContext | None = None
    # Proof of model: model id -> the URL of a verifier this tracker trusts for it. Empty: no audits at all.
    verifiers: dict[str, str] = field(default_factory=dict)
    audit_policy: AuditPolicy = AuditPolicy()

    def __post_init__(self) -> None:
        if not 0 < self.route_lifetime_s <= MAX_ROUTE_LIFETIME_S:
            raise ValueError(f"route lifetime must be 1..{MAX_ROUTE_LIFETIME_S} s")
        if not self.enrolment_secret and not self.open_enrolment:
            raise ValueError("set an enrolment secret, or open enrolment explicitly (anyone may then register nodes)")

    @property
    def ttl_s(self) -> float:
        return self.heartbeat_interval_s * NODE_TTL_HEARTBEATS
