"""The tracker's page: the nodes it knows, the requests it routed lately, and usage disagreements.

Static files in `pages/` (no build step, no data in them) poll `/dashboard.json`,
which is built from the same registry and ledger as `/v1/nodes` and `/v1/usage`
(both already public on a reference tracker; a node's audits too, where a verifier audits its model, and
what it got: its share of the last requests and its earnings, `market_view`), plus what only the page wants:
how long ago each node was last heard from and whether it is reached directly or
through a relay. `routes()` is all `Tracker.app()` needs to add.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet_gguf.common.page_files import PAGE_SECURITY_HEADERS, read_page_file, static_files
from meshnet_gguf.contract.protocol import TrackerUsage
from meshnet_gguf.reference.tracker.ledger import NodeEarnings

PAGES_DIR = Path(__file__).parent / "pages"
DASHBOARD_JSON_PATH = "/dashboard.json"
# Routed requests the page lists; the ledger keeps them all, the page shows the latest.
RECENT_ROUTES_SHOWN = 50
# How often the page polls; a tracker with a few nodes answers this in a millisecond or two.
DASHBOARD_POLL_S = 2.0
# The page's files, path -> (file, content type).
STATIC_FILES = static_files(PAGES_DIR, "tracker", own_stylesheet=True)


class _Registry(Protocol):
    def all(self) -> list[Any]: ...

    def recent_share(self, entry: Any, model_id: str | None = None) -> tuple[int, int]: ...

    def silent_s(self, entry: Any) -> float: ...


class _Ledger(Protocol):
    async def usage_list(self, *, request_id: str | None = None, limit: int = 100) -> list[TrackerUsage]: ...

    async def billed_by_node_and_model(self) -> dict[str, dict[str, NodeEarnings]]: ...


class _Tracker(Protocol):
    registry: _Registry
    ledger: _Ledger


def routes(tracker: _Tracker) -> list[Route]:
    """The page's routes, to add to the tracker's app."""

    async def static(request: Request) -> Response:
        file, content_type = STATIC_FILES[request.url.path]
        return Response(read_page_file(file), media_type=content_type, headers=PAGE_SECURITY_HEADERS)

    async def dashboard(request: Request) -> Response:
        return JSONResponse(await dashboard_document(tracker), headers={"cache-control": "no-store"})

    return [
        *(Route(path, static, methods=["GET"]) for path in STATIC_FILES),
        Route(DASHBOARD_JSON_PATH, dashboard, methods=["GET"]),
    ]


def market_view(registry: _Registry, entry: Any, earned: NodeEarnings | None) -> dict[str, Any]:
    """What the node got here, shown beside its speed on the page and in `/v1/nodes`: its share of its
    model's last requests (`market.RECENT_REQUESTS`) and what it earned (billed) on this tracker, ever."""
    requests, of_last = registry.recent_share(entry)
    earned = earned or NodeEarnings(0, 0, 0)
    return {
        "recent_share": {"requests": requests, "of_last": of_last, "share": round(requests / of_last, 3) if of_last else None},
        "earned": {"requests": earned.requests, "prompt_tokens": earned.prompt_tokens, "completion_tokens": earned.completion_tokens},
    }


def models_view(registry: _Registry, entry: Any, earned: dict[str, NodeEarnings]) -> list[dict[str, Any]]:
    """Every model the node announced, in its order: its state there (loaded, loadable with its expected load,
    unavailable), what a cold load adds to a first token now, its requests in flight, its share of the model's
    last requests and what the node earned serving it."""
    now = time.monotonic()
    shown = []
    for model in entry.models.values():
        requests, of_last = registry.recent_share(entry, model.model_id)
        got = earned.get(model.model_id) or NodeEarnings(0, 0, 0)
        shown.append(
            {
                **model.view(now),
                "recent_share": {"requests": requests, "of_last": of_last},
                "earned": {"requests": got.requests, "prompt_tokens": got.prompt_tokens, "completion_tokens": got.completion_tokens},
            }
        )
    return shown


async def dashboard_document(tracker: _Tracker) -> dict[str, Any]:
    earnings_by_model = await tracker.ledger.billed_by_node_and_model()  # one pass over the ledger for both
    earnings = {node_id: NodeEarnings.summed(by_model.values()) for node_id, by_model in earnings_by_model.items()}
    nodes = []
    for entry in tracker.registry.all():
        announcement = entry.announcement
        health = entry.health
        nodes.append(
            {
                "node_id": entry.node_id,
                "model": announcement.model_id,
                "quant": announcement.quant,
                "state": entry.state,
                "node_state": health.state if health is not None else None,
                "healthy": entry.healthy,
                "slots_total": announcement.slots,
                "slots_busy": entry.slots_busy(),
                "tokens_per_s": entry.load.recent_tokens_per_s,
                "reached": "relayed" if announcement.relay is not None else "direct",
                "relay_url": announcement.relay.url if announcement.relay is not None else None,
                "advertised_url": announcement.advertised_url,
                "last_seen_s_ago": round(tracker.registry.silent_s(entry), 1),
                "health_misses": entry.health_misses,
                "routed": entry.routed,
                "speed": entry.speed.summary(),
                "models": models_view(tracker.registry, entry, earnings_by_model.get(entry.node_id, {})),
                **market_view(tracker.registry, entry, earnings.get(entry.node_id)),
                "audits": _audits(tracker, entry),
            }
        )
    usage = await tracker.ledger.usage_list(limit=RECENT_ROUTES_SHOWN)
    return {
        "nodes": nodes,
        "recent_routes": [u.model_dump(mode="json") for u in usage],
        "disagreements": sum(u.flagged for u in usage),
        "poll_interval_s": DASHBOARD_POLL_S,
    }


def _audits(tracker: _Tracker, entry: Any) -> dict[str, Any] | None:
    """Proof of model on the page: the node's audit counts and its latest verdict; None when no verifier
    audits its model here (the page says "not audited")."""
    auditor = getattr(tracker, "auditor", None)
    if auditor is None or auditor.verifier_for(entry) is None:
        return None
    return {**auditor.record(entry.node_id).summary(), "proof_blocked": entry.proof_blocked}


__all__ = ["DASHBOARD_JSON_PATH", "dashboard_document", "market_view", "models_view", "routes"]
