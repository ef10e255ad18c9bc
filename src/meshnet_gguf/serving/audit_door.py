"""The verifier's door: `POST /v1/proof/audit` takes an `AuditRequest` signed by a tracker it trusts
and answers the `AuditVerdict` its scorer (`proof/audit.audit`, handed in) gives against the node's
own llama-server.

The token is checked with the audit policy (`contract/token_policies.AUDIT_TOKEN`: Ed25519 over the
claims, the trusted tracker key, a short life, the body's sha256), so nobody but the tracker can make
a verifier spend its llama-server. A verifier that cannot score answers `no_verdict`, which never
counts against a node. Every refusal is OpenAI's error JSON, as at every other door of the node;
the row (`audit_route`) hides the path from the relay's callers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError

from meshnet_gguf.common.asgi import JSON_HEADER, respond
from meshnet_gguf.common.http1_client import split_url
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.model_proof import AUDIT_PATH, AUDIT_TOKEN_HEADER, AuditRequest, AuditVerdict
from meshnet_gguf.contract.signing import TokenRefused, parse_public_key, tracker_issuer_for, verify
from meshnet_gguf.contract.token_policies import AUDIT_TOKEN
from meshnet_gguf.serving.access import NotRelayed, Relayed
from meshnet_gguf.serving.routes import Request, Route

# An audit carries a request body and its answer: a chat turn and up to a few thousand tokens.
MAX_AUDIT_BODY_BYTES = 16 * 1024 * 1024
# A verifier that cannot take an audit now (llama-server not ready, every slot busy) says when to ask again;
# the tracker retries with its own backoff either way.
RETRY_AFTER_S = 5
_AUDIT_TOKEN_KEY = AUDIT_TOKEN_HEADER.lower()

# The llama-server that scores: its base URL and bearer key, or None while it is not ready.
Upstream = Callable[[], tuple[str, str | None] | None]
# The tracker key audits must be signed with, or None while it is not known (a node before first contact).
TrackerKey = Callable[[], Ed25519PublicKey | None]
# Takes a slot of the node for one audit: the callable that gives it back, or None when every slot is busy.
AcquireSlot = Callable[[], Callable[[], None] | None]
# Scores one audit with a client of the scoring llama-server (`proof/audit.audit`).
Scorer = Callable[[httpx.AsyncClient, AuditRequest], Awaitable[AuditVerdict]]


class AuditDoor:
    """The handler of the audit row. `llama` is the verifier's own llama-server running the claimed model
    (a URL, or a callable that says where it is now); `tracker_key` the key audits must be signed with
    (its text, or a callable)."""

    def __init__(
        self, score: Scorer, llama: str | Upstream, tracker_key: str | TrackerKey, *, acquire_slot: AcquireSlot | None = None
    ) -> None:
        self._score = score
        self._upstream: Upstream = (lambda: (llama, None)) if isinstance(llama, str) else llama
        if isinstance(tracker_key, str):
            fixed = parse_public_key(tracker_key)
            self._tracker_key: TrackerKey = lambda: fixed
        else:
            self._tracker_key = tracker_key
        self._acquire_slot = acquire_slot

    async def __call__(self, request: Request) -> None:
        body = await request.body()
        self._check_token(request.headers.get(_AUDIT_TOKEN_KEY), body)
        try:
            asked = AuditRequest.model_validate_json(body)
        except ValidationError as exc:
            raise ApiError(400, "invalid_audit", f"not an AuditRequest: {exc.errors()[0]['msg']}") from None
        upstream = self._upstream()
        release = self._acquire_slot() if self._acquire_slot is not None else (lambda: None)
        if upstream is None or release is None:
            if release is not None:
                release()
            why = "its llama-server is not ready" if upstream is None else "every slot is busy"
            raise _cannot_audit(f"this verifier cannot audit now: {why}")
        try:
            async with llama_client(*upstream) as client:
                verdict = await self._score(client, asked)
        finally:
            release()
        await respond(request.send, 200, verdict.model_dump_json().encode(), [JSON_HEADER])

    def _check_token(self, token: str | None, body: bytes) -> None:
        key = self._tracker_key()
        if key is None:
            raise _cannot_audit("this verifier has not learnt its tracker's key yet")
        if not token:
            raise ApiError(401, "invalid_audit_token", "no audit token")
        try:
            verify(token, key, AUDIT_TOKEN, issuer=tracker_issuer_for(key), body=body)
        except TokenRefused as exc:
            raise ApiError(401, "invalid_audit_token", f"audit token refused: {exc}") from None


def audit_route(door: AuditDoor, relayed: Relayed | None = None) -> Route:
    """The audit row: the relay's callers find no such path (the tracker reaches a verifier at its URL)."""
    return Route("POST", AUDIT_PATH, NotRelayed(relayed), door, max_body_bytes=MAX_AUDIT_BODY_BYTES)


def llama_client(base_url: str, api_key: str | None) -> httpx.AsyncClient:
    """A client of the scoring llama-server: at an http:// URL, or on its UNIX socket (a node's own llama-server)."""
    address, _ = split_url(base_url)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    if address.unix_path is None:
        return httpx.AsyncClient(base_url=base_url, headers=headers)
    return httpx.AsyncClient(base_url="http://localhost", headers=headers, transport=httpx.AsyncHTTPTransport(uds=address.unix_path))


def _cannot_audit(message: str) -> ApiError:
    return ApiError(503, "verifier_unavailable", message, headers={"retry-after": str(RETRY_AFTER_S)})


__all__ = ["MAX_AUDIT_BODY_BYTES", "AuditDoor", "audit_route", "llama_client"]
