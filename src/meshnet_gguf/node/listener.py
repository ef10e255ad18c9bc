"""The node's listener: the app chain a request meets (verifier route, pages, `/metrics` guard, proxy)
on the one HTTP server part, and the extra routes the node hands the proxy (`/metrics`, the tracker's
control proof)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from meshnet_gguf.common.asgi import AsgiApp, ExtraRoute, QueryRoute
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import HealthReport
from meshnet_gguf.llama.upstream import UpstreamClient
from meshnet_gguf.ops.metrics import NodeMetrics
from meshnet_gguf.prepare.pipeline import NodeSetupError, PreparedLaunch
from meshnet_gguf.serving.access import MetricsAccess, PageAccess
from meshnet_gguf.serving.admission_modes import AdmissionMode, StandaloneMode
from meshnet_gguf.serving.http_server import HttpServerPart, ListenError
from meshnet_gguf.serving.prompt_count import PromptCounter
from meshnet_gguf.serving.proxy import ProxyApp, ProxyLimits, UsageSink
from meshnet_gguf.serving.slots import Slots
from meshnet_gguf.serving.status_page import ChatUi, NodePages, RecentRequests, StatusSource, plan_line
from meshnet_gguf.serving.upstream_target import UpstreamTarget

if TYPE_CHECKING:
    from meshnet_gguf.mesh.tracker_link import TrackerLink

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"


def build_listener(
    launch: PreparedLaunch,
    *,
    upstream: Callable[[], UpstreamTarget | None],
    client: UpstreamClient,
    slots: Slots,
    prompt_counter: PromptCounter,
    health: Callable[[], HealthReport],
    usage_sinks: Sequence[UsageSink],
    recent_requests: RecentRequests,
    metrics: NodeMetrics,
    tracker_link: TrackerLink | None,
    is_relayed: Callable[[tuple[str, int]], bool] | None,
) -> HttpServerPart:
    """The node's one listener, its app chain in the order a request meets it: the verifier route
    (with --verifier), the operator's pages, the `/metrics` guard, the proxy."""
    settings = launch.settings
    proxy = build_proxy(
        settings,
        upstream=upstream,
        client=client,
        slots=slots,
        prompt_counter=prompt_counter,
        model_name=launch.model_name,
        model_aliases=launch.model_aliases,
        health=health,
        usage_sinks=usage_sinks,
        mode=tracker_link.admission_mode if tracker_link else None,
        extra_get_routes={METRICS_PATH: metrics.scrape},
        query_get_routes=dict([tracker_link.control_route]) if tracker_link else None,
        on_rejected=metrics.count_request,
    )
    # /metrics for local scrapes and the operator's key only: not for relayed or remote callers.
    guarded = MetricsAccess(proxy, METRICS_PATH, is_relayed=is_relayed, operator_key=settings.metrics_key)
    # The operator's pages in front of the proxy; the chat only standalone (a meshed node's slots are the
    # tracker's), and only where llama-server has its web UI (a build without npm has none).
    features = launch.features
    chat = tracker_link is None and (features is None or features.web_ui is not False)
    pages = NodePages(
        guarded,
        status=StatusSource(
            health,
            recent_requests,
            plan_line(launch.plan.describe(with_argv=False) if launch.plan else None, settings.parallel),
            tracker=settings.tracker,
            chat=chat,
            llama_server=f"{launch.binary.describe()}; {features.describe()}" if features else launch.binary.describe(),
            llama_server_choice=launch.binary_choice.to_dict() if launch.binary_choice else None,
        ),  # fmt: skip
        access=PageAccess(
            api_key=settings.api_key,
            meshed=tracker_link is not None,
            remote=settings.status_page_remote,
            host_names=(settings.host, *settings.allowed_hosts),
            relayed=is_relayed,
        ),  # fmt: skip
        chat=ChatUi(upstream, client) if chat else None,
    )
    # serve --verifier: the tracker's audits of this model, on this listener, scored by this node's llama-server.
    app = _verifier_route(pages, settings, upstream, slots, tracker_link, is_relayed) if settings.verifier else pages
    try:
        return HttpServerPart(app, settings.host, settings.port)
    except ListenError as exc:
        raise NodeSetupError(str(exc)) from exc


def _verifier_route(
    app: AsgiApp,
    settings: NodeSettings,
    upstream: Callable[[], UpstreamTarget | None],
    slots: Slots,
    tracker_link: TrackerLink | None,
    is_relayed: Callable[[tuple[str, int]], bool] | None,
) -> AsgiApp:
    """`POST /v1/proof/audit` in front of the node's app. Audits are signed by the tracker this node trusts:
    a meshed node's route key (configured, pinned, or learnt on first contact), else `tracker_public_key`.
    Each takes one of the node's slots, as a request does; the relay's callers never see the path."""
    from meshnet_gguf.contract.model_proof import AUDIT_PATH
    from meshnet_gguf.contract.signing import KeyFormatError, parse_public_key
    from meshnet_gguf.proof.verifier_endpoint import AuditEndpoint, VerifierRoute

    if tracker_link is not None:
        gate = tracker_link.route_gate
        key = lambda: gate.tracker_key  # noqa: E731
    else:
        try:
            fixed = parse_public_key(settings.tracker_public_key or "")
        except KeyFormatError as exc:
            raise NodeSetupError(f"--verifier trusts tracker_public_key, which is not a key: {exc}") from exc
        key = lambda: fixed  # noqa: E731

    def scorer() -> tuple[str, str | None] | None:
        target = upstream()
        return None if target is None else (target.base_url, target.api_key)

    endpoint = AuditEndpoint(scorer, key, acquire_slot=lambda: None if slots.draining else slots.try_acquire())
    log.info("verifier: this node answers the tracker's audits at %s", AUDIT_PATH)
    return VerifierRoute(app, endpoint, hidden=is_relayed)


def build_proxy(
    settings: NodeSettings,
    *,
    upstream: Callable[[], UpstreamTarget | None],
    client: UpstreamClient,
    slots: Slots,
    prompt_counter: PromptCounter,
    model_name: str,
    health: Callable[[], HealthReport],
    model_aliases: Sequence[str] = (),
    usage_sinks: Sequence[UsageSink] = (),
    mode: AdmissionMode | None = None,
    extra_get_routes: Mapping[str, ExtraRoute] | None = None,
    query_get_routes: Mapping[str, QueryRoute] | None = None,
    on_rejected: Callable[[str, int], None] | None = None,
) -> ProxyApp:
    """The proxy as a node wires it: its limits from the settings, and standalone (the settings'
    API key and host) unless given another admission mode (the tracker link's)."""
    limits = ProxyLimits(
        max_body_bytes=settings.max_body_bytes, retry_after_s=settings.retry_after_s, max_tokens_cap=settings.max_tokens_cap
    )
    return ProxyApp(
        upstream=upstream,
        client=client,
        slots=slots,
        prompt_counter=prompt_counter,
        limits=limits,
        model_name=model_name,
        model_aliases=model_aliases,
        health=health,
        mode=mode or StandaloneMode(api_key=settings.api_key, allowed_hosts=[settings.host, *settings.allowed_hosts]),
        usage_sinks=usage_sinks,
        extra_get_routes=extra_get_routes,
        query_get_routes=query_get_routes,
        on_rejected=on_rejected,
    )


__all__ = ["METRICS_PATH", "build_listener", "build_proxy"]
