"""The node's HTTP surface, whole: every (method, path) its listener answers, who may call it, and what answers.

| rows                                            | guard                                   | handler                |
|-------------------------------------------------|-----------------------------------------|------------------------|
| GET, HEAD /health                               | anyone (trackers, load balancers)       | the health report      |
| POST /v1/chat/completions, /v1/completions,     | the admission mode, in the handler:     | `ProxyApp` forwards    |
|   /v1/embeddings                                |   key and Host, or the tracker's route  |                        |
| GET /v1/models, /v1/models/{id}                 | the admission mode's listing rule       | `ModelListing`         |
| GET, HEAD the page's files; GET /status.json    | anyone; `PageAccess`                    | `NodePages`            |
| /chat, /chat/... (standalone, with a web UI)    | anyone; `PageAccess` for props; the     | `NodePages`, and the   |
|                                                 |   chat's API calls as the proxy's rows  |   proxy's handlers     |
| GET /metrics                                    | `LocalOrKey`: this machine, not relayed,| the node's counters    |
|                                                 |   or the operator's key                 |                        |
| GET the control path (meshed)                   | anyone: the answer is signed            | the tracker link       |
| POST /v1/proof/audit (`serve --verifier`)       | `NotRelayed`, then the audit token      | `AuditDoor`            |

The inference rows' guard is open in the table because the admission mode's grant (the route's id and
token cap) travels with the request into the forward; it runs before a byte of the body is read.
`node_table` builds the table from what the node hands in; `tests/serving/test_node_surface.py` plays
the attacker against each of its rows.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from meshnet_gguf.common.asgi import JSON_HEADER, ExtraRoute, QueryRoute, respond
from meshnet_gguf.contract.openai_paths import INFERENCE_PATHS, MODEL_PATH_PREFIX, MODELS_PATH
from meshnet_gguf.contract.protocol import HealthReport
from meshnet_gguf.serving.access import LocalOrKey
from meshnet_gguf.serving.audit_door import AuditDoor, audit_route
from meshnet_gguf.serving.proxy import ProxyApp
from meshnet_gguf.serving.routes import Request, Route, RouteTable, open_to_all
from meshnet_gguf.serving.status_page import CHAT_PREFIX, NodePages

HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
# The inference rows' guard: the admission mode, which the proxy runs first thing in its handler.
admission_in_handler = open_to_all


@dataclass(frozen=True)
class NodeDoors:
    """What a node hands its listener: the proxy, and each door it opens."""

    proxy: ProxyApp
    health: Callable[[], HealthReport]
    pages: NodePages | None = None
    # `GET /metrics`: the node's counters, and who may read them.
    metrics: ExtraRoute | None = None
    metrics_access: LocalOrKey = field(default_factory=LocalOrKey)
    # A meshed node's `GET` of the tracker's reachability challenge: its path and its answer.
    control: tuple[str, QueryRoute] | None = None
    # `serve --verifier`: the tracker's audits, hidden from the relay's callers (the metrics' rule knows them).
    audit: AuditDoor | None = None


def node_table(doors: NodeDoors) -> RouteTable:
    """The node listener's one app: every row of the table above."""
    proxy = doors.proxy
    health = partial(_serve_health, doors.health, proxy.limits.retry_after_s)
    rows = [
        Route("GET", HEALTH_PATH, open_to_all, health),
        Route("HEAD", HEALTH_PATH, open_to_all, health),
        *inference_rows(proxy),
    ]
    if doors.pages is not None:
        rows += doors.pages.rows()
        if doors.pages.chat is not None:
            # The web UI's own API calls, answered as the proxy's rows of the same name.
            chat = CHAT_PREFIX.rstrip("/")
            rows += [
                Route("POST", chat + "/v1/chat/completions", admission_in_handler, _inference(proxy, "/v1/chat/completions"), proxy.limits.max_body_bytes),
                Route("GET", chat + MODELS_PATH, admission_in_handler, proxy.listing.serve_models),
            ]  # fmt: skip
    if doors.metrics is not None:
        rows.append(Route("GET", METRICS_PATH, doors.metrics_access, partial(_serve_scrape, doors.metrics)))
    if doors.control is not None:
        path, answer = doors.control
        rows.append(Route("GET", path, open_to_all, partial(_serve_query, answer)))
    if doors.audit is not None:
        rows.append(audit_route(doors.audit, doors.metrics_access.relayed))
    return RouteTable(rows)


def inference_rows(proxy: ProxyApp) -> list[Route]:
    """The OpenAI rows: the inference routes and the model listing, each admitted by the proxy's mode."""
    limit = proxy.limits.max_body_bytes
    return [
        *(Route("POST", path, admission_in_handler, _inference(proxy, path), limit) for path in INFERENCE_PATHS),
        Route("GET", MODELS_PATH, admission_in_handler, proxy.listing.serve_models),
        Route("GET", MODEL_PATH_PREFIX, admission_in_handler, proxy.listing.serve_model, prefix=True),
    ]


def _inference(proxy: ProxyApp, path: str) -> Callable[[Request], Awaitable[None]]:
    return partial(proxy.serve_inference, path=path)


async def _serve_health(health: Callable[[], HealthReport], retry_after_s: int, request: Request) -> None:
    """200 when ready, else 503 with when to ask again."""
    report = health()
    ready = report.state == "ready"
    headers = [JSON_HEADER, (b"cache-control", b"no-cache")]
    if not ready:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    await respond(request.send, 200 if ready else 503, report.model_dump_json().encode(), headers)


async def _serve_scrape(scrape: ExtraRoute, request: Request) -> None:
    await _respond_whole(request, await scrape())


async def _serve_query(answer: QueryRoute, request: Request) -> None:
    await _respond_whole(request, await answer(request.query))


async def _respond_whole(request: Request, answer: tuple[int, bytes, str]) -> None:
    status, body, content_type = answer
    await respond(request.send, status, body, [(b"content-type", content_type.encode())])


__all__ = ["HEALTH_PATH", "METRICS_PATH", "NodeDoors", "inference_rows", "node_table"]
