"""The node's identity: an Ed25519 key in the state directory and the node id derived from it.

The key is created on first run (mode 0600) and never leaves the machine; the
tracker learns the public half at registration and checks every node-signed
thing (request auth, usage receipts) against it.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshnet_gguf.contract.protocol import NODE_AUTH_LIFETIME_S, NodeControlClaims, ReceiptClaims, UsageReceipt, UsageRecord
from meshnet_gguf.contract.signing import (
    body_sha256,
    encode_token,
    load_or_create_private_key,
    load_private_key,
    node_id_for,
    public_key_text,
)

NODE_KEY_FILE = "node_key.pem"


@dataclass(frozen=True)
class NodeIdentity:
    private_key: Ed25519PrivateKey
    node_id: str
    public_key_text: str

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    @classmethod
    def load_or_create(cls, state_dir: Path) -> NodeIdentity:
        return cls.from_private_key(load_or_create_private_key(Path(state_dir) / NODE_KEY_FILE))

    @classmethod
    def load(cls, state_dir: Path) -> NodeIdentity:
        """The key already in the state dir (`FileNotFoundError` when the node never started): for readers such as doctor."""
        return cls.from_private_key(load_private_key(Path(state_dir) / NODE_KEY_FILE))

    @classmethod
    def from_private_key(cls, key: Ed25519PrivateKey) -> NodeIdentity:
        public = key.public_key()
        return cls(private_key=key, node_id=node_id_for(public), public_key_text=public_key_text(public))

    def sign_receipt(self, record: UsageRecord, now: float | None = None) -> UsageReceipt:
        claims = ReceiptClaims(
            iss=self.node_id,
            jti=record.request_id,
            iat=int(time.time() if now is None else now),
            usage=record,
        )
        return UsageReceipt(request_id=record.request_id, token=encode_token(claims.model_dump(), self.private_key))

    def request_auth(self, method: str, path: str, body: bytes, audience: str, now: float | None = None) -> str:
        """Bearer token for one node -> tracker call (binds method, path, body and the tracker's issuer)."""
        issued = int(time.time() if now is None else now)
        claims = {
            "iss": self.node_id,
            "aud": audience,
            "iat": issued,
            "exp": issued + NODE_AUTH_LIFETIME_S,
            "htm": method.upper(),
            "htu": path,
            "body_sha256": body_sha256(body),
            "jti": secrets.token_urlsafe(16),  # fresh per call: the tracker accepts each token once
        }
        return encode_token(claims, self.private_key)

    def sign_control_proof(self, nonce: str, audience: str, now: float | None = None) -> str:
        """Answer a tracker's reachability challenge: its nonce, signed by this node's key."""
        claims = NodeControlClaims(iss=self.node_id, aud=audience, nonce=nonce, iat=int(time.time() if now is None else now))
        return encode_token(claims.model_dump(), self.private_key)
