"""Who is who at the relay: a node's attach proof, and a tracker's CONNECT token.

A node proves its key by signing the relay's fresh challenge, for this relay and this role,
briefly; its node id must be that key's fingerprint. A tracker's CONNECT carries a token
signed by a tracker the relay trusts, for this relay and this node, issued since the relay
started and used once. A failed check is a `RelayRefusal`; what a proved peer may then hold
is `relay_admission`'s business.
"""

from __future__ import annotations

import secrets
import time

from meshnet_gguf.contract.protocol import CLOCK_SKEW_S
from meshnet_gguf.contract.relay_wire import RELAY_CONNECT_AUTH_SCHEME, RelayAttach
from meshnet_gguf.contract.signing import (
    HotVerifyKey,
    KeyFormatError,
    TokenRefused,
    node_id_for,
    parse_public_key,
    tracker_issuer_for,
    verify,
)
from meshnet_gguf.contract.token_policies import RELAY_ATTACH_TOKEN, RELAY_CONNECT_TOKEN
from meshnet_gguf.reference.relay.admission import RelayRefusal

# CONNECT token ids remembered before the expired ones are swept out.
SEEN_TOKENS_BEFORE_SWEEP = 1024


def verify_attach(attach: RelayAttach, nonce: str, audience: str) -> None:
    """The attach proof signs this connection's challenge with the key the node id is derived from."""
    try:
        key = parse_public_key(attach.public_key)
    except KeyFormatError as exc:
        raise RelayRefusal("bad_public_key", str(exc)) from None
    if node_id_for(key) != attach.node_id:
        raise RelayRefusal("node_id_mismatch", "node_id is not derived from public_key")
    try:
        claims = verify(attach.proof, key, RELAY_ATTACH_TOKEN, issuer=attach.node_id, audience=audience)
    except TokenRefused as exc:
        raise RelayRefusal("bad_proof", f"attach proof is not valid for this key: {exc}") from None
    if claims["role"] != attach.role:
        raise RelayRefusal("bad_proof", "attach proof is for another node or role")
    if not secrets.compare_digest(str(claims["nonce"]), nonce):
        raise RelayRefusal("bad_proof", "attach proof signs another challenge (replayed?)")


class ConnectTokens:
    """Checks CONNECT tokens against the trusted trackers' keys; with none trusted, the relay is open."""

    def __init__(self, trusted_tracker_keys: tuple[str, ...]) -> None:
        self._trackers = [(tracker_issuer_for(key), HotVerifyKey(key)) for key in map(parse_public_key, trusted_tracker_keys)]
        self._seen: dict[str, float] = {}  # jti -> expiry: each token opens one connection
        # Tokens used before a restart are forgotten with it: a token issued before this second is refused, so
        # one captured earlier cannot be replayed now (a tracker's clock behind ours costs a retry, not a hole).
        self._started_s = int(time.time())

    @property
    def open(self) -> bool:
        return not self._trackers

    def authorise(self, target: str, authorization: str, audience: str) -> None:
        """A CONNECT must carry a fresh token from a trusted tracker for this relay and this node, used once."""
        if self.open:
            return
        scheme, _, token = authorization.partition(" ")
        if scheme != RELAY_CONNECT_AUTH_SCHEME or not token:
            raise RelayRefusal("connect_unauthorised", f"CONNECT needs Proxy-Authorization: {RELAY_CONNECT_AUTH_SCHEME} <tracker token>")
        node_id = target.rsplit(":", 1)[0]
        for issuer, key in self._trackers:
            try:
                claims = verify(token.strip(), key, RELAY_CONNECT_TOKEN, issuer=issuer, audience=audience, subject=node_id)
            except TokenRefused as exc:
                if exc.fault == "bad_signature":
                    continue  # another trusted tracker's, maybe
                raise RelayRefusal("connect_unauthorised", f"CONNECT token refused: {exc}") from None
            if claims["iat"] < self._started_s:
                raise RelayRefusal("connect_unauthorised", "CONNECT token was issued before this relay started; ask for a fresh one")
            now = time.time()
            if len(self._seen) > SEEN_TOKENS_BEFORE_SWEEP:
                self._seen = {j: e for j, e in self._seen.items() if e + CLOCK_SKEW_S >= now}
            jti = str(claims["jti"])
            if jti in self._seen:
                raise RelayRefusal("connect_unauthorised", "CONNECT token already used")
            self._seen[jti] = float(claims["exp"])
            return
        raise RelayRefusal("connect_unauthorised", "CONNECT token is not signed by a tracker this relay trusts")


__all__ = ["ConnectTokens", "verify_attach"]
