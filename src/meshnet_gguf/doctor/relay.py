"""`doctor`'s relay check: can this node attach at each of its relays with its key?"""

from __future__ import annotations

import anyio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.doctor.checks import Finding
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.relay_link import RelayEndpoint, RelayProtocolError, RelayRefusedError, probe_relay

# doctor waits this long for the relay's answer; the link itself uses the same dial timeout.
DOCTOR_PROBE_TIMEOUT_S = 10.0


def check_relay(settings: NodeSettings, identity: NodeIdentity | None) -> list[Finding]:
    """Can this node attach at each of its relays with its key (`identity`, None when the node never started)?
    Probes with a work connection, so a running node's tunnel is left alone (a control connection
    would replace it). One finding per relay: with two, the node fails over between them, so one
    that fails is worth knowing while the other still works."""
    if not settings.relay_url:
        return [Finding("relay", "skip", "no relay configured: the tracker reaches this node at its own address")]
    # A node that never started probes with a throwaway key, which tells whether the relay admits a node at all.
    whose = "this node's key"
    if identity is None:
        identity = NodeIdentity.from_private_key(Ed25519PrivateKey.generate())
        whose = "a node key (this node has none yet: it creates one on its first start)"
    return [_check_one(url, identity, whose) for url in settings.relay_url]


def _check_one(url: str, identity: NodeIdentity, whose: str) -> Finding:
    try:
        endpoint = RelayEndpoint.parse(url)
    except ValueError as exc:
        return Finding("relay", "fail", str(exc), "", "set --relay / MESHNET_RELAY_URL to http://host:port")
    try:
        tunnel_up = anyio.run(_probe, endpoint, identity)
    except RelayRefusedError as exc:
        return Finding(
            "relay", "fail", f"the relay at {endpoint.url} refused this node: {exc}",
            "the relay checks that the node signs its challenge with the key its node id is derived from",
            "check the relay URL; a relay that refuses a correct key is misconfigured or not a Meshnet relay",
        )  # fmt: skip
    except (OSError, TimeoutError, RelayProtocolError) as exc:
        return Finding(
            "relay", "fail", f"cannot attach at the relay {endpoint.url}: {type(exc).__name__}: {exc}",
            "with a relay set, the tracker reaches this node only through its tunnels there",
            "check the URL (--relay / MESHNET_RELAY_URL) and that this machine can dial it",
        )  # fmt: skip
    state = "the node's tunnel is up" if tunnel_up else "no tunnel now (the node is not running)"
    return Finding("relay", "ok", f"the relay at {endpoint.url} accepts {whose}; {state}")


async def _probe(endpoint: RelayEndpoint, identity: NodeIdentity) -> bool:
    with anyio.fail_after(DOCTOR_PROBE_TIMEOUT_S):
        return await probe_relay(endpoint, identity)
