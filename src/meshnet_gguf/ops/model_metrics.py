"""Each model a node serves, as Prometheus sees it: loaded or not, loads, requests, its llama-server's memory.

Read at scrape time from the node's status of its models (what `/status.json` and `meshnet-gguf ps` show):
nothing runs per request or per load. The node adds `ModelsCollector(status)` to its metrics registry; each
model is a label value, so a dashboard sees a model come and go without a restart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

METRIC_PREFIX = "meshnet_model"


class ModelsCollector:
    """`status()` is the node's list of its models, each a mapping with `alias`, `state`, `loads`, `requests`, `rss_bytes`."""

    def __init__(self, status: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        self._status = status

    def collect(self) -> Iterable[Metric]:
        labels = ["model"]
        loaded = GaugeMetricFamily(f"{METRIC_PREFIX}_loaded", "1 while the model's llama-server is loaded and ready", labels=labels)
        failed = GaugeMetricFamily(f"{METRIC_PREFIX}_failed", "1 while the model failed to load (its requests are refused)", labels=labels)
        loads = CounterMetricFamily(
            f"{METRIC_PREFIX}_loads", "Loads of the model since start (the first model: not counted)", labels=labels
        )
        requests = CounterMetricFamily(f"{METRIC_PREFIX}_requests", "Requests the model took since start", labels=labels)
        rss = GaugeMetricFamily(
            f"{METRIC_PREFIX}_rss_bytes", "Resident memory of the model's llama-server (0 when unloaded)", labels=labels
        )
        for model in self._status():
            name = [str(model["alias"])]
            loaded.add_metric(name, 1.0 if model.get("state") == "loaded" else 0.0)
            failed.add_metric(name, 1.0 if model.get("state") == "failed" else 0.0)
            if model.get("loads") is not None:
                loads.add_metric(name, float(model["loads"]))
            requests.add_metric(name, float(model.get("requests") or 0))
            rss.add_metric(name, float(model.get("rss_bytes") or 0))
        return [loaded, failed, loads, requests, rss]


__all__ = ["METRIC_PREFIX", "ModelsCollector"]
