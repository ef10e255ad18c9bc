"""Reference Meshnet tracker: registers nodes, routes each OpenAI request to one whole-model node
with a signed single-hop route, forwards the answer unbuffered, and keeps its own usage ledger.

It speaks only the contract in `docs/protocol.md` (through `meshnet_gguf.contract.protocol`
and the floor-1 helpers); it knows nothing of how a node works inside.
Run it with `meshnet-gguf dev tracker`.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import os
import secrets
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet_gguf.common.http1_client import Http1Client, Http1Response, HttpClientError, HttpConnectError
from meshnet_gguf.common.private_files import private_dir
from meshnet_gguf.contract.errors import ApiError, openai_error_body
from meshnet_gguf.contract.protocol import (
    CLOCK_SKEW_S,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    ENROLMENT_HEADER,
    MAX_ROUTE_LIFETIME_S,
    NODE_AUTH_LIFETIME_S,
    NODE_CONTROL_NONCE_PARAM,
    NODE_CONTROL_PATH,
    NODE_TTL_HEARTBEATS,
    PROTOCOL_VERSION,
    REQUEST_ID_HEADER,
    ROUTE_HEADER,
    USAGE_COMPLETION_TOKENS_HEADER,
    USAGE_PROMPT_TOKENS_HEADER,
    WELL_KNOWN_PATH,
    Deregistration,
    HealthReport,
    Heartbeat,
    HeartbeatAck,
    NodeAnnouncement,
    NodeControlClaims,
    NodeControlProof,
    ReceiptAck,
    ReceiptBatch,
    ReceiptClaims,
    ReceiptRejection,
    RegistrationAck,
    RouteClaims,
    RouteHop,
    TrackerInfo,
    UsageReceipt,
)
from meshnet_gguf.contract.signing import (
    KeyFormatError,
    body_sha256,
    decode_token,
    encode_token,
    load_or_create_private_key,
    node_id_for,
    parse_public_key,
    public_key_text,
    tracker_issuer_for,
    unverified_claims,
)
from meshnet_gguf.reference import tracker_page
from meshnet_gguf.reference.metering import ForwardMeter, prompt_ceiling
from meshnet_gguf.reference.node_address import AddressPolicy, NodeTarget, UnsafeNodeURL, pin_node_url
from meshnet_gguf.reference.registry import NodeEntry, NodeRegistry
from meshnet_gguf.reference.relay_dialer import NodeDialer, RelayedNodeTarget, new_connect_claims
from meshnet_gguf.reference.tracker_ledger import TRACKER_LEDGER_FILE, ForwardedRequest, Outcome, TrackerLedger

log = logging.getLogger(__name__)

TRACKER_KEY_FILE = "tracker_key.pem"
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
GENERATING_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")
# Half the contract's ceiling: plenty for a request to reach its node, little to replay.
DEFAULT_ROUTE_LIFETIME_S = 30
# A CONNECT token opens one connection to one node through one relay, at once (contract ceiling: 60 s).
CONNECT_TOKEN_LIFETIME_S = 30
# Health polls catch a node that heartbeats but cannot serve (llama-server restarting).
DEFAULT_HEALTH_POLL_INTERVAL_S = 5.0
HEALTH_POLL_TIMEOUT_S = 2.0
# A node that says it is not ready is believed at once; one that merely failed to answer a
# poll (a busy box, a lost packet) keeps its routes until this many polls in a row failed.
HEALTH_MISSES_BEFORE_UNHEALTHY = 2
# Same default as the node's own body limit: larger requests would be refused there anyway.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Applied when a client names no limit, so every route carries a finite max_tokens.
DEFAULT_MAX_TOKENS_CAP = 4096
# A node that refuses the connection never saw the request, so one more node may be tried.
MAX_ROUTE_ATTEMPTS = 2
FORWARD_CONNECT_TIMEOUT_S = 5.0
# Between two chunks of an answer: a 100 GB model may prefill a long prompt for minutes.
FORWARD_READ_TIMEOUT_S = 600.0
# Shorter than a node's idle keep-alive (uvicorn closes after 5 s): httpcore skips connections
# it sees closed, but a close racing the reuse still fails the POST, which cannot be retried.
FORWARD_KEEPALIVE_EXPIRY_S = 2.0
# Connections kept to plain-http nodes by the lean forwarding client (beyond them, new ones open).
DIRECT_FORWARD_CONNECTIONS = 64
# Registration bodies are small; anything bigger is not a node talking.
MAX_CONTROL_BODY_BYTES = 1024 * 1024
# Longest any forwarded request may take, first byte to last: a stuck node frees the tracker.
# An hour covers a 32k-token answer at 10 tokens/s with room to spare.
DEFAULT_FORWARD_TOTAL_TIMEOUT_S = 3600.0
# All request headers together (names and values). Clients send well under 8 KiB; a route
# token and an auth header are under 2 KiB each.
MAX_REQUEST_HEADER_BYTES = 32 * 1024
# `GET /v1/usage?limit=N`: N is 1..this.
MAX_USAGE_LIST_LIMIT = 10_000
DEFAULT_USAGE_LIST_LIMIT = 100
# Node tokens remembered at once (each for its lifetime, at most a minute): far more calls a minute than
# a fleet's heartbeats and receipts make, and a few MB at most.
MAX_REMEMBERED_NODE_TOKENS = 200_000
# The node's answer to a control challenge: one small JSON object, quickly.
CONTROL_PROOF_TIMEOUT_S = 5.0
MAX_CONTROL_PROOF_BYTES = 16 * 1024
CONTROL_NONCE_BYTES = 32
# A receipt signed this far in the future (a node clock running ahead) is left for a later resend;
# further than this it is refused for good.
FUTURE_RECEIPT_RETRY_WINDOW_S = 300
# A chat template wraps each prompt in role markers and sometimes a default system prompt; a
# prompt cannot hold more tokens than its body has bytes plus this.
PROMPT_TEMPLATE_ALLOWANCE_TOKENS = 2048
# The only node response headers a client sees: the answer's type and the Meshnet accounting.
FORWARDED_RESPONSE_HEADERS = frozenset(
    {
        "content-type",
        "cache-control",
        "x-accel-buffering",
        "retry-after",
        "x-request-id",
        REQUEST_ID_HEADER.lower(),
        USAGE_PROMPT_TOKENS_HEADER.lower(),
        USAGE_COMPLETION_TOKENS_HEADER.lower(),
    }
)


@dataclass(frozen=True)
class TrackerConfig:
    """`enrolment_secret` is required unless `open_enrolment` says anyone may register a node."""

    state_dir: Path
    enrolment_secret: str | None = None
    open_enrolment: bool = False
    addresses: AddressPolicy = AddressPolicy()
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    route_lifetime_s: int = DEFAULT_ROUTE_LIFETIME_S
    health_poll_interval_s: float = DEFAULT_HEALTH_POLL_INTERVAL_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP
    forward_total_timeout_s: float = DEFAULT_FORWARD_TOTAL_TIMEOUT_S
    # How https relays are checked [default: the system's CAs]; the relay's host name is always checked.
    relay_tls: ssl.SSLContext | None = None

    def __post_init__(self) -> None:
        if not 0 < self.route_lifetime_s <= MAX_ROUTE_LIFETIME_S:
            raise ValueError(f"route lifetime must be 1..{MAX_ROUTE_LIFETIME_S} s")
        if not self.enrolment_secret and not self.open_enrolment:
            raise ValueError("set an enrolment secret, or open enrolment explicitly (anyone may then register nodes)")

    @property
    def ttl_s(self) -> float:
        return self.heartbeat_interval_s * NODE_TTL_HEARTBEATS


ENROLMENT_SECRET_FILE = "enrolment_secret"
ENROLMENT_SECRET_BYTES = 24
SECRET_FILE_MODE = 0o600


def load_or_create_enrolment_secret(state_dir: Path) -> str:
    """The tracker's enrolment secret, made once (mode 0600) so nodes keep working across restarts."""
    path = Path(state_dir) / ENROLMENT_SECRET_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path.with_name(f".{path.name}.{os.getpid()}.tmp"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, SECRET_FILE_MODE)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(ENROLMENT_SECRET_BYTES) + "\n")
        os.replace(path.with_name(f".{path.name}.{os.getpid()}.tmp"), path)
    return path.read_text().strip()


