"""The node's listener: one table of rows (`serving/node_surface`) on the one HTTP server part. The node
supplies the handlers: the proxy (inference and models), the pages, the metrics, the tracker link's
control proof and, with `serve --verifier`, the audit door scored by `proof/audit`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import HealthReport
from meshnet_gguf.llama.model_children import ModelChildren
from meshnet_gguf.llama.upstream import UpstreamClient
from meshnet_gguf.ops.metrics import NodeMetrics
from meshnet_gguf.prepare.pipeline import NodeSetupError, PreparedLaunch
from meshnet_gguf.serving.access import LocalOrKey, PageAccess
from meshnet_gguf.serving.admission_modes import AdmissionMode, StandaloneMode
from meshnet_gguf.serving.audit_door import AuditDoor
from meshnet_gguf.serving.http_server import HttpServerPart, ListenError
from meshnet_gguf.serving.node_surface import METRICS_PATH, NodeDoors, node_table
from meshnet_gguf.serving.prompt_count import PromptCounter
from meshnet_gguf.serving.proxy import ProxyApp, ProxyLimits, UsageSink
from meshnet_gguf.serving.slots import Slots
from meshnet_gguf.serving.status_page import ChatUi, NodePages, RecentRequests, StatusSource, plan_line
from meshnet_gguf.serving.upstream_target import UpstreamTarget

if TYPE_CHECKING:
    from meshnet_gguf.mesh.tracker_link import TrackerLink

log = logging.getLogger(__name__)


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
    others: ModelChildren | None = None,
    models_status: Callable[[], list[dict[str, object]]] | None = None,
) -> HttpServerPart:
    """The node's one listener: its table, every row's handler supplied here."""
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
        on_rejected=metrics.count_request,
        others=others,
    )
    # The operator's pages; the chat only standalone (a meshed node's slots are the
    # tracker's), and only where llama-server has its web UI (a build without npm has none).
    features = launch.features
    chat = tracker_link is None and (features is None or features.web_ui is not False)
    pages = NodePages(
        status=StatusSource(
            health,
            recent_requests,
            plan_line(launch.plan.describe(with_argv=False) if launch.plan else None, settings.parallel),
            tracker=settings.tracker,
            chat=chat,
            llama_server=f"{launch.binary.describe()}; {features.describe()}" if features else launch.binary.describe(),
            llama_server_choice=launch.binary_choice.to_dict() if launch.binary_choice else None,
            models=models_status,
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
    table = node_table(
        NodeDoors(
            proxy,
            health,
            pages,
            metrics=metrics.scrape,
            # /metrics for local scrapes and the operator's key only: not for relayed or remote callers.
            metrics_access=LocalOrKey(is_relayed, settings.metrics_key),
            control=tracker_link.control_route if tracker_link else None,
            # serve --verifier: the tracker's audits of this model, on this listener, scored by this node's llama-server.
            audit=_audit_door(settings, upstream, slots, tracker_link) if settings.verifier else None,
        )
    )
    try:
        return HttpServerPart(table, settings.host, settings.port)
    except ListenError as exc:
        raise NodeSetupError(str(exc)) from exc


def _audit_door(
    settings: NodeSettings, upstream: Callable[[], UpstreamTarget | None], slots: Slots, tracker_link: TrackerLink | None
) -> AuditDoor:
    """`POST /v1/proof/audit`, scored by `proof/audit`. Audits are signed by the tracker this node trusts:
    a meshed node's route key (configured, pinned, or learnt on first contact), else `tracker_public_key`.
    Each takes one of the node's slots, as a request does; the relay's callers never see the path (its row)."""
    from meshnet_gguf.contract.model_proof import AUDIT_PATH
    from meshnet_gguf.contract.signing import KeyFormatError, parse_public_key
    from meshnet_gguf.proof.audit import audit

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

    log.info("verifier: this node answers the tracker's audits at %s", AUDIT_PATH)
    return AuditDoor(audit, scorer, key, acquire_slot=lambda: None if slots.draining else slots.try_acquire())


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
    on_rejected: Callable[[str, int], None] | None = None,
    others: ModelChildren | None = None,
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
        on_rejected=on_rejected,
        others=others,
    )


__all__ = ["METRICS_PATH", "build_listener", "build_proxy"]
