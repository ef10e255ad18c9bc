"""Check `X-Meshnet-Route` tokens: only requests the tracker routed to this node get through.

A route is a JWT (EdDSA) signed by the tracker whose public key the node pins.
Every check failure raises `RouteRejected` carrying the HTTP status and a code
from `protocol.ROUTE_ERRORS`; the proxy turns it into an OpenAI error body and
forwards nothing to llama-server.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError

from meshnet_gguf.contract.protocol import CLOCK_SKEW_S, ROUTE_ERRORS, ROUTE_HEADER, RouteClaims
from meshnet_gguf.contract.signing import BODY_CHECKED_LATER, HotVerifyKey, TokenFault, TokenRefused, tracker_issuer_for, verify
from meshnet_gguf.contract.signing import check_body as check_signed_body
from meshnet_gguf.contract.token_policies import ROUTE_TOKEN

# What `verify` refuses, as the node answers it (`ROUTE_ERRORS`).
_ROUTE_CODES: dict[TokenFault, str] = {
    "malformed": "route_malformed",
    "missing_claim": "route_malformed",
    "bad_signature": "route_bad_signature",
    "wrong_issuer": "route_wrong_issuer",
    "wrong_subject": "route_wrong_node",
    "wrong_audience": "route_malformed",  # a route names no audience; the policy never refuses for one
    "life_too_long": "route_lifetime_too_long",
    "not_yet_valid": "route_not_yet_valid",
    "expired": "route_expired",
    "body_mismatch": "route_body_mismatch",
}

# With routes living at most 60 s this holds > 1,600 requests/s, far above what
# one llama-server node serves; reaching it means abuse, so we refuse rather than evict.
REPLAY_CACHE_MAX_ENTRIES = 100_000


class RouteRejected(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.status = ROUTE_ERRORS[code]
        self.message = message

    def __repr__(self) -> str:
        return f"RouteRejected({self.status}, {self.code!r}, {self.message!r})"


class ReplayCache:
    """Request ids seen, each kept until its route expires (plus skew): a replay inside that window is caught,
    and after it the token's expiry refuses it anyway."""

    def __init__(self, max_entries: int = REPLAY_CACHE_MAX_ENTRIES) -> None:
        self._max_entries = max_entries
        # Insertion order is nearly expiry order (lifetimes are similar), so pruning pops from the front.
        self._expiry: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._expiry)

    def _prune(self, now: float) -> None:
        while self._expiry:
            _, expires = next(iter(self._expiry.items()))
            if expires > now:
                break
            self._expiry.popitem(last=False)

    def seen(self, request_id: str, now: float) -> bool:
        """Whether this id was used already (and its route is still live): looked up, nothing recorded."""
        expires = self._expiry.get(request_id)
        return expires is not None and expires > now

    def remember(self, request_id: str, expires_at: float, now: float) -> None:
        """Record a first sighting; raises `RouteRejected` on a second one."""
        self._prune(now)
        if request_id in self._expiry:
            raise RouteRejected("route_replayed", f"route for request {request_id} was already used")
        if len(self._expiry) >= self._max_entries:
            # A route that expires later may sit behind an earlier one; drop expired ones anywhere.
            for rid in [r for r, e in self._expiry.items() if e <= now]:
                del self._expiry[rid]
            if len(self._expiry) >= self._max_entries:
                raise RouteRejected("route_replay_cache_full", "too many routes in flight; retry shortly")
        self._expiry[request_id] = expires_at + CLOCK_SKEW_S


