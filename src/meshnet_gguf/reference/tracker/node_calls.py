"""A node's own calls to the tracker (register, heartbeat, deregister, receipts), checked.

Each carries a bearer token the node's key signed moments ago, for this tracker, this method,
path and body; each token is good once (its `jti` is remembered until it expires).
"""

from __future__ import annotations

import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from starlette.requests import Request

from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.protocol import CLOCK_SKEW_S
from meshnet_gguf.contract.signing import TokenRefused, verify
from meshnet_gguf.contract.token_policies import NODE_CALL_TOKEN

# Node tokens remembered at once (each for its lifetime, at most a minute): far more calls a minute than
# a fleet's heartbeats and receipts make, and a few MB at most.
MAX_REMEMBERED_NODE_TOKENS = 200_000
# How long a node told "too many node calls" waits before it calls again.
BUSY_RETRY_AFTER_S = 5


class UsedNodeTokens:
    """The `jti` of every node token accepted, kept until the token expires (plus skew): each is good once."""

    def __init__(self, max_entries: int = MAX_REMEMBERED_NODE_TOKENS) -> None:
        self._max = max_entries
        self._expiry: dict[str, float] = {}

    def use(self, jti: str, expires_at: float) -> None:
        now = time.time()
        if len(self._expiry) >= self._max:
            self._expiry = {j: e for j, e in self._expiry.items() if e > now}
            if len(self._expiry) >= self._max:
                raise ApiError(
                    503, "busy", "too many node calls in the last minute; retry shortly", headers={"retry-after": str(BUSY_RETRY_AFTER_S)}
                )
        if self._expiry.get(jti, 0) > now:
            raise ApiError(401, "bad_node_auth", "node token already used (replayed?)")
        self._expiry[jti] = expires_at + CLOCK_SKEW_S


class NodeCalls:
    """Checks node calls for the tracker named `issuer`."""

    def __init__(self, issuer: str) -> None:
        self.issuer = issuer
        self.used = UsedNodeTokens()

    def verify(self, request: Request, body: bytes, node_id: str, key: Ed25519PublicKey) -> None:
        """Check the node's bearer token: its key signed this very method, path and body, for this tracker, moments ago."""
        auth = request.headers.get("authorization", "")
        if not auth.startswith("Bearer "):
            raise ApiError(401, "missing_node_auth", "node calls need Authorization: Bearer <node token>")
        try:
            claims = verify(auth[len("Bearer ") :], key, NODE_CALL_TOKEN, issuer=node_id, audience=self.issuer, body=body)
        except TokenRefused as exc:
            raise ApiError(401, "bad_node_auth", f"node token is not valid: {exc}") from None
        if (claims["htm"], claims["htu"]) != (request.method, request.url.path):
            raise ApiError(401, "bad_node_auth", "node token is for another call")
        self.used.use(str(claims["jti"]), float(claims["exp"]))
