#!/usr/bin/env python3
"""Which way of checking a signed token is fastest, for every token kind (`contract.token_policies`).

    PYTHONPATH=src python bench/token_check_paths.py [--tokens N]

For each kind, one genuine token checked N times each way, p50 per check:

- `PyJWT decode`: `jwt.decode` with the kind's required claims, audience and clock leeway (the
  generic path five sites used), OpenSSL's Ed25519 underneath;
- `by hand, OpenSSL`: the compact JWS parsed by hand, the signature checked by `cryptography`;
- `verify, key per call`: `signing.verify` given an `Ed25519PublicKey` (libsodium, its key made per call);
- `verify, hot key`: `signing.verify` given a `HotVerifyKey` made once (what the route gate does).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.contract.signing import BY_CALLER, HotVerifyKey, TokenPolicy, _signed_claims, body_sha256, issue, verify
from meshnet_gguf.contract.token_policies import ALL_POLICIES

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":32}'
EXPECTED = {"iss": "the-issuer", "aud": "the-audience", "sub": "the-subject"}
ROUTE_EXTRAS = {
    "path": "/v1/chat/completions",
    "model": "m",
    "hops": [{"node_id": "n", "first_layer": 0, "last_layer": 1}],
    "max_tokens": 32,
}


def p50_us(check: Callable[[], Any], n: int) -> float:
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        check()
        took.append(time.perf_counter() - t0)
    return statistics.median(took) * 1e6


def genuine(policy: TokenPolicy, key: Ed25519PrivateKey) -> tuple[str, dict[str, Any]]:
    """A token of this kind as its signer issues it, and what its verifying site passes to `verify`."""
    fixed = {claim for claim, rule in (("aud", policy.audience), ("sub", policy.subject)) if isinstance(rule, str)}
    claims: dict[str, Any] = {name: f"some-{name}" for name in policy.required - fixed - {"iat", "exp"}}
    claims.update(ROUTE_EXTRAS if policy.kind == "route" else {})
    given: dict[str, Any] = {}
    for claim, kwarg in (("iss", "issuer"), ("aud", "audience"), ("sub", "subject")):
        if getattr(policy, kwarg) is BY_CALLER:
            claims[claim] = given[kwarg] = EXPECTED[claim]
    if policy.binds_body:
        claims["body_sha256"] = body_sha256(BODY)
        given["body"] = BODY
    return issue(policy, key, claims), given


def ways(policy: TokenPolicy, key: Ed25519PrivateKey) -> list[Callable[[], Any]]:
    token, given = genuine(policy, key)
    public, hot = key.public_key(), HotVerifyKey(key.public_key())
    audience = given.get("audience") or (policy.audience if isinstance(policy.audience, str) else None)
    options = {"require": sorted(policy.required), "verify_aud": audience is not None}
    return [
        lambda: jwt.decode(token, public, algorithms=["EdDSA"], audience=audience, leeway=policy.clock_window_s, options=options),
        lambda: _signed_claims(token, public),  # type: ignore[arg-type]  # any key with `verify(signature, data)`
        lambda: verify(token, public, policy, **given),
        lambda: verify(token, hot, policy, **given),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=3000)
    args = parser.parse_args()
    key = Ed25519PrivateKey.generate()
    print(f"{'kind':<20} {'PyJWT decode':>13} {'by hand, OpenSSL':>17} {'verify, key per call':>21} {'verify, hot key':>16}  (p50, µs)")
    for policy in ALL_POLICIES:
        figures = [p50_us(check, args.tokens) for check in ways(policy, key)]
        print(f"{policy.kind:<20} {figures[0]:13.1f} {figures[1]:17.1f} {figures[2]:21.1f} {figures[3]:16.1f}")


if __name__ == "__main__":
    main()
