"""The relay link as operators see it: its Prometheus metrics (whether it can attach is doctor's check, `doctor.relay`).

Kept apart from `relay_link` so the tunnel code stays about the tunnel. The
node adds `RelayLinkCollector(links)` to its metrics registry: one collector for all its relays
(a registry refuses two collectors of the same names), each relay a label value.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from meshnet_gguf.mesh.relay_link import RelayLink

METRIC_PREFIX = "meshnet_relay"


class RelayLinkCollector:
    """Read at scrape time from the link's own counters: nothing runs per request."""

    def __init__(self, links: Sequence[RelayLink]) -> None:
        self.links = list(links)

    def collect(self) -> Iterable[Metric]:
        labels = ["relay"]
        attached = GaugeMetricFamily(f"{METRIC_PREFIX}_attached", "1 while the tunnel to the relay is attached", labels=labels)
        connects = CounterMetricFamily(f"{METRIC_PREFIX}_connects", "Control connections attached since start", labels=labels)
        idle = GaugeMetricFamily(f"{METRIC_PREFIX}_idle_work_connections", "Idle work connections waiting at the relay", labels=labels)
        active = GaugeMetricFamily(f"{METRIC_PREFIX}_streams_active", "Requests in flight through the relay", labels=labels)
        streams = CounterMetricFamily(f"{METRIC_PREFIX}_streams", "Requests served through the relay since start", labels=labels)
        for link in self.links:
            h = link.link_health()
            attached.add_metric([h.url], 1.0 if h.state == "attached" else 0.0)
            connects.add_metric([h.url], h.connects)
            idle.add_metric([h.url], h.idle_work)
            active.add_metric([h.url], h.streams_active)
            streams.add_metric([h.url], h.streams_total)
        return [attached, connects, idle, active, streams]


__all__ = ["RelayLinkCollector"]
