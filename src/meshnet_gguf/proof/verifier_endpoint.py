"""The verifier's endpoint: `POST /v1/proof/audit` takes an `AuditRequest` signed by a tracker it
trusts and answers the `AuditVerdict` of `audit.audit` against its own llama-server.

The token is checked as a route token is (Ed25519 over the claims, the pinned tracker key, a short
life, the body's sha256), so nobody but the tracker can make a verifier spend its llama-server.
A verifier that cannot score answers `no_verdict`, which never counts against a node.

`AuditEndpoint.handle` is a Starlette endpoint; `VerifierRoute` mounts it in front of another ASGI
app (a node's listener under `serve --verifier`): only `AUDIT_PATH` is taken, every other path goes
on untouched, and a caller the node names hidden (one that came through its relay) finds no such path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from meshnet_gguf.common.http1_client import split_url
from meshnet_gguf.contract.model_proof import AUDIT_PATH, AUDIT_TOKEN_HEADER, AuditRequest
from meshnet_gguf.contract.signing import TokenRefused, parse_public_key, tracker_issuer_for, verify
from meshnet_gguf.contract.token_policies import AUDIT_TOKEN
from meshnet_gguf.proof.audit import audit

# An audit carries a request body and its answer: a chat turn and up to a few thousand tokens.
MAX_AUDIT_BODY_BYTES = 16 * 1024 * 1024
# A verifier that cannot take an audit now (llama-server not ready, every slot busy) says when to ask again;
# the tracker retries with its own backoff either way.
RETRY_AFTER_S = 5
# The body of an audit arrives within this, or the request is dropped (a slow sender holds nothing longer).
BODY_READ_TIMEOUT_S = 30.0

# The llama-server that scores: its base URL and bearer key, or None while it is not ready.
Upstream = Callable[[], tuple[str, str | None] | None]
# The tracker key audits must be signed with, or None while it is not known (a node before first contact).
TrackerKey = Callable[[], Ed25519PublicKey | None]
# Takes a slot of the node for one audit: the callable that gives it back, or None when every slot is busy.
AcquireSlot = Callable[[], Callable[[], None] | None]


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AuditEndpoint:
    """`llama` is the verifier's own llama-server running the claimed model (a URL, or a callable that
    says where it is now); `tracker_key` the key audits must be signed with (its text, or a callable)."""

    def __init__(self, llama: str | Upstream, tracker_key: str | TrackerKey, *, acquire_slot: AcquireSlot | None = None) -> None:
        self._upstream: Upstream = (lambda: (llama, None)) if isinstance(llama, str) else llama
        if isinstance(tracker_key, str):
            fixed = parse_public_key(tracker_key)
            self._tracker_key: TrackerKey = lambda: fixed
        else:
            self._tracker_key = tracker_key
        self._acquire_slot = acquire_slot

    def _refusal(self, token: str | None, body: bytes) -> str | None:
        key = self._tracker_key()
        if key is None:
            raise _Refused(503, "this verifier has not learnt its tracker's key yet")
        if not token:
            return "no audit token"
        try:
            verify(token, key, AUDIT_TOKEN, issuer=tracker_issuer_for(key), body=body)
        except TokenRefused as exc:
            return f"audit token refused: {exc}"
        return None

    async def handle(self, request: Request) -> Response:
        try:
            body = await _bounded_body(request)
            if (refusal := self._refusal(request.headers.get(AUDIT_TOKEN_HEADER), body)) is not None:
                return JSONResponse({"error": refusal}, 401)
            asked = AuditRequest.model_validate_json(body)
        except _Refused as exc:
            headers = {"retry-after": str(RETRY_AFTER_S)} if exc.status == 503 else None
            return JSONResponse({"error": str(exc)}, exc.status, headers=headers)
        except ValidationError as exc:
            return JSONResponse({"error": f"not an AuditRequest: {exc.errors()[0]['msg']}"}, 400)
        upstream = self._upstream()
        release = self._acquire_slot() if self._acquire_slot is not None else (lambda: None)
        if upstream is None or release is None:
            if release is not None:
                release()
            why = "its llama-server is not ready" if upstream is None else "every slot is busy"
            return JSONResponse({"error": f"this verifier cannot audit now: {why}"}, 503, headers={"retry-after": str(RETRY_AFTER_S)})
        try:
            async with llama_client(*upstream) as client:
                verdict = await audit(client, asked)
        finally:
            release()
        return Response(verdict.model_dump_json(), 200, media_type="application/json")


def llama_client(base_url: str, api_key: str | None) -> httpx.AsyncClient:
    """A client of the scoring llama-server: at an http:// URL, or on its UNIX socket (a node's own llama-server)."""
    address, _ = split_url(base_url)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    if address.unix_path is None:
        return httpx.AsyncClient(base_url=base_url, headers=headers)
    return httpx.AsyncClient(base_url="http://localhost", headers=headers, transport=httpx.AsyncHTTPTransport(uds=address.unix_path))


async def _bounded_body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_AUDIT_BODY_BYTES:
        raise _Refused(413, "audit body too large")
    chunks, size = [], 0
    with anyio.move_on_after(BODY_READ_TIMEOUT_S):
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_AUDIT_BODY_BYTES:
                    raise _Refused(413, "audit body too large")
                chunks.append(chunk)
        except ClientDisconnect:
            raise _Refused(400, "the client closed the connection") from None
        return b"".join(chunks)
    raise _Refused(408, f"audit body not received within {BODY_READ_TIMEOUT_S:.0f} s")


class VerifierRoute:
    """ASGI: `POST AUDIT_PATH` answered by `endpoint`, any other request passed to `app`. A caller
    `hidden(client_address)` names (one that came through the node's relay) is passed on, so it meets
    the node's own 404: the audit path is for the tracker, which reaches a verifier at its URL."""

    def __init__(self, app: Any, endpoint: AuditEndpoint, *, hidden: Callable[[tuple[str, int] | None], bool] | None = None) -> None:
        self.app, self.endpoint, self.hidden = app, endpoint, hidden

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != AUDIT_PATH or self._hidden(scope):
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            response: Response = JSONResponse(
                {"error": f"{scope['method']} is not allowed on {AUDIT_PATH}"}, 405, headers={"allow": "POST"}
            )
        else:
            response = await self.endpoint.handle(Request(scope, receive))
        await response(scope, receive, send)

    def _hidden(self, scope: dict[str, Any]) -> bool:
        if self.hidden is None:
            return False
        client = scope.get("client")
        return self.hidden((str(client[0]), int(client[1])) if client else None)
