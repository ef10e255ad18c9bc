"""The tracker's app: its routes, its lifespan, and the node watch; every part built here, in order.

`Tracker` is the composition root of a reference tracker: it loads the key, opens the registry
and the ledger, and hands each job what it needs (enrolment, receipts, routing, forwarding). The
lifespan settles requests a previous run left in flight and, while the app serves, keeps the
tracker's clients open (`reach`) and watches the nodes: drops those whose heartbeats stopped,
forgets their ways in, and polls each one's health.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet_gguf.common.http1_client import HttpAnswer
from meshnet_gguf.common.private_files import private_dir
from meshnet_gguf.contract.openai_paths import INFERENCE_PATHS, MODELS_PATH
from meshnet_gguf.contract.protocol import PROTOCOL_VERSION, WELL_KNOWN_PATH, HealthReport, TrackerInfo
from meshnet_gguf.contract.signing import load_or_create_private_key, public_key_text, tracker_issuer_for
from meshnet_gguf.reference.tracker import page as tracker_page
from meshnet_gguf.reference.tracker.audits import Auditor
from meshnet_gguf.reference.tracker.config import TrackerConfig
from meshnet_gguf.reference.tracker.enrolment import Enrolment
from meshnet_gguf.reference.tracker.forwarding import ForwardEndpoint
from meshnet_gguf.reference.tracker.ledger import TRACKER_LEDGER_FILE, NodeEarnings, TrackerLedger
from meshnet_gguf.reference.tracker.metrics import TrackerMetrics
from meshnet_gguf.reference.tracker.node_calls import NodeCalls
from meshnet_gguf.reference.tracker.reach import NodeReach
from meshnet_gguf.reference.tracker.receipts import Receipts
from meshnet_gguf.reference.tracker.registry import NodeEntry, NodeRegistry
from meshnet_gguf.reference.tracker.relay_dialer import NodeDialer
from meshnet_gguf.reference.tracker.request_io import BoundedHeaders, model_response
from meshnet_gguf.reference.tracker.routing import RouteSigner

log = logging.getLogger(__name__)

TRACKER_KEY_FILE = "tracker_key.pem"
HEALTH_POLL_TIMEOUT_S = 2.0
# A node that says it is not ready is believed at once; one that merely failed to answer a
# poll (a busy box, a lost packet) keeps its routes until this many polls in a row failed.
HEALTH_MISSES_BEFORE_UNHEALTHY = 2


class Tracker:
    def __init__(self, config: TrackerConfig) -> None:
        self.config = config
        private_dir(Path(config.state_dir))
        key = load_or_create_private_key(Path(config.state_dir) / TRACKER_KEY_FILE)
        self.public_key_text = public_key_text(key.public_key())
        self.issuer = tracker_issuer_for(key.public_key())
        self.registry = NodeRegistry(config.ttl_s)
        self.ledger = TrackerLedger(Path(config.state_dir) / TRACKER_LEDGER_FILE)
        self.routes = RouteSigner(key, self.issuer, config)
        self.reach = NodeReach(self.routes.sign_connect, config.relay_tls)
        calls = NodeCalls(self.issuer)
        self.enrolment = Enrolment(config, self.registry, self.ledger, calls, self.reach, self.poll_soon)
        self.receipts = Receipts(self.ledger, calls)
        # Proof of model: None (nothing drawn, nothing kept, nobody probed) unless a verifier is named.
        self.auditor = (
            Auditor(config.verifiers, config.audit_policy, key, self.issuer, self.ledger, self.routes, self._send_to)
            if config.verifiers else None
        )  # fmt: skip
        if self.auditor is not None:
            self.enrolment.on_registered = self.auditor.registered
            self.registry.audited_models = frozenset(config.verifiers)
        self.forward = ForwardEndpoint(
            config, self.registry, self.ledger, self.routes, self.reach, self.poll_soon, self.receipts.flag_mismatch,
            self.auditor,
        )  # fmt: skip
        self.metrics = TrackerMetrics(self.registry, self.auditor)
        self._poll_wake = anyio.Event()

    def close(self) -> None:
        """Close the ledger; the app must not be serving any more."""
        self.ledger.close()

    def info(self) -> TrackerInfo:
        return TrackerInfo(
            issuer=self.issuer,
            public_key=self.public_key_text,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            ttl_s=self.config.ttl_s,
        )

    @property
    def dialer(self) -> NodeDialer:
        return self.reach.dialer

    # --- app ---------------------------------------------------------------
    def app(self) -> Starlette:
        enrolment, receipts = self.enrolment, self.receipts
        routes = [
            Route(WELL_KNOWN_PATH, self._well_known, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self.metrics.endpoint, methods=["GET"]),
            Route("/v1/nodes", self._nodes, methods=["GET"]),
            Route("/v1/nodes/register", enrolment.register, methods=["POST"]),
            Route("/v1/nodes/{node_id}/heartbeat", enrolment.heartbeat, methods=["POST"]),
            Route("/v1/nodes/{node_id}/deregister", enrolment.deregister, methods=["POST"]),
            Route("/v1/nodes/{node_id}/receipts", receipts.receive, methods=["POST"]),
            Route(MODELS_PATH, self._models, methods=["GET"]),
            Route("/v1/usage", receipts.usage_list, methods=["GET"]),
            Route("/v1/usage/{request_id}", receipts.usage, methods=["GET"]),
            *(Route(path, self.forward, methods=["POST"]) for path in INFERENCE_PATHS),
            *tracker_page.routes(self),
        ]
        return BoundedHeaders(Starlette(routes=routes, lifespan=self._lifespan))  # type: ignore[return-value]

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        for request_id in await self.ledger.settle_interrupted():
            log.warning("request %s was in flight when this tracker stopped: settled as interrupted, flagged", request_id)
        if self.auditor is not None:
            await self.auditor.load()  # before any node registers: one that failed here before stays unroutable
        async with self.reach.running(), anyio.create_task_group() as tg:
            tg.start_soon(self._watch_nodes)
            if self.auditor is not None:
                tg.start_soon(self.auditor.run, self.registry)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()

    async def _send_to(self, entry: NodeEntry, path: str, headers: dict[str, str], body: bytes) -> HttpAnswer:
        return await entry.target.send(self.reach.clients, "POST", path, headers, body)

    # --- node liveness -----------------------------------------------------
    def poll_soon(self) -> None:
        self._poll_wake.set()

    async def _watch_nodes(self) -> None:
        while True:
            self._poll_wake = anyio.Event()
            for node_id in self.registry.expire():
                log.warning("node %s missed its heartbeats for %.0f s; dropped", node_id, self.config.ttl_s)
            await self.dialer.forget_all_but(entry.node_id for entry in self.registry.all())
            async with anyio.create_task_group() as tg:
                for entry in self.registry.all():
                    tg.start_soon(self._poll_health, entry)
            with anyio.move_on_after(self.config.health_poll_interval_s):
                await self._poll_wake.wait()

    async def _poll_health(self, entry: NodeEntry) -> None:
        try:
            request = self.reach.request(entry, "GET", "/health")
            request.extensions["timeout"] = httpx.Timeout(HEALTH_POLL_TIMEOUT_S).as_dict()
            response = await self.reach.http.send(request)
            entry.health = HealthReport.model_validate_json(response.content)
            entry.speed.set_claim(entry.health.capability)
            healthy = response.status_code == 200 and entry.health.state == "ready"
            entry.health_misses = 0
        except (httpx.HTTPError, ValidationError) as exc:
            entry.health_misses += 1
            log.debug("health poll of %s failed (%d in a row): %s", entry.node_id, entry.health_misses, exc)
            healthy = entry.healthy and entry.health_misses < HEALTH_MISSES_BEFORE_UNHEALTHY
        if healthy != entry.healthy:
            log.info("node %s is %s", entry.node_id, "healthy" if healthy else "not healthy")
        entry.healthy = healthy

    # --- what anyone may read -------------------------------------------------
    async def _well_known(self, request: Request) -> Response:
        return model_response(self.info())

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "protocol_version": PROTOCOL_VERSION, "nodes": len(self.registry)})

    async def _nodes(self, request: Request) -> Response:
        flags = await self.ledger.flags_by_node()
        earnings_by_model = await self.ledger.billed_by_node_and_model()  # one pass over the ledger for both
        earnings = {node_id: NodeEarnings.summed(by_model.values()) for node_id, by_model in earnings_by_model.items()}
        return JSONResponse(
            [
                {
                    "node_id": e.node_id,
                    "model": e.announcement.model_id,
                    "state": e.state,
                    "healthy": e.healthy,
                    # The tracker's own word: online, healthy, heard from within its TTL, not blocked by proof.
                    "routable": self.registry.is_routable(e),
                    "last_seen_s_ago": round(self.registry.silent_s(e), 1),
                    "in_flight": e.in_flight,
                    "load": e.load.model_dump(),
                    "advertised_url": e.announcement.advertised_url,
                    "receipt_flags": flags.get(e.node_id, 0),
                    "speed": e.speed.summary(),
                    "models": tracker_page.models_view(self.registry, e, earnings_by_model.get(e.node_id, {})),
                    **tracker_page.market_view(self.registry, e, earnings.get(e.node_id)),
                    **(
                        {}
                        if self.auditor is None
                        else {"audits": self.auditor.record(e.node_id).summary(), "proof_blocked": e.proof_blocked}
                    ),  # fmt: skip
                    "announcement": e.announcement.model_dump(exclude={"public_key"}),
                }
                for e in self.registry.all()
            ]
        )

    async def _models(self, request: Request) -> Response:
        """Every model a routable node serves, with how many serve it and how many of those have it loaded."""
        data = [
            {"id": model, "object": "model", "created": 0, "owned_by": "meshnet", "meshnet_nodes": len(nodes),
             "meshnet_loaded_on": sum(1 for e in nodes if (m := e.model_for(model)) is not None and m.state == "loaded")}
            for model, nodes in sorted(self.registry.models().items())
            if nodes
        ]  # fmt: skip
        return JSONResponse({"object": "list", "data": data})


def create_app(config: TrackerConfig) -> Starlette:
    return Tracker(config).app()
