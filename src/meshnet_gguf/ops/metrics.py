"""Prometheus metrics for the node, cheap on the hot path.

Per request the proxy already builds one `UsageRecord`; `NodeMetrics` is one of
its usage sinks and turns it into a few counter/histogram updates on cached
label children. Everything that is a state rather than an event (in flight,
slots, supervisor state, restarts, outbox depth, load progress) is read at
scrape time from callables given at construction, so nothing runs per request
for them. A private `CollectorRegistry` keeps the process-wide default (and
whatever a library puts there) out of the node's output.

llama-server's own `/metrics` (when it runs with `--metrics`) is re-exported
with its names moved under `meshnet_llamacpp_`: `llamacpp:prompt_tokens_total`
becomes `meshnet_llamacpp_prompt_tokens_total`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import get_args

import anyio
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from meshnet_gguf.contract.protocol import NodeState, UsageRecord
from meshnet_gguf.llama.upstream import UpstreamClient, UpstreamError

log = logging.getLogger(__name__)

NAMESPACE = "meshnet"
LLAMACPP_SOURCE_PREFIX = "llamacpp:"
LLAMACPP_PREFIX = f"{NAMESPACE}_llamacpp_"
# A scrape that waits on a busy llama-server must still answer before
# Prometheus' own default scrape timeout (10 s).
LLAMA_METRICS_TIMEOUT_S = 3.0

# From a 0.3 B model on one GPU to a 200 B MoE prefilling 30 k tokens on a
# Strix Halo: first tokens take from tens of milliseconds to minutes.
TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
DECODE_RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0, 250.0, 500.0, 1000.0)
DURATION_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

SUPERVISOR_STATES: tuple[str, ...] = get_args(NodeState)

IntSource = Callable[[], int]
FloatSource = Callable[[], float | None]


class NodeMetrics:
    """The node's metrics. Give it to the proxy as a usage sink; serve `scrape()` at `/metrics`."""

    def __init__(
        self,
        *,
        in_flight: IntSource | None = None,
        slots_busy: IntSource | None = None,
        slots_total: IntSource | None = None,
        supervisor_state: Callable[[], str] | None = None,
        restarts: IntSource | None = None,
        outbox_depth: IntSource | None = None,
        load_progress: FloatSource | None = None,
        info: Callable[[], Mapping[str, str]] | None = None,
        llama_metrics: Callable[[], Awaitable[str]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self._llama_metrics = llama_metrics
        r = self.registry
        self._requests = Counter(
            f"{NAMESPACE}_requests", "Requests answered, by API route and HTTP status", ["route", "status"], registry=r
        )
        self._finished = Counter(f"{NAMESPACE}_requests_finished", "Proxied requests by how they ended", ["finish_reason"], registry=r)
        self._prompt_tokens = Counter(f"{NAMESPACE}_prompt_tokens", "Prompt tokens processed", ["route"], registry=r)
        self._cached_tokens = Counter(
            f"{NAMESPACE}_cached_prompt_tokens", "Prompt tokens served from llama-server's cache", ["route"], registry=r
        )
        self._completion_tokens = Counter(f"{NAMESPACE}_completion_tokens", "Completion tokens generated", ["route"], registry=r)
        self._ttft = Histogram(
            f"{NAMESPACE}_time_to_first_token_seconds", "Time from admission to the first token",
            buckets=TTFT_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._decode_rate = Histogram(
            f"{NAMESPACE}_decode_tokens_per_second", "Decode speed of each request",
            buckets=DECODE_RATE_BUCKETS, registry=r,
        )  # fmt: skip
        self._duration = Histogram(
            f"{NAMESPACE}_request_duration_seconds", "Time from admission to the last byte",
            buckets=DURATION_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._download_bytes = Counter(f"{NAMESPACE}_download_bytes", "Model bytes downloaded", registry=r)
        r.register(
            _StateCollector(
                in_flight=in_flight,
                slots_busy=slots_busy,
                slots_total=slots_total,
                supervisor_state=supervisor_state,
                restarts=restarts,
                outbox_depth=outbox_depth,
                load_progress=load_progress,
                info=info,
            )
        )
        # labels() validates and locks on every call; the set of routes and
        # statuses is small, so the children are looked up once and kept.
        self._request_children: dict[tuple[str, int], Counter] = {}
        self._route_children: dict[str, tuple[Counter, Counter, Counter]] = {}
        self._finish_children: dict[str, Counter] = {}

    # --- usage sink ------------------------------------------------------------

    async def record(self, usage: UsageRecord) -> None:
        self.observe(usage)

    def observe(self, usage: UsageRecord) -> None:
        """Count one finished request. A handful of dict lookups and additions."""
        self.count_request(usage.route, usage.status)
        finish = self._finish_children.get(usage.finish_reason)
        if finish is None:
            finish = self._finish_children[usage.finish_reason] = self._finished.labels(usage.finish_reason)
        finish.inc()
        children = self._route_children.get(usage.route)
        if children is None:
            children = self._route_children[usage.route] = (
                self._prompt_tokens.labels(usage.route),
                self._cached_tokens.labels(usage.route),
                self._completion_tokens.labels(usage.route),
            )
        prompt, cached, completion = children
        if usage.prompt_tokens:
            prompt.inc(usage.prompt_tokens)
        if usage.cached_tokens:
            cached.inc(usage.cached_tokens)
        if usage.completion_tokens:
            completion.inc(usage.completion_tokens)
        if usage.ttft_s is not None:
            self._ttft.observe(usage.ttft_s)
        if usage.decode_tokens_per_s is not None:
            self._decode_rate.observe(usage.decode_tokens_per_s)
        self._duration.observe(usage.duration_s)

    def count_request(self, route: str, status: int) -> None:
        """Count one answered request. `observe` calls it; the proxy calls it directly for
        requests refused at admission, which yield no usage record."""
        key = (route, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self._requests.labels(route, str(status))
        child.inc()

    def count_download_bytes(self, count: int) -> None:
        if count > 0:
            self._download_bytes.inc(count)

    # --- exposition ------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The node's own metrics: (body, content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4

    async def scrape(self) -> tuple[int, bytes, str]:
        """`GET /metrics`: the node's metrics plus llama-server's, as (status, body, content type)."""
        body, content_type = self.render()
        if self._llama_metrics is not None:
            body += (await self._llama_metrics()).encode()
        return 200, body, content_type


class _StateCollector:
    """Gauges read at scrape time from the node's owners of that state."""

    def __init__(
        self,
        *,
        in_flight: IntSource | None,
        slots_busy: IntSource | None,
        slots_total: IntSource | None,
        supervisor_state: Callable[[], str] | None,
        restarts: IntSource | None,
        outbox_depth: IntSource | None,
        load_progress: FloatSource | None,
        info: Callable[[], Mapping[str, str]] | None,
    ) -> None:
        self._gauges: list[tuple[str, str, IntSource | FloatSource]] = [
            (name, doc, source)
            for name, doc, source in (
                (f"{NAMESPACE}_requests_in_flight", "Requests being answered now", in_flight),
                (f"{NAMESPACE}_slots_busy", "llama-server slots in use", slots_busy),
                (f"{NAMESPACE}_slots_total", "llama-server slots (= most requests in flight)", slots_total),
                (f"{NAMESPACE}_billing_outbox_depth", "Usage records waiting to be sent to the tracker", outbox_depth),
                (f"{NAMESPACE}_load_progress", "Model load progress 0..1 while loading", load_progress),
            )
            if source is not None
        ]
        self._supervisor_state = supervisor_state
        self._restarts = restarts
        self._info = info

    def collect(self) -> Iterable[Metric]:
        for name, doc, source in self._gauges:
            value = _read(source, name)
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        if self._supervisor_state is not None:
            current = _read(self._supervisor_state, "supervisor_state")
            if current is not None:
                family = GaugeMetricFamily(f"{NAMESPACE}_supervisor_state", "1 for the supervisor's current state", labels=["state"])
                for state in SUPERVISOR_STATES:
                    family.add_metric([state], 1.0 if state == current else 0.0)
                yield family
        if self._restarts is not None:
            restarts = _read(self._restarts, "restarts")
            if restarts is not None:
                yield CounterMetricFamily(f"{NAMESPACE}_supervisor_restarts", "llama-server restarts after a crash", value=restarts)
        if self._info is not None:
            labels = _read(self._info, "info")
            if labels:
                yield InfoMetricFamily(f"{NAMESPACE}_node", "Node version, model and llama-server build", value=labels)


def _read(source: Callable[[], object], what: str) -> object | None:
    # A scrape must never fail because one owner is mid-change or gone.
    try:
        return source()
    except Exception:
        log.debug("metric source %s failed", what, exc_info=True)
        return None


# --- llama-server's metrics ---------------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_COMMENT_RE = re.compile(rf"^# (HELP|TYPE) ({_NAME})(.*)$")
# name, optional {labels}, value, optional timestamp: anything else is not a sample.
_SAMPLE_RE = re.compile(rf"^({_NAME})((?:\{{.*\}})?\s+(?:[-+]?[0-9.eE+-]+|NaN|[+-]?Inf)(?:\s+-?\d+)?\s*)$")


def rename_llama_metric(name: str, prefix: str = LLAMACPP_PREFIX) -> str:
    """`llamacpp:prompt_tokens_total` -> `meshnet_llamacpp_prompt_tokens_total`.

    Colons are reserved for recording rules in Prometheus naming, so any left
    in the name become underscores.
    """
    if name.startswith(LLAMACPP_SOURCE_PREFIX):
        name = name[len(LLAMACPP_SOURCE_PREFIX) :]
    return prefix + name.replace(":", "_")


def rewrite_llama_metrics(text: str, prefix: str = LLAMACPP_PREFIX) -> str:
    """Move every metric of a Prometheus text exposition under `prefix`; other lines are kept."""
    out: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            comment = _COMMENT_RE.match(line)
            if comment is not None:
                kind, name, rest = comment.groups()
                line = f"# {kind} {rename_llama_metric(name, prefix)}{rest}"
        elif line.strip():
            sample = _SAMPLE_RE.match(line)
            if sample is None:
                continue  # not a sample line: drop rather than corrupt our exposition
            name, rest = sample.groups()
            line = rename_llama_metric(name, prefix) + rest
        else:
            continue
        out.append(line)
    return "\n".join(out) + "\n" if out else ""


async def fetch_llama_metrics(
    client: UpstreamClient,
    base_url: str,
    api_key: str | None,
    *,
    timeout_s: float = LLAMA_METRICS_TIMEOUT_S,
) -> str:
    """llama-server's `/metrics`, renamed, plus `meshnet_llamacpp_up` (1 when that worked).

    llama-server without `--metrics` answers 501; that, a timeout or a child
    that is restarting yields only `..._up 0`, never an error for the scrape.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text: str | None = None
    try:
        with anyio.fail_after(timeout_s):
            response = await client.send("GET", base_url.rstrip("/") + "/metrics", headers, None)
            try:
                body = await response.read()
            finally:
                await response.aclose()
        if response.status == 200:
            text = rewrite_llama_metrics(body.decode("utf-8", errors="replace"))
        else:
            log.debug("llama-server /metrics answered %s", response.status)
    except (UpstreamError, TimeoutError) as exc:
        log.debug("llama-server /metrics unavailable: %s", exc)
    return llama_up_text(text is not None) + (text or "")


def llama_up_text(up: bool) -> str:
    """`meshnet_llamacpp_up`, alone: what a scrape shows while llama-server is not there to ask."""
    return (
        f"# HELP {LLAMACPP_PREFIX}up 1 if llama-server's own metrics were read for this scrape\n"
        f"# TYPE {LLAMACPP_PREFIX}up gauge\n"
        f"{LLAMACPP_PREFIX}up {1 if up else 0}\n"
    )
