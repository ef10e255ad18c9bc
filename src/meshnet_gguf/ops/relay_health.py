"""The relay link as operators see it: Prometheus metrics and a `doctor` check.

Kept apart from `relay_link` so the tunnel code stays about the tunnel. The
node adds `RelayLinkCollector(link)` to its metrics registry; `doctor` calls
`check_relay(settings)`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import anyio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.relay_link import RelayEndpoint, RelayLink, RelayProtocolError, RelayRefusedError, probe_relay
from meshnet_gguf.ops.doctor import Finding

METRIC_PREFIX = "meshnet_relay"
# doctor waits this long for the relay's answer; the link itself uses the same dial timeout.
DOCTOR_PROBE_TIMEOUT_S = 10.0


class RelayLinkCollector:
    """Read at scrape time from the link's own counters: nothing runs per request."""

    def __init__(self, link: RelayLink) -> None:
        self.link = link

    def collect(self) -> Iterable[Metric]:
        h = self.link.link_health()
        labels = ["relay"]
        attached = GaugeMetricFamily(f"{METRIC_PREFIX}_attached", "1 while the tunnel to the relay is attached", labels=labels)
        attached.add_metric([h.url], 1.0 if h.state == "attached" else 0.0)
        connects = CounterMetricFamily(f"{METRIC_PREFIX}_connects", "Control connections attached since start", labels=labels)
        connects.add_metric([h.url], h.connects)
        idle = GaugeMetricFamily(f"{METRIC_PREFIX}_idle_work_connections", "Idle work connections waiting at the relay", labels=labels)
        idle.add_metric([h.url], h.idle_work)
        active = GaugeMetricFamily(f"{METRIC_PREFIX}_streams_active", "Requests in flight through the relay", labels=labels)
        active.add_metric([h.url], h.streams_active)
        streams = CounterMetricFamily(f"{METRIC_PREFIX}_streams", "Requests served through the relay since start", labels=labels)
        streams.add_metric([h.url], h.streams_total)
        return [attached, connects, idle, active, streams]


def check_relay(settings: NodeSettings) -> list[Finding]:
    """Can this node attach at its relay with its key? Probes with a work connection, so a running
    node's tunnel is left alone (a control connection would replace it)."""
    if not settings.relay_url:
        return [Finding("relay", "skip", "no relay configured: the tracker reaches this node at its own address")]
    try:
        endpoint = RelayEndpoint.parse(settings.relay_url)
    except ValueError as exc:
        return [Finding("relay", "fail", str(exc), "", "set --relay / MESHNET_RELAY_URL to http://host:port")]
    # Read only: doctor never creates the node's key. A node that never started probes with a
    # throwaway key, which tells whether the relay admits a node at all.
    try:
        identity = NodeIdentity.load(Path(settings.state_dir))
        whose = "this node's key"
    except FileNotFoundError:
        identity = NodeIdentity.from_private_key(Ed25519PrivateKey.generate())
        whose = "a node key (this node has none yet: it creates one on its first start)"
    try:
        tunnel_up = anyio.run(_probe, endpoint, identity)
    except RelayRefusedError as exc:
        return [Finding(
            "relay", "fail", f"the relay at {endpoint.url} refused this node: {exc}",
            "the relay checks that the node signs its challenge with the key its node id is derived from",
            "check the relay URL; a relay that refuses a correct key is misconfigured or not a Meshnet relay",
        )]  # fmt: skip
    except (OSError, TimeoutError, RelayProtocolError) as exc:
        return [Finding(
            "relay", "fail", f"cannot attach at the relay {endpoint.url}: {type(exc).__name__}: {exc}",
            "with a relay set, the tracker reaches this node only through its tunnel there",
            "check the URL (--relay / MESHNET_RELAY_URL) and that this machine can dial it",
        )]  # fmt: skip
    state = "the node's tunnel is up" if tunnel_up else "no tunnel now (the node is not running)"
    return [Finding("relay", "ok", f"the relay at {endpoint.url} accepts {whose}; {state}")]


async def _probe(endpoint: RelayEndpoint, identity: NodeIdentity) -> bool:
    with anyio.fail_after(DOCTOR_PROBE_TIMEOUT_S):
        return await probe_relay(endpoint, identity)


__all__ = ["RelayLinkCollector", "check_relay"]
