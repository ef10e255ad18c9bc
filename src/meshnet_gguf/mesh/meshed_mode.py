"""The meshed way of admitting a request (the serving `AdmissionMode`): only tracker-signed routes
get through, and each request's ledger row is on disk before a byte of its answer leaves the node.

The route's token is checked before the body is read, the body's hash once it is, and at
commit the route's one-time id is claimed in memory; the in-flight row, with the request body,
is then written on the ledger's thread while llama-server already works on the request (its
prefill hides the synced write), and the proxy holds the answer's first byte until the row is
durable (protocol §6, rule 1). So a replayed route is refused even across a crash, and a request
whose row never reached the disk was answered to nobody and is billed nothing. A completed answer
carries llama-server's own prompt count; one cut short is counted when it ends, and the
count goes into the row. A node killed before either lands still bills the prompt: the
restart counts it from the body kept in the row.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.protocol import UsageRecord
from meshnet_gguf.mesh.receipts import LedgerUsageSink
from meshnet_gguf.mesh.route_auth import ReplayCache, RouteRejected, RouteVerifier
from meshnet_gguf.serving.access import check_api_key
from meshnet_gguf.serving.admission_modes import RouteGrant, unavailable

log = logging.getLogger(__name__)

# Retry-After while the tracker key is still unknown: the first-contact retry runs about this often.
KEY_UNKNOWN_RETRY_AFTER_S = 5


class RouteGate:
    """The proxy's route verifier: verifies `X-Meshnet-Route` and says what the route allows.

    Until a tracker key is known (first contact not made yet, no key configured)
    every request is refused with 503: serving unrouted requests is never the fallback.
    """

    def __init__(self, node_id: str, model_id: str, total_layers: int, key: Ed25519PublicKey | None) -> None:
        self._node_id, self._model_id, self._total_layers = node_id, model_id, total_layers
        self._other_models: frozenset[str] = frozenset()
        self.replay_cache = ReplayCache()
        self._verifier: RouteVerifier | None = None
        self._key: Ed25519PublicKey | None = None
        if key is not None:
            self.set_tracker_key(key)

    @property
    def issuer(self) -> str | None:
        return self._verifier.issuer if self._verifier else None

    @property
    def tracker_key(self) -> Ed25519PublicKey | None:
        """The key routes must be signed with; None until it is known. A verifier node trusts it for audits too."""
        return self._key

    def set_tracker_key(self, key: Ed25519PublicKey) -> None:
        self._key = key
        self._verifier = RouteVerifier(
            key,
            node_id=self._node_id,
            model_id=self._model_id,
            total_layers=self._total_layers,
            other_models=self._other_models,
            replay_cache=self.replay_cache,
        )

    def serve_also(self, model_ids: Collection[str]) -> None:
        """Routes for these models pass too (a node serving several announces them beside its first)."""
        self._other_models = frozenset(model_ids)
        if self._key is not None:
            self.set_tracker_key(self._key)

    def _ready_verifier(self) -> RouteVerifier:
        if self._verifier is None:
            raise ApiError(
                503, "route_key_unavailable", "this node has not learnt its tracker's key yet; retry shortly",
                headers={"retry-after": str(KEY_UNKNOWN_RETRY_AFTER_S)},
            )  # fmt: skip
        return self._verifier

    def check_token(self, headers: Mapping[str, str], path: str) -> RouteGrant:
        try:
            claims = self._ready_verifier().check_token(headers, path)
        except RouteRejected as exc:
            raise ApiError(exc.status, exc.code, exc.message) from None
        return RouteGrant(request_id=claims.jti, max_tokens=claims.max_tokens, expires_at=claims.exp, body_sha256=claims.body_sha256)

    def check_body(self, grant: RouteGrant, body: bytes) -> None:
        try:
            RouteVerifier.check_body(grant.body_sha256 or "", body)
        except RouteRejected as exc:
            raise ApiError(exc.status, exc.code, exc.message) from None

    def claim(self, grant: RouteGrant) -> None:
        assert grant.request_id is not None and grant.expires_at is not None
        try:
            self._ready_verifier().claim(grant.request_id, grant.expires_at)
        except RouteRejected as exc:
            raise ApiError(exc.status, exc.code, exc.message) from None


class RowWrite:
    """A request's ledger row on its way to disk (the proxy's `Recording`): written on the ledger's
    thread while llama-server already works on the request; the answer's first byte waits for it."""

    def __init__(self, written: asyncio.Future[bool], request_id: str, retry_after_s: int) -> None:
        self._written, self._request_id, self._retry_after_s = written, request_id, retry_after_s
        self._refusal: ApiError | None = None
        self._checked = False

    async def durable(self) -> None:
        if not self._checked:
            self._refusal = await self._outcome()
            self._checked = True
        if self._refusal is not None:
            raise self._refusal

    async def _outcome(self) -> ApiError | None:
        try:
            # Shielded: a waiter cancelled (its client gone) leaves the write to finish; the row is
            # then settled like any other cut-short request.
            opened = await asyncio.shield(self._written)
        except Exception as exc:  # a full or broken disk: deliver nothing that cannot be billed
            log.error("request %s: could not write its ledger row, its answer withheld: %s", self._request_id, exc)
            return unavailable("This node cannot record requests right now; retry on another node", self._retry_after_s)
        if not opened:  # the id is on disk already (a route older than the replay cache's memory)
            return ApiError(403, "route_replayed", f"request {self._request_id} was already served by this node")
        return None


class MeshedMode:
    """Signed routes in; each request's ledger row written while it is forwarded, durable before its answer's first byte."""

    # The row keeps the body until the request settles: a prompt is counted only when needed.
    keeps_request_body = True

    def __init__(self, gate: RouteGate, journal: LedgerUsageSink, *, retry_after_s: int, api_key: str | None = None) -> None:
        self._gate = gate
        self._journal = journal
        self._retry_after_s = retry_after_s
        self._api_key = api_key

    def admit_listing(self, headers: Mapping[str, str]) -> None:
        # Listing runs nothing: the operator's API key, when set, is all it takes.
        check_api_key(headers, self._api_key)

    def admit(self, headers: Mapping[str, str], path: str) -> RouteGrant:
        # Routed requests are signed for this node; the tracker is the client, so no Host or key check.
        return self._gate.check_token(headers, path)

    def check_body(self, grant: RouteGrant, body: bytes) -> None:
        self._gate.check_body(grant, body)

    def commit(self, grant: RouteGrant, usage: Callable[[], UsageRecord], body: bytes) -> RowWrite:
        # In memory, before any work: from here a second use of this route is refused.
        self._gate.claim(grant)
        record = usage()
        written = self._journal.open_soon(record, grant.expires_at, body)
        return RowWrite(written, record.request_id, self._retry_after_s)

    async def prompt_counted(self, request_id: str, prompt_tokens: int) -> None:
        await self._journal.note_prompt(request_id, prompt_tokens)


__all__ = ["KEY_UNKNOWN_RETRY_AFTER_S", "MeshedMode", "RouteGate", "RowWrite"]