class Tracker:
    def __init__(self, config: TrackerConfig) -> None:
        self.config = config
        private_dir(Path(config.state_dir))
        self._key = load_or_create_private_key(Path(config.state_dir) / TRACKER_KEY_FILE)
        self.public_key_text = public_key_text(self._key.public_key())
        self.issuer = tracker_issuer_for(self._key.public_key())
        self.registry = NodeRegistry(config.ttl_s)
        self.ledger = TrackerLedger(Path(config.state_dir) / TRACKER_LEDGER_FILE)
        self._http: httpx.AsyncClient | None = None
        self._dialer: NodeDialer | None = None
        # Requests to plain-http nodes go through this instead of httpx: ~0.1 ms a streamed
        # request to its first chunk against httpx's 0.8-1.0 ms (bench/http_client_cost.py).
        # A relayed node's requests go through its target's own lean client; https nodes keep
        # httpx. A node's uvicorn keeps a streamed answer's connection, so it is reused.
        self._direct: Http1Client | None = None
        self._poll_wake = anyio.Event()
        self.used_node_tokens = _UsedNodeTokens()

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

    # --- app ---------------------------------------------------------------
    def app(self) -> Starlette:
        forward = _ForwardEndpoint(self)
        routes = [
            Route(WELL_KNOWN_PATH, self._well_known, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/v1/nodes", self._nodes, methods=["GET"]),
            Route("/v1/nodes/register", self._register, methods=["POST"]),
            Route("/v1/nodes/{node_id}/heartbeat", self._heartbeat, methods=["POST"]),
            Route("/v1/nodes/{node_id}/deregister", self._deregister, methods=["POST"]),
            Route("/v1/nodes/{node_id}/receipts", self._receipts, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/usage", self._usage_list, methods=["GET"]),
            Route("/v1/usage/{request_id}", self._usage, methods=["GET"]),
            *(Route(path, forward, methods=["POST"]) for path in INFERENCE_PATHS),
            *tracker_page.routes(self),
        ]
        return _BoundedHeaders(Starlette(routes=routes, lifespan=self._lifespan))  # type: ignore[return-value]

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        timeout = httpx.Timeout(FORWARD_READ_TIMEOUT_S, connect=FORWARD_CONNECT_TIMEOUT_S, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=FORWARD_KEEPALIVE_EXPIRY_S)
        # The dialer is the client's transport: direct to most nodes, through its relay to a relayed one.
        self._dialer = NodeDialer(limits, self.sign_connect, relay_tls=self.config.relay_tls)
        for request_id in await self.ledger.settle_interrupted():
            log.warning("request %s was in flight when this tracker stopped: settled as interrupted, flagged", request_id)
        async with httpx.AsyncClient(timeout=timeout, transport=self._dialer, trust_env=False) as http:
            self._http = http
            self._direct = Http1Client(
                DIRECT_FORWARD_CONNECTIONS, peer="node", read_idle_timeout_s=FORWARD_READ_TIMEOUT_S,
                connect_timeout_s=FORWARD_CONNECT_TIMEOUT_S, keep_streamed=True, idle_ttl_s=FORWARD_KEEPALIVE_EXPIRY_S,
            )  # fmt: skip
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._watch_nodes)
                    try:
                        yield
                    finally:
                        tg.cancel_scope.cancel()
            finally:
                await self._direct.aclose()
                self._direct = None
                self._http = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("tracker app is not running (lifespan not started)")
        return self._http

    @property
    def dialer(self) -> NodeDialer:
        if self._dialer is None:
            raise RuntimeError("tracker app is not running (lifespan not started)")
        return self._dialer

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

    async def forward(self, entry: NodeEntry, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response | LeanAnswer:
        """POST a routed request to the node; its answer's head has arrived, its body is not read.
        A plain-http or relayed node is reached with the lean client (a relayed one's own, whose
        connections are tunnels through its relay), an https one through httpx and the dialer.
        Raises HttpConnectError or httpx's connect errors when the node never saw the request."""
        target = entry.target
        if isinstance(target, NodeTarget) and target.scheme == "http" and self._direct is not None:
            sent = {**headers, "host": target.host_header}
            return LeanAnswer(await self._direct.send("POST", target.pinned_url(path), sent, body))
        if isinstance(target, RelayedNodeTarget) and target.client is not None:
            return LeanAnswer(await target.client.send("POST", target.forward_url(path), headers, body))
        return await self.http.send(self.node_request(entry, "POST", path, content=body, headers=headers), stream=True)

    def node_request(self, entry: NodeEntry | NodeTarget, method: str, path: str, **kw: Any) -> httpx.Request:
        """How this tracker reaches a node: the one place, so a node reached another way
        (through a relay) changes this and nothing else."""
        target = entry.target if isinstance(entry, NodeEntry) else entry
        return target.request(self.http, method, path, **kw)

    async def _poll_health(self, entry: NodeEntry) -> None:
        try:
            request = self.node_request(entry, "GET", "/health")
            request.extensions["timeout"] = httpx.Timeout(HEALTH_POLL_TIMEOUT_S).as_dict()
            response = await self.http.send(request)
            entry.health = HealthReport.model_validate_json(response.content)
            healthy = response.status_code == 200 and entry.health.state == "ready"
            entry.health_misses = 0
        except (httpx.HTTPError, ValidationError) as exc:
            entry.health_misses += 1
            log.debug("health poll of %s failed (%d in a row): %s", entry.node_id, entry.health_misses, exc)
            healthy = entry.healthy and entry.health_misses < HEALTH_MISSES_BEFORE_UNHEALTHY
        if healthy != entry.healthy:
            log.info("node %s is %s", entry.node_id, "healthy" if healthy else "not healthy")
        entry.healthy = healthy

    # --- control endpoints ------------------------------------------------
    async def _well_known(self, request: Request) -> Response:
        return _model_response(self.info())

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "protocol_version": PROTOCOL_VERSION, "nodes": len(self.registry)})

    async def _nodes(self, request: Request) -> Response:
        flags = await self.ledger.flags_by_node()
        return JSONResponse(
            [
                {
                    "node_id": e.node_id,
                    "model": e.announcement.model_id,
                    "state": e.state,
                    "healthy": e.healthy,
                    "in_flight": e.in_flight,
                    "load": e.load.model_dump(),
                    "advertised_url": e.announcement.advertised_url,
                    "receipt_flags": flags.get(e.node_id, 0),
                    "announcement": e.announcement.model_dump(exclude={"public_key"}),
                }
                for e in self.registry.all()
            ]
        )

    async def _register(self, request: Request) -> Response:
        try:
            body = await _control_body(request)
            announcement = _parse(NodeAnnouncement, body)
            if announcement.protocol_version.split(".")[0] != PROTOCOL_VERSION.split(".")[0]:
                raise ApiError(409, "unsupported_protocol", f"tracker speaks protocol {PROTOCOL_VERSION}")
            self._check_enrolment(request)
            try:
                key = parse_public_key(announcement.public_key)
            except KeyFormatError as exc:
                raise ApiError(400, "bad_public_key", str(exc)) from None
            if node_id_for(key) != announcement.node_id:
                raise ApiError(400, "node_id_mismatch", "node_id is not derived from public_key")
            _verify_node_call(request, body, announcement.node_id, key, self.issuer, self.used_node_tokens)
            if not announcement.full_coverage:
                raise ApiError(
                    422, "partial_coverage_unsupported", "this tracker routes single-hop only; a node must hold every layer"
                )
            # Only an enrolled, authenticated node makes this tracker send anything anywhere.
            try:
                target = await pin_node_url(announcement.advertised_url, self.config.addresses)
            except UnsafeNodeURL as exc:
                raise ApiError(422, "unsafe_advertised_url", str(exc)) from None
            if announcement.relay is not None:  # reached only through its relay, TLS pinned to its certificate
                target = await self.dialer.through_relay(announcement, self.config.addresses)  # type: ignore[assignment]
            try:
                await self._prove_control(target, announcement.node_id, key)
                await self.ledger.remember_node(announcement.node_id, announcement.public_key)
            except BaseException:
                if isinstance(target, RelayedNodeTarget):
                    with anyio.CancelScope(shield=True):
                        await self.dialer.discard(target)  # a failed registration keeps nothing
                raise
        except ApiError as refusal:
            log.warning("registration refused (%s): %s", refusal.code, refusal.message)
            return _error_response(refusal)
        # Adopted and registered with no await between: the node watch forgets every adopted way in
        # that is not registered (closing its tunnels), so it must never see one without the other.
        if isinstance(target, RelayedNodeTarget):
            self.dialer.adopt(target)
        _, displaced = self.registry.register(announcement, target)
        for node_id in displaced:
            log.warning("node %s displaced: %s now answers at its URL with its own key", node_id, announcement.node_id)
        self.poll_soon()
        log.info(
            "node %s registered: %s at %s (%s)",
            announcement.node_id, announcement.model_id, announcement.advertised_url, announcement.state,
        )
        return _model_response(
            RegistrationAck(
                node_id=announcement.node_id,
                issuer=self.issuer,
                heartbeat_interval_s=self.config.heartbeat_interval_s,
                ttl_s=self.config.ttl_s,
            )
        )

    async def _prove_control(self, target: NodeTarget, node_id: str, key: Ed25519PublicKey) -> None:
        """Whatever answers at the advertised URL must sign our fresh nonce with the node's key.

        Another node's URL, or a server that is not a node, cannot: so nobody routes prompts
        elsewhere by registering someone else's address.
        """
        nonce = base64.urlsafe_b64encode(secrets.token_bytes(CONTROL_NONCE_BYTES)).rstrip(b"=").decode()
        request = self.node_request(target, "GET", NODE_CONTROL_PATH, params={NODE_CONTROL_NONCE_PARAM: nonce})
        request.extensions["timeout"] = httpx.Timeout(CONTROL_PROOF_TIMEOUT_S).as_dict()
        unproven = f"{target.url} did not prove it holds node {node_id}'s key"
        try:
            with anyio.fail_after(CONTROL_PROOF_TIMEOUT_S):
                response = await self.http.send(request, stream=True)
                try:
                    raw = bytearray()
                    async for chunk in response.aiter_raw():
                        raw += chunk
                        if len(raw) > MAX_CONTROL_PROOF_BYTES:
                            raise ApiError(422, "control_unproven", f"{unproven}: its answer is too long")
                finally:
                    await response.aclose()
        except (httpx.HTTPError, TimeoutError) as exc:
            raise ApiError(422, "control_unproven", f"{unproven}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise ApiError(422, "control_unproven", f"{unproven}: GET {NODE_CONTROL_PATH} answered {response.status_code}")
        try:
            proof = NodeControlProof.model_validate_json(bytes(raw))
            claims = NodeControlClaims.model_validate(
                decode_token(proof.token, key, required=["iss", "aud", "nonce", "iat"], leeway=CLOCK_SKEW_S, audience=self.issuer)
            )
        except (ValidationError, jwt.InvalidTokenError) as exc:
            raise ApiError(422, "control_unproven", f"{unproven}: {exc}") from None
        if claims.iss != node_id or not hmac.compare_digest(claims.nonce, nonce):
            raise ApiError(422, "control_unproven", f"{unproven}: the answer is for another node or another challenge")

    def _check_enrolment(self, request: Request) -> None:
        expected = self.config.enrolment_secret
        if expected is None:
            return
        given = request.headers.get(ENROLMENT_HEADER, "")
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise ApiError(401, "bad_enrolment_secret", f"registration needs the tracker's enrolment secret in {ENROLMENT_HEADER}")

    async def _heartbeat(self, request: Request) -> Response:
        node_id = request.path_params["node_id"]
        try:
            entry, body = await self._registered_call(request, node_id)
            beat = _parse(Heartbeat, body)
        except ApiError as refusal:
            return _error_response(refusal)
        was = entry.state
        self.registry.heartbeat(node_id, beat.state, beat.load)
        if beat.state != was:
            log.info("node %s: %s -> %s", node_id, was, beat.state)
            self.poll_soon()
        return _model_response(HeartbeatAck(ttl_s=self.config.ttl_s))

    async def _deregister(self, request: Request) -> Response:
        node_id = request.path_params["node_id"]
        try:
            _, body = await self._registered_call(request, node_id)
            reason = _parse(Deregistration, body).reason
        except ApiError as refusal:
            return _error_response(refusal)
        self.registry.remove(node_id)
        log.info("node %s deregistered (%s)", node_id, reason)
        return JSONResponse({})

    async def _registered_call(self, request: Request, node_id: str) -> tuple[NodeEntry, bytes]:
        """The entry of a registered node and the body of its call, signed with its registered key."""
        entry = self._registered(node_id)
        body = await _control_body(request)
        _verify_node_call(request, body, node_id, parse_public_key(entry.announcement.public_key), self.issuer, self.used_node_tokens)
        return entry, body

    def _registered(self, node_id: str) -> NodeEntry:
        entry = self.registry.get(node_id)
        if entry is None:
            raise ApiError(404, "unknown_node", f"node {node_id} is not registered; register again")
        return entry

    async def _receipts(self, request: Request) -> Response:
        node_id = request.path_params["node_id"]
        try:
            # Keys are kept in the ledger, so receipts verify even before the node re-registers
            # after a tracker restart.
            key_text = await self.ledger.node_key(node_id)
            if key_text is None:
                raise ApiError(404, "unknown_node", f"node {node_id} never registered here")
            key = parse_public_key(key_text)
            body = await _control_body(request)
            _verify_node_call(request, body, node_id, key, self.issuer, self.used_node_tokens)
            batch = _parse(ReceiptBatch, body)
            if batch.node_id != node_id:
                raise ApiError(400, "wrong_node", "batch node_id differs from the path")
        except ApiError as refusal:
            return _error_response(refusal)
        ack = ReceiptAck()
        for receipt in batch.receipts:
            try:
                await self._accept_receipt(node_id, key, receipt)
            except _NotYet as later:
                log.warning("receipt %s from %s left for a resend: %s", receipt.request_id, node_id, later)
                continue
            except ApiError as refusal:
                log.warning("receipt %s from %s refused: %s", receipt.request_id, node_id, refusal.message)
                ack.rejected.append(ReceiptRejection(request_id=receipt.request_id, code=refusal.code, message=refusal.message))
            else:
                ack.accepted.append(receipt.request_id)
        return _model_response(ack)

    async def _accept_receipt(self, node_id: str, key: Ed25519PublicKey, receipt: UsageReceipt) -> None:
        try:
            raw = decode_token(receipt.token, key, required=["iss", "jti", "iat", "usage"], leeway=CLOCK_SKEW_S)
            claims = ReceiptClaims.model_validate(raw)
        except jwt.InvalidSignatureError:
            raise ApiError(400, "bad_signature", "receipt signature does not match the node key") from None
        except jwt.ImmatureSignatureError:
            # The signature checked out; only the node's clock runs ahead. Within the window it is
            # left unsettled, so the node sends it again once our clock has caught up.
            ahead = int(unverified_claims(receipt.token).get("iat", 0)) - time.time()
            if ahead <= FUTURE_RECEIPT_RETRY_WINDOW_S:
                raise _NotYet(f"signed {ahead:.0f} s in the future; check the node's clock (NTP)") from None
            raise ApiError(400, "from_the_future", f"receipt signed {ahead:.0f} s in the future") from None
        except (jwt.InvalidTokenError, ValidationError) as exc:
            raise ApiError(400, "malformed", f"receipt is not valid: {exc}") from None
        if claims.iss != node_id:
            raise ApiError(400, "wrong_node", f"receipt signed for node {claims.iss}")
        if not (claims.jti == claims.usage.request_id == receipt.request_id):
            raise ApiError(400, "malformed", "receipt request ids disagree")
        forwarded = await self.ledger.forwarded(receipt.request_id)
        if forwarded is None:
            raise ApiError(400, "unknown_request", "this tracker never routed that request")
        if forwarded.node_id != node_id:
            raise ApiError(400, "wrong_node", f"request was routed to {forwarded.node_id}")
        _check_plausible(claims.usage, forwarded)
        if await self.ledger.store_receipt(node_id, claims.usage, receipt.token):
            await self.flag_mismatch(receipt.request_id)

    async def flag_mismatch(self, request_id: str) -> None:
        """Flag the node when its signed figures differ from what this tracker forwarded beyond the
        tolerance (both must be in). The bill is the smaller figure either way."""
        usage = await self.ledger.usage(request_id)
        if usage is not None and usage.flagged and await self.ledger.mark_flagged(request_id):
            log.warning(
                "receipt disagrees for %s on %s: tracker counted %s, node signed %s; billed %s",
                request_id, usage.node_id, usage.tracker.model_dump(), usage.node.model_dump() if usage.node else None,
                usage.billed.model_dump() if usage.billed else None,
            )

    async def _models(self, request: Request) -> Response:
        data = [
            {"id": model, "object": "model", "created": 0, "owned_by": "meshnet", "meshnet_nodes": len(nodes)}
            for model, nodes in sorted(self.registry.models().items())
            if nodes
        ]
        return JSONResponse({"object": "list", "data": data})

    async def _usage(self, request: Request) -> Response:
        usage = await self.ledger.usage(request.path_params["request_id"])
        if usage is None:
            return _error_response(ApiError(404, "unknown_request", "no request with that id was routed here"))
        return _model_response(usage)

    async def _usage_list(self, request: Request) -> Response:
        given = request.query_params.get("limit", str(DEFAULT_USAGE_LIST_LIMIT))
        if not given.isdigit() or not 1 <= int(given) <= MAX_USAGE_LIST_LIMIT:
            return _error_response(ApiError(400, "bad_limit", f"limit must be a whole number from 1 to {MAX_USAGE_LIST_LIMIT}"))
        return JSONResponse([u.model_dump() for u in await self.ledger.usage_list(limit=int(given))])

    # --- routing ------------------------------------------------------------
    def sign_route(self, node: NodeEntry, request_id: str, path: str, model: str, body: bytes, max_tokens: int | None) -> str:
        now = int(time.time())
        ann = node.announcement
        claims = RouteClaims(
            iss=self.issuer,
            sub=ann.node_id,
            jti=request_id,
            iat=now,
            exp=now + self.config.route_lifetime_s,
            path=path,
            model=ann.model_id,  # the node's own id for the model the client named (maybe by an alias)
            hops=[RouteHop(node_id=ann.node_id, first_layer=ann.first_layer, last_layer=ann.last_layer)],
            body_sha256=body_sha256(body),
            max_tokens=max_tokens,
        )
        return encode_token(claims.model_dump(), self._key)

    def sign_connect(self, relay_url: str, node_id: str) -> str:
        """A CONNECT token for one connection to `node_id` through the relay at `relay_url`."""
        return encode_token(new_connect_claims(self.issuer, relay_url, node_id, CONNECT_TOKEN_LIFETIME_S), self._key)

    def route_max_tokens(self, path: str, payload: dict[str, Any]) -> int | None:
        if path not in GENERATING_PATHS:
            return None
        asked = [v for f in MAX_TOKENS_FIELDS if isinstance(v := payload.get(f), int) and not isinstance(v, bool) and v > 0]
        return min([*asked, self.config.max_tokens_cap])


class _ForwardEndpoint:
    """Pure ASGI for the inference routes: full control of streaming, disconnects and clean-up."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        try:
            body = await _limited_body(request, self.tracker.config.max_body_bytes)
            payload = _json_object(body)
            model = payload.get("model")
            if not isinstance(model, str) or not model:
                raise ApiError(400, "missing_model", "'model' is required")
            # One deadline for the whole forward, first byte to last: a node that trickles forever
            # does not hold the tracker (and a client) for longer than this.
            deadline = anyio.current_time() + self.tracker.config.forward_total_timeout_s
            with anyio.move_on_at(deadline) as opening:
                upstream, node, request_id = await self._open(scope["path"], model, payload, body)
            if opening.cancelled_caught:
                raise ApiError(504, "node_timeout", "no node answered in time")
        except ApiError as refusal:
            await _error_response(refusal)(scope, receive, send)
            return
        meter = ForwardMeter(upstream.headers.get("content-type", "").startswith("text/event-stream"))
        route_ceiling = (self.tracker.route_max_tokens(scope["path"], payload) or 0) * _choices(payload)
        outcome: Outcome = "cancelled"
        try:
            headers = [
                (k.encode("latin-1"), v.encode("latin-1"))
                for k, v in upstream.headers.items()
                if k.lower() in FORWARDED_RESPONSE_HEADERS
            ]
            await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
            with anyio.CancelScope() as forward:

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    forward.cancel()

                # A bare asyncio task rather than an anyio task group, as in the node's proxy: the
                # group cost ~50 µs of CPU a request (bench/RESULTS.md, "Round 4").
                watcher = asyncio.get_running_loop().create_task(watch_disconnect())
                try:
                    with anyio.move_on_at(deadline) as forwarding:
                        outcome = await self._pump(upstream, meter, send)
                    if forwarding.cancelled_caught:
                        outcome = "timed_out"
                        log.warning("request %s to %s ran past %.0f s; cut", request_id, node.node_id, self.tracker.config.forward_total_timeout_s)
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                finally:
                    watcher.cancel()
        except OSError:
            outcome = "cancelled"  # the client went away while we were sending
        finally:
            node.in_flight -= 1
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
                if upstream.status_code >= 400:
                    outcome = "refused"
                # Only what went by counts: the node's own usage figures are its receipt's business.
                counts = meter.counted()
                completion_ceiling = 0 if outcome == "refused" else meter.completion_ceiling(route_ceiling)
                await self.tracker.ledger.finish_request(
                    request_id, upstream.status_code, outcome, counts, completion_ceiling=completion_ceiling
                )
                log.info(
                    "request %s -> %s: %s %s, %s content events, completion ceiling %d", request_id, node.node_id,
                    upstream.status_code, outcome, counts.completion_tokens, completion_ceiling,
                )  # fmt: skip
                await self.tracker.flag_mismatch(request_id)

    async def _open(
        self, path: str, model: str, payload: dict[str, Any], body: bytes
    ) -> tuple[httpx.Response | LeanAnswer, NodeEntry, str]:
        tracker = self.tracker
        if not tracker.registry.serves(model):
            raise ApiError(404, "model_not_found", f"no node serves {model!r}; GET /v1/models lists what is served")
        stream = payload.get("stream") is True
        max_tokens = tracker.route_max_tokens(path, payload)
        tried: set[str] = set()
        for _ in range(MAX_ROUTE_ATTEMPTS):
            node = tracker.registry.pick(model, exclude=tried)
            if node is None:
                break
            tried.add(node.node_id)
            request_id = f"req-{uuid.uuid4().hex}"
            token = tracker.sign_route(node, request_id, path, model, body, max_tokens)
            await tracker.ledger.open_request(
                request_id, node.node_id, node.announcement.model_id, path, stream,  # billed as the node serves it
                max_tokens=max_tokens, choices=_choices(payload), body_bytes=len(body), prompt_ceiling=prompt_ceiling(payload),
            )  # fmt: skip
            headers = {
                "content-type": "application/json",
                "accept-encoding": "identity",  # forward bytes as the node wrote them
                ROUTE_HEADER: token,
                REQUEST_ID_HEADER: request_id,
                "x-request-id": request_id,
            }
            node.in_flight += 1
            node.routed += 1
            try:
                upstream = await tracker.forward(node, path, body, headers)
            # ProxyError: the node's relay holds no tunnel for it right now; either way the node saw nothing.
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError, HttpConnectError) as exc:
                node.in_flight -= 1
                node.healthy = False  # until the next health poll says otherwise
                tracker.poll_soon()
                log.warning("node %s unreachable (%s); trying another", node.node_id, exc)
                await tracker.ledger.finish_request(request_id, None, "refused", None)
                continue
            except (httpx.HTTPError, HttpClientError) as exc:
                node.in_flight -= 1
                await tracker.ledger.finish_request(request_id, None, "upstream_error", None)
                raise ApiError(502, "node_failed", f"node {node.node_id} failed: {exc}") from None
            return upstream, node, request_id
        raise ApiError(
            503,
            "no_node_available",
            f"no ready node for {model!r} right now; retry shortly",
            headers={"retry-after": str(max(1, int(tracker.config.heartbeat_interval_s)))},
        )

    async def _pump(self, upstream: httpx.Response | LeanAnswer, meter: ForwardMeter, send: Any) -> Outcome:
        try:
            async for chunk in upstream.aiter_raw():
                meter.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (httpx.HTTPError, HttpClientError) as exc:
            log.warning("forward from node broke: %s", exc)
            # A stream cut short ends with an OpenAI-style error event, so SDK clients raise instead of hanging.
            tail = _stream_error_event(f"the node's answer broke off: {exc}") if meter.event_stream else b""
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            return "upstream_error"
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if meter.error or (meter.event_stream and not meter.done):
            return "upstream_error"
        return "complete"


class LeanAnswer:
    """A plain-http or relayed node's answer read with the lean client (`common/http1_client`), as the
    forward reads an httpx.Response."""

    __slots__ = ("_response", "headers", "status_code")

    def __init__(self, response: Http1Response) -> None:
        self._response = response
        self.status_code = response.status
        self.headers = httpx.Headers(response.headers)

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self._response.iter_chunks()

    async def aclose(self) -> None:
        await self._response.aclose()


class _NotYet(Exception):
    """A receipt that may be accepted later: left out of both lists of the acknowledgement."""


class _BoundedHeaders:
    """Refuse requests whose headers together exceed MAX_REQUEST_HEADER_BYTES (431), whatever server runs us."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_REQUEST_HEADER_BYTES:
            refusal = ApiError(431, "headers_too_large", f"request headers exceed {MAX_REQUEST_HEADER_BYTES} bytes")
            await _error_response(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _choices(payload: dict[str, Any]) -> int:
    n = payload.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def _check_plausible(usage: Any, forwarded: ForwardedRequest) -> None:
    """A signed receipt still cannot claim more than the route allowed or the body could hold."""
    if usage.route != forwarded.path or usage.model != forwarded.model:
        raise ApiError(400, "malformed", "receipt names another path or model than the route")
    ceiling = (forwarded.max_tokens or 0) * forwarded.choices
    if usage.completion_tokens > ceiling:
        raise ApiError(
            400, "implausible", f"receipt claims {usage.completion_tokens} completion tokens; the route allowed {ceiling}"
        )
    prompt_ceiling = forwarded.body_bytes + PROMPT_TEMPLATE_ALLOWANCE_TOKENS
    if usage.prompt_tokens > prompt_ceiling:
        raise ApiError(
            400, "implausible", f"receipt claims {usage.prompt_tokens} prompt tokens; a {forwarded.body_bytes}-byte body holds fewer"
        )
    if usage.cached_tokens > usage.prompt_tokens:
        raise ApiError(400, "implausible", "receipt claims more cached tokens than prompt tokens")


def _stream_error_event(message: str) -> bytes:
    return b"data: " + openai_error_body(message, "server_error", "upstream_broken") + b"\n\n"


def _error_response(error: ApiError) -> Response:
    return Response(error.body(), error.status, headers=error.headers, media_type="application/json")


def _model_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status, media_type="application/json")


def _parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ApiError(400, "malformed", f"{model.__name__}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except ValueError as exc:
        raise ApiError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "invalid_json", "request body is nested too deeply") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "invalid_json", "request body must be a JSON object")
    return payload


