"""What the tracker signs: a route to one whole-model node for one request, and a CONNECT through a relay.

A route names the node, the path, the node's own id for the model, the body's hash and a finite
`max_tokens` (the client's, capped); it lives a short while, so a captured one is little worth.
"""

from __future__ import annotations

import time
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.contract.openai_paths import GENERATING_PATHS
from meshnet_gguf.contract.protocol import RouteClaims, RouteHop
from meshnet_gguf.contract.signing import body_sha256, encode_token
from meshnet_gguf.reference.tracker.config import TrackerConfig
from meshnet_gguf.reference.tracker.registry import NodeEntry
from meshnet_gguf.reference.tracker.relay_dialer import new_connect_claims

MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")
# A CONNECT token opens one connection to one node through one relay, at once (contract ceiling: 60 s).
CONNECT_TOKEN_LIFETIME_S = 30


class RouteSigner:
    def __init__(self, key: Ed25519PrivateKey, issuer: str, config: TrackerConfig) -> None:
        self._key = key
        self.issuer = issuer
        self.config = config

    def sign_route(self, node: NodeEntry, request_id: str, path: str, model: str, body: bytes, max_tokens: int | None) -> str:
        now = int(time.time())
        ann = node.announcement
        served = ann.served_as(model)
        claims = RouteClaims(
            iss=self.issuer,
            sub=ann.node_id,
            jti=request_id,
            iat=now,
            exp=now + self.config.route_lifetime_s,
            path=path,
            # The node's own id for the model the client named (maybe by an alias), of the models it serves.
            model=served.model_id if served is not None else ann.model_id,
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