class RouteVerifier:
    """Verifies route tokens for one node serving one model that holds every layer."""

    def __init__(
        self,
        tracker_key: Ed25519PublicKey,
        *,
        node_id: str,
        model_id: str,
        total_layers: int,
        other_models: Collection[str] = (),
        issuer: str | None = None,
        replay_cache: ReplayCache | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._key = HotVerifyKey(tracker_key)
        self._issuer = issuer or tracker_issuer_for(tracker_key)
        self.node_id = node_id
        self.model_id = model_id
        # The models a node of several serves beside its first (their ids, as its announcement names them).
        self.other_models = frozenset(other_models)
        self.total_layers = total_layers
        # An empty cache is falsy: `or` would silently swap a shared (seeded later) cache for a private one.
        self._replay = replay_cache if replay_cache is not None else ReplayCache()
        self._clock = clock

    @property
    def issuer(self) -> str:
        return self._issuer

    def verify(self, headers: Mapping[str, str], body: bytes, path: str) -> RouteClaims:
        """All three checks at once (for callers that hold the body already)."""
        claims = self.check_token(headers, path)
        self.check_body(claims.body_sha256, body)
        self.claim(claims.jti, claims.exp)
        return claims

    def check_token(self, headers: Mapping[str, str], path: str) -> RouteClaims:
        """The route policy (signature, issuer, node, life, clocks), then model, hops and path: everything but the body.

        Runs before the body is read, so a forged or stale route costs the node no more
        than its headers. The caller enforces `claims.max_tokens` on the body it forwards.
        """
        token = _header(headers, ROUTE_HEADER)
        if not token:
            raise RouteRejected(
                "route_missing",
                f"this node serves only requests routed by its tracker; send them through the tracker ({ROUTE_HEADER} missing)",
            )
        claims = self._decode(token)
        if claims.model != self.model_id and claims.model not in self.other_models:
            also = f" (and {len(self.other_models)} more)" if self.other_models else ""
            raise RouteRejected("route_wrong_model", f"route is for model {claims.model!r}, this node serves {self.model_id!r}{also}")
        self._check_hops(claims)
        if claims.path != path:
            raise RouteRejected("route_wrong_path", f"route is for {claims.path}, not {path}")
        # A route already used is refused here, before its body is read, its prompt counted or a slot taken; the
        # id is still claimed only at the last moment (`claim`), so a route refused for another reason keeps it.
        if self._replay.seen(claims.jti, self._clock()):
            raise RouteRejected("route_replayed", f"route for request {claims.jti} was already used")
        return claims

    @staticmethod
    def check_body(signed_sha256: str, body: bytes) -> None:
        try:
            check_signed_body(signed_sha256, body, ROUTE_TOKEN)
        except TokenRefused:
            raise RouteRejected("route_body_mismatch", "request body differs from the one the tracker signed") from None

    def claim(self, request_id: str, expires_at: float) -> None:
        """Use the route's request id up; a second use raises `route_replayed`. Call last, just
        before forwarding, so a route refused for another reason does not burn its id."""
        self._replay.remember(request_id, expires_at, self._clock())

    def _decode(self, token: str) -> RouteClaims:
        # The route policy against this node's own (injectable) clock; the body is checked once it is read.
        try:
            raw = verify(
                token, self._key, ROUTE_TOKEN, issuer=self._issuer, subject=self.node_id, body=BODY_CHECKED_LATER, now=self._clock()
            )
        except TokenRefused as exc:
            raise RouteRejected(_ROUTE_CODES[exc.fault], f"route refused: {exc}") from None
        try:
            return RouteClaims.model_validate(raw)
        except ValidationError as exc:
            raise RouteRejected("route_malformed", f"route claims are malformed: {_first_error(exc)}") from None

    def _check_hops(self, claims: RouteClaims) -> None:
        if len(claims.hops) != 1:
            raise RouteRejected(
                "route_not_single_hop", f"route has {len(claims.hops)} hops; a whole-model node serves single-hop routes only"
            )
        hop = claims.hops[0]
        if hop.node_id != self.node_id:
            raise RouteRejected("route_wrong_node", f"route hop is node {hop.node_id}, this is {self.node_id}")
        if (hop.first_layer, hop.last_layer) != (0, self.total_layers - 1):
            raise RouteRejected(
                "route_coverage_mismatch",
                f"route hop covers layers {hop.first_layer}..{hop.last_layer}; "
                f"this node runs all layers 0..{self.total_layers - 1} and nothing else",
            )


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        value = headers.get(name.lower())
    return value.strip() if value else None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