async def _limited_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "body_too_large", f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _control_body(request: Request) -> bytes:
    return await _limited_body(request, MAX_CONTROL_BODY_BYTES)


class _UsedNodeTokens:
    """The `jti` of every node token accepted, kept until the token expires (plus skew): each is good once."""

    def __init__(self, max_entries: int = MAX_REMEMBERED_NODE_TOKENS) -> None:
        self._max = max_entries
        self._expiry: dict[str, float] = {}

    def use(self, jti: str, expires_at: float) -> None:
        now = time.time()
        if len(self._expiry) >= self._max:
            self._expiry = {j: e for j, e in self._expiry.items() if e > now}
            if len(self._expiry) >= self._max:
                raise ApiError(503, "busy", "too many node calls in the last minute; retry shortly", headers={"retry-after": "5"})
        if self._expiry.get(jti, 0) > now:
            raise ApiError(401, "bad_node_auth", "node token already used (replayed?)")
        self._expiry[jti] = expires_at + CLOCK_SKEW_S


def _verify_node_call(
    request: Request, body: bytes, node_id: str, key: Ed25519PublicKey, issuer: str, seen: _UsedNodeTokens
) -> None:
    """Check the node's bearer token: its key signed this very method, path and body, for this tracker, moments ago."""
    auth = request.headers.get("authorization", "")
    if not auth.startswith("Bearer "):
        raise ApiError(401, "missing_node_auth", "node calls need Authorization: Bearer <node token>")
    try:
        claims = decode_token(
            auth[len("Bearer ") :],
            key,
            required=["iss", "aud", "iat", "exp", "htm", "htu", "body_sha256", "jti"],
            leeway=CLOCK_SKEW_S,
            audience=issuer,
        )
    except jwt.InvalidTokenError as exc:
        raise ApiError(401, "bad_node_auth", f"node token is not valid: {exc}") from None
    if claims["exp"] - claims["iat"] > NODE_AUTH_LIFETIME_S:
        raise ApiError(401, "bad_node_auth", "node token lives too long")
    if claims["iss"] != node_id:
        raise ApiError(401, "bad_node_auth", "node token is for another node")
    if (claims["htm"], claims["htu"]) != (request.method, request.url.path):
        raise ApiError(401, "bad_node_auth", "node token is for another call")
    if claims["body_sha256"] != body_sha256(body):
        raise ApiError(401, "bad_node_auth", "body differs from the one the node signed")
    seen.use(str(claims["jti"]), float(claims["exp"]))


def create_app(config: TrackerConfig) -> Starlette:
    return Tracker(config).app()
