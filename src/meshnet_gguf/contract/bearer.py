"""The `Authorization: Bearer` header, read one way by every HTTP door a node has.

It sits in the contract rather than in `serving/access` because the pool worker's status
port (`llama/rpc_status`) reads the same header and `llama/` may not import `serving/`;
the node's own rules (API key, metrics key, pages) build on it in `serving/access`.
"""

from __future__ import annotations

import hmac

BEARER_SCHEME = "Bearer"


def bearer_matches(given: bytes, key: str) -> bool:
    """True when `given`, an Authorization header's raw bytes, is exactly `Bearer <key>`.

    Constant time, so the comparison does not tell an attacker how much of a guess was right.
    The key is compared as UTF-8, the bytes a client sends for it: encoding it as latin-1 with
    replacement would let `?` stand for any character outside latin-1.
    """
    return hmac.compare_digest(given, f"{BEARER_SCHEME} {key}".encode())


def bearer_token(value: str) -> str | None:
    """The token of `Bearer <token>` (the scheme in any case, as HTTP allows), or None."""
    scheme, _, token = value.partition(" ")
    return token if scheme.lower() == BEARER_SCHEME.lower() and token else None


__all__ = ["BEARER_SCHEME", "bearer_matches", "bearer_token"]
