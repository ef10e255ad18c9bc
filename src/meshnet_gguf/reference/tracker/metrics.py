"""The tracker's Prometheus metrics: its nodes and its audits, read from the registry and the auditor at scrape time.

Nothing is counted per request here: the registry and the auditor already hold every figure, so a scrape reads
them. Audit verdicts are the ledger's totals (a restart keeps them, as it keeps a failed node unroutable); answers
drawn, audits dropped undecided and verifier misses count since this tracker started. A private
`CollectorRegistry` keeps whatever a library registers globally out of the output.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from starlette.requests import Request
from starlette.responses import Response

# Why an audit ends without a verdict: the verifier could not judge it enough times, the node's share of the queue
# was full (a draw kept or not by the reservoir: counted per draw past the share), or the whole queue was full.
DROP_REASONS = ("no_verdict", "node_share_full", "queue_full")


class _TrackerCollector:
    def __init__(self, registry: Any, auditor: Any) -> None:
        self._registry, self._auditor = registry, auditor

    def collect(self) -> Iterable[Metric]:
        entries = list(self._registry.all())
        nodes = GaugeMetricFamily("meshnet_tracker_nodes", "Registered nodes by state", labels=["state"])
        nodes.add_metric(["healthy"], sum(e.healthy for e in entries))
        nodes.add_metric(["unhealthy"], sum(not e.healthy for e in entries))
        nodes.add_metric(["proof_blocked"], sum(e.proof_blocked for e in entries))
        yield nodes
        auditor = self._auditor
        if auditor is None:  # no verifier named: every audit figure is zero
            records, drawn_n, dropped_n, misses_n, pending_n = [], 0, Counter[str](), 0, 0
        else:
            records = list(auditor.records.values())
            drawn_n, dropped_n, misses_n, pending_n = auditor.drawn, auditor.dropped, auditor.verifier_misses, auditor.outstanding
        audits = CounterMetricFamily("meshnet_tracker_audits", "Audits decided by a verifier, by outcome (kept in the ledger)",
                                     labels=["outcome"])  # fmt: skip
        audits.add_metric(["passed"], sum(r.passed for r in records))
        audits.add_metric(["failed"], sum(r.failed for r in records))
        yield audits
        drawn = CounterMetricFamily("meshnet_tracker_audit_answers_drawn", "Answers drawn for audit since this tracker started")
        drawn.add_metric([], drawn_n)
        yield drawn
        dropped = CounterMetricFamily("meshnet_tracker_audits_dropped", "Audits dropped undecided, by why", labels=["reason"])
        for reason in DROP_REASONS:
            dropped.add_metric([reason], dropped_n[reason])
        yield dropped
        misses = CounterMetricFamily("meshnet_tracker_verifier_misses", "Audits a verifier did not judge when asked (asked again later)")
        misses.add_metric([], misses_n)
        yield misses
        pending = GaugeMetricFamily("meshnet_tracker_audits_pending", "Audits queued or waiting for a verifier")
        pending.add_metric([], pending_n)
        yield pending


class TrackerMetrics:
    """`GET /metrics`: the tracker's nodes and audits in Prometheus' text format."""

    def __init__(self, registry: Any, auditor: Any) -> None:
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_TrackerCollector(registry, auditor))  # type: ignore[arg-type]

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)


__all__ = ["TrackerMetrics"]
