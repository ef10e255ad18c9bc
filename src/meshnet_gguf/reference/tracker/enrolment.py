"""Enrolment: a node registers, proves it answers at its URL, heartbeats, and deregisters.

A registration is taken only from a node that presents the enrolment secret (unless enrolment
is open), speaks this protocol's major version, holds every layer, signs the call with the key
its id is derived from, advertises a URL that passes the address policy (or a relay), and then
proves control: whatever answers there signs the tracker's fresh nonce with the node's key.
Heartbeats and deregistrations are signed with the registered key.
"""

from __future__ import annotations

import base64
import hmac
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.protocol import (
    ENROLMENT_HEADER,
    NODE_CONTROL_NONCE_PARAM,
    NODE_CONTROL_PATH,
    PROTOCOL_VERSION,
    Deregistration,
    Heartbeat,
    HeartbeatAck,
    NodeAnnouncement,
    NodeControlClaims,
    NodeControlProof,
    RegistrationAck,
)
from meshnet_gguf.contract.signing import KeyFormatError, TokenRefused, node_id_for, parse_public_key, verify
from meshnet_gguf.contract.token_policies import NODE_CONTROL_TOKEN
from meshnet_gguf.reference.tracker.config import TrackerConfig
from meshnet_gguf.reference.tracker.ledger import TrackerLedger
from meshnet_gguf.reference.tracker.node_address import NodeTarget, UnsafeNodeURL, pin_node_url
from meshnet_gguf.reference.tracker.node_calls import NodeCalls
from meshnet_gguf.reference.tracker.reach import NodeReach
from meshnet_gguf.reference.tracker.registry import NodeEntry, NodeRegistry
from meshnet_gguf.reference.tracker.relay_dialer import RelayedNodeTarget
from meshnet_gguf.reference.tracker.request_io import control_body, error_response, model_response, parse_body

log = logging.getLogger(__name__)

ENROLMENT_SECRET_FILE = "enrolment_secret"
ENROLMENT_SECRET_BYTES = 24
SECRET_FILE_MODE = 0o600
# The node's answer to a control challenge: one small JSON object, quickly.
CONTROL_PROOF_TIMEOUT_S = 5.0
MAX_CONTROL_PROOF_BYTES = 16 * 1024
CONTROL_NONCE_BYTES = 32


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


