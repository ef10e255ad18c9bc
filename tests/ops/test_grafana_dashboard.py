"""The Grafana dashboard in docs/ asks only for metrics a node exports.

The node's /metrics is scraped from a `NodeMetrics` with every source given and a
request of each kind recorded (histograms and labelled counters appear only then),
plus the relay tunnel's collector; every metric name in every query must be among
the names that scrape printed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshnet_gguf.contract.protocol import RelayLinkHealth, UsageRecord
from meshnet_gguf.ops.metrics import NodeMetrics
from meshnet_gguf.ops.relay_metrics import RelayLinkCollector

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "meshnet-node.json"
METRIC_NAME = re.compile(r"\b(meshnet_[a-z0-9_]+|llamacpp:[a-z0-9_]+)\b")


async def _exported_names() -> set[str]:
    metrics = NodeMetrics(
        in_flight=lambda: 1, slots_busy=lambda: 1, slots_total=lambda: 4, supervisor_state=lambda: "loading",
        restarts=lambda: 2, outbox_depth=lambda: 3, load_progress=lambda: 0.5,
        info=lambda: {"version": "0.1.0", "model": "tiny", "llama_build": "b1"},
    )  # fmt: skip
    link: Any = SimpleNamespace(link_health=lambda: RelayLinkHealth(url="http://relay:8001", state="attached"))
    metrics.registry.register(RelayLinkCollector([link]))
    metrics.count_request("/v1/chat/completions", 200)
    metrics.count_download_bytes(1024)
    await metrics.record(
        UsageRecord(
            request_id="r",
            route="/v1/chat/completions",
            model="tiny",
            status=200,
            stream=True,
            prompt_tokens=5,
            cached_tokens=1,
            completion_tokens=4,
            finish_reason="stop",
            started_at=0,
            duration_s=0.5,
            ttft_s=0.1,
            decode_tokens_per_s=30.0,
        )  # fmt: skip
    )
    text = metrics.render()[0].decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def _queries(dashboard: dict[str, Any]) -> list[str]:
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if isinstance(variable.get("query"), dict):
            queries.append(variable["query"]["query"])
    return queries


@pytest.mark.anyio
async def test_every_query_names_a_metric_the_node_exports() -> None:
    exported = await _exported_names()
    queries = _queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) >= 10
    for query in queries:
        named = set(METRIC_NAME.findall(query))
        assert named, f"no node metric in {query!r}"
        assert named <= exported, f"{query!r} names {sorted(named - exported)}, which the node does not export"
