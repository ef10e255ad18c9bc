"""The verifier's endpoint: `POST /v1/proof/audit` takes an `AuditRequest` signed by a tracker it
trusts and answers the `AuditVerdict` of `audit.audit` against its own llama-server.

The token is checked as a route token is (Ed25519 over the claims, the pinned tracker key, a short
life, the body's sha256), so nobody but the tracker can make a verifier spend its llama-server.
A verifier that cannot score answers `no_verdict`, which never counts against a node.
"""

from __future__ import annotations

import time

import httpx
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshnet_gguf.contract.model_proof import AUDIT_TOKEN_HEADER, AUDIT_TOKEN_SUBJECT, AuditRequest
from meshnet_gguf.contract.signing import CompactTokenError, body_sha256, parse_public_key, tracker_issuer_for, verify_eddsa_claims
from meshnet_gguf.proof.audit import audit

# An audit carries a request body and its answer: a chat turn and up to a few thousand tokens.
MAX_AUDIT_BODY_BYTES = 16 * 1024 * 1024
# Clocks of the tracker and the verifier may differ this much (as for route tokens).
CLOCK_SKEW_S = 30


class AuditEndpoint:
    """`handle` is the Starlette endpoint; `llama_url` is the verifier's own llama-server running the claimed model."""

    def __init__(self, llama_url: str, tracker_public_key: str) -> None:
        key = parse_public_key(tracker_public_key)
        self._key, self._issuer = key, tracker_issuer_for(key)
        self._client = httpx.AsyncClient(base_url=llama_url)

    async def aclose(self) -> None:
        await self._client.aclose()

    def _refusal(self, token: str | None, body: bytes) -> str | None:
        if not token:
            return "no audit token"
        try:
            claims = verify_eddsa_claims(token, self._key)
        except CompactTokenError as exc:
            return f"audit token refused: {exc}"
        now = time.time()
        if claims.get("iss") != self._issuer or claims.get("sub") != AUDIT_TOKEN_SUBJECT:
            return "the audit token is not this verifier's tracker's"
        exp, iat = claims.get("exp"), claims.get("iat")
        if not isinstance(exp, (int, float)) or not isinstance(iat, (int, float)) or exp < now - CLOCK_SKEW_S or iat > now + CLOCK_SKEW_S:
            return "the audit token has expired or is not valid yet"
        if claims.get("body_sha256") != body_sha256(body):
            return "the audit token was signed for another body"
        return None

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        if len(body) > MAX_AUDIT_BODY_BYTES:
            return JSONResponse({"error": "audit body too large"}, 413)
        if (refusal := self._refusal(request.headers.get(AUDIT_TOKEN_HEADER), body)) is not None:
            return JSONResponse({"error": refusal}, 401)
        try:
            asked = AuditRequest.model_validate_json(body)
        except ValidationError as exc:
            return JSONResponse({"error": f"not an AuditRequest: {exc.errors()[0]['msg']}"}, 400)
        verdict = await audit(self._client, asked)
        return Response(verdict.model_dump_json(), 200, media_type="application/json")