class Enrolment:
    """The endpoints a node's link calls to join and stay; `poll_soon` asks the node watch for a health poll now."""

    def __init__(
        self, config: TrackerConfig, registry: NodeRegistry, ledger: TrackerLedger, calls: NodeCalls, reach: NodeReach,
        poll_soon: Callable[[], None],
    ) -> None:  # fmt: skip
        self.config, self.registry, self.ledger = config, registry, ledger
        self.calls, self.reach, self.poll_soon = calls, reach, poll_soon
        # Told of each registration (proof of model probes a new node); nothing by default.
        self.on_registered: Callable[[NodeEntry], None] = lambda entry: None

    async def register(self, request: Request) -> Response:
        try:
            body = await control_body(request)
            announcement = parse_body(NodeAnnouncement, body)
            if announcement.protocol_version.split(".")[0] != PROTOCOL_VERSION.split(".")[0]:
                raise ApiError(409, "unsupported_protocol", f"tracker speaks protocol {PROTOCOL_VERSION}")
            self._check_enrolment(request)
            try:
                key = parse_public_key(announcement.public_key)
            except KeyFormatError as exc:
                raise ApiError(400, "bad_public_key", str(exc)) from None
            if node_id_for(key) != announcement.node_id:
                raise ApiError(400, "node_id_mismatch", "node_id is not derived from public_key")
            self.calls.verify(request, body, announcement.node_id, key)
            if not announcement.full_coverage:
                raise ApiError(422, "partial_coverage_unsupported", "this tracker routes single-hop only; a node must hold every layer")
            # Only an enrolled, authenticated node makes this tracker send anything anywhere.
            try:
                target: NodeTarget | RelayedNodeTarget = await pin_node_url(announcement.advertised_url, self.config.addresses)
            except UnsafeNodeURL as exc:
                raise ApiError(422, "unsafe_advertised_url", str(exc)) from None
            if announcement.relay is not None:  # reached only through its relay, TLS pinned to its certificate
                target = await self.reach.dialer.through_relay(announcement, self.config.addresses)
            try:
                await self._prove_control(target, announcement.node_id, key)
                await self.ledger.remember_node(announcement.node_id, announcement.public_key)
            except BaseException:
                if isinstance(target, RelayedNodeTarget):
                    with anyio.CancelScope(shield=True):
                        await self.reach.dialer.discard(target)  # a failed registration keeps nothing
                raise
        except ApiError as refusal:
            log.warning("registration refused (%s): %s", refusal.code, refusal.message)
            return error_response(refusal)
        # Adopted and registered with no await between: the node watch forgets every adopted way in
        # that is not registered (closing its tunnels), so it must never see one without the other.
        if isinstance(target, RelayedNodeTarget):
            self.reach.dialer.adopt(target)
        entry, displaced = self.registry.register(announcement, target)  # type: ignore[arg-type]
        self.on_registered(entry)
        for node_id in displaced:
            log.warning("node %s displaced: %s now answers at its URL with its own key", node_id, announcement.node_id)
        self.poll_soon()
        log.info(
            "node %s registered: %s at %s (%s)",
            announcement.node_id, announcement.model_id, announcement.advertised_url, announcement.state,
        )  # fmt: skip
        return model_response(
            RegistrationAck(
                node_id=announcement.node_id,
                issuer=self.calls.issuer,
                heartbeat_interval_s=self.config.heartbeat_interval_s,
                ttl_s=self.config.ttl_s,
            )
        )

    async def _prove_control(self, target: NodeTarget | RelayedNodeTarget, node_id: str, key: Ed25519PublicKey) -> None:
        """Whatever answers at the advertised URL must sign our fresh nonce with the node's key.

        Another node's URL, or a server that is not a node, cannot: so nobody routes prompts
        elsewhere by registering someone else's address.
        """
        nonce = base64.urlsafe_b64encode(secrets.token_bytes(CONTROL_NONCE_BYTES)).rstrip(b"=").decode()
        request = target.request(self.reach.http, "GET", NODE_CONTROL_PATH, params={NODE_CONTROL_NONCE_PARAM: nonce})
        request.extensions["timeout"] = httpx.Timeout(CONTROL_PROOF_TIMEOUT_S).as_dict()
        unproven = f"{target.url} did not prove it holds node {node_id}'s key"
        try:
            with anyio.fail_after(CONTROL_PROOF_TIMEOUT_S):
                response = await self.reach.http.send(request, stream=True)
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
                verify(proof.token, key, NODE_CONTROL_TOKEN, issuer=node_id, audience=self.calls.issuer)
            )
        except (ValidationError, TokenRefused) as exc:
            raise ApiError(422, "control_unproven", f"{unproven}: {exc}") from None
        if not hmac.compare_digest(claims.nonce, nonce):
            raise ApiError(422, "control_unproven", f"{unproven}: the answer is for another node or another challenge")

    def _check_enrolment(self, request: Request) -> None:
        expected = self.config.enrolment_secret
        if expected is None:
            return
        given = request.headers.get(ENROLMENT_HEADER, "")
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise ApiError(401, "bad_enrolment_secret", f"registration needs the tracker's enrolment secret in {ENROLMENT_HEADER}")

    async def heartbeat(self, request: Request) -> Response:
        node_id = request.path_params["node_id"]
        try:
            entry, body = await self._registered_call(request, node_id)
            beat = parse_body(Heartbeat, body)
        except ApiError as refusal:
            return error_response(refusal)
        was = entry.state
        self.registry.heartbeat(node_id, beat.state, beat.load)
        if beat.state != was:
            log.info("node %s: %s -> %s", node_id, was, beat.state)
            self.poll_soon()
        return model_response(HeartbeatAck(ttl_s=self.config.ttl_s))

    async def deregister(self, request: Request) -> Response:
        node_id = request.path_params["node_id"]
        try:
            _, body = await self._registered_call(request, node_id)
            reason = parse_body(Deregistration, body).reason
        except ApiError as refusal:
            return error_response(refusal)
        self.registry.remove(node_id)
        log.info("node %s deregistered (%s)", node_id, reason)
        return JSONResponse({})

    async def _registered_call(self, request: Request, node_id: str) -> tuple[NodeEntry, bytes]:
        """The entry of a registered node and the body of its call, signed with its registered key."""
        entry = self.registry.get(node_id)
        if entry is None:
            raise ApiError(404, "unknown_node", f"node {node_id} is not registered; register again")
        body = await control_body(request)
        self.calls.verify(request, body, node_id, parse_public_key(entry.announcement.public_key))
        return entry, body
