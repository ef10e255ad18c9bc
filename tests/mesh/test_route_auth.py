"""Route tokens: only a fresh, unused route the pinned tracker signed for this node, this model,
all layers and this exact body gets a request through."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.contract.protocol import CLOCK_SKEW_S, ROUTE_HEADER
from meshnet_gguf.contract.signing import body_sha256, encode_token, tracker_issuer_for
from meshnet_gguf.mesh.route_auth import ReplayCache, RouteRejected, RouteVerifier

NODE = "node-self"
MODEL = "tiny"
LAYERS = 2
PATH = "/v1/chat/completions"
BODY = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'
TRACKER_KEY = Ed25519PrivateKey.generate()


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def claims(**over: Any) -> dict[str, Any]:
    now = int(time.time())
    base: dict[str, Any] = {
        "iss": tracker_issuer_for(TRACKER_KEY.public_key()),
        "sub": NODE,
        "jti": f"req-{time.perf_counter_ns()}",
        "iat": now,
        "exp": now + 30,
        "path": PATH,
        "model": MODEL,
        "hops": [{"node_id": NODE, "first_layer": 0, "last_layer": LAYERS - 1}],
        "body_sha256": body_sha256(BODY),
        "max_tokens": 8,
    }
    base.update(over)
    return base


def headers(c: dict[str, Any], key: Ed25519PrivateKey = TRACKER_KEY) -> dict[str, str]:
    return {ROUTE_HEADER: encode_token(c, key)}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def verifier(clock: Clock) -> RouteVerifier:
    return RouteVerifier(TRACKER_KEY.public_key(), node_id=NODE, model_id=MODEL, total_layers=LAYERS, clock=clock)


def rejected(verifier: RouteVerifier, hdrs: dict[str, str], body: bytes = BODY, path: str = PATH) -> RouteRejected:
    with pytest.raises(RouteRejected) as info:
        verifier.verify(hdrs, body, path)
    return info.value


def test_a_proper_route_passes_and_returns_its_claims(verifier: RouteVerifier) -> None:
    c = claims()
    verified = verifier.verify(headers(c), BODY, PATH)
    assert verified.jti == c["jti"] and verified.max_tokens == 8


def test_header_lookup_is_case_insensitive_for_plain_dicts(verifier: RouteVerifier) -> None:
    token = headers(claims())[ROUTE_HEADER]
    assert verifier.verify({ROUTE_HEADER.lower(): token}, BODY, PATH).sub == NODE


def test_missing_route_is_401(verifier: RouteVerifier) -> None:
    err = rejected(verifier, {})
    assert (err.status, err.code) == (401, "route_missing")
    assert "through the tracker" in err.message


def test_forged_signature_is_401(verifier: RouteVerifier) -> None:
    err = rejected(verifier, headers(claims(), key=Ed25519PrivateKey.generate()))
    assert (err.status, err.code) == (401, "route_bad_signature")


def test_tampered_claims_break_the_signature(verifier: RouteVerifier) -> None:
    token = headers(claims(max_tokens=8))[ROUTE_HEADER]
    head, payload, sig = token.split(".")
    data = json.loads(base64.urlsafe_b64decode(payload + "=="))
    data["max_tokens"] = 100000
    forged = base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()
    err = rejected(verifier, {ROUTE_HEADER: f"{head}.{forged}.{sig}"})
    assert (err.status, err.code) == (401, "route_bad_signature")


def test_every_altered_signature_is_refused_by_the_libsodium_check(verifier: RouteVerifier) -> None:
    """The route's signature is checked with libsodium (contract/signing.HotVerifyKey), not OpenSSL: a
    flipped bit anywhere in it, or its S half pushed past the group order (the malleable twin
    of a valid signature, S + L), is refused as a bad signature, never accepted."""
    token = headers(claims())[ROUTE_HEADER]
    head, payload, sig = token.split(".")
    raw = base64.urlsafe_b64decode(sig + "==")
    group_order = 2**252 + 27742317777372353535851937790883648493

    def with_signature(signature: bytes) -> dict[str, str]:
        return {ROUTE_HEADER: f"{head}.{payload}." + base64.urlsafe_b64encode(signature).rstrip(b"=").decode()}

    for bit in (0, 7, 255, 256, 300, 511):
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert rejected(verifier, with_signature(bytes(flipped))).code == "route_bad_signature", bit
    s_plus_l = (int.from_bytes(raw[32:], "little") + group_order).to_bytes(32, "little")
    assert rejected(verifier, with_signature(raw[:32] + s_plus_l)).code == "route_bad_signature"
    assert verifier.verify(with_signature(raw), BODY, PATH).sub == NODE  # the untouched one still passes


def test_unsigned_and_hmac_tokens_are_refused(verifier: RouteVerifier) -> None:
    """Algorithm confusion: 'none' or HS256 keyed with public bytes must not pass."""
    import jwt

    unsigned = jwt.encode(claims(), key=None, algorithm="none")
    assert rejected(verifier, {ROUTE_HEADER: unsigned}).status == 401
    hmac_token = jwt.encode(claims(), key="x" * 32, algorithm="HS256")
    assert rejected(verifier, {ROUTE_HEADER: hmac_token}).status == 401
    assert rejected(verifier, {ROUTE_HEADER: "not-a-jwt"}).code == "route_malformed"


def test_tokens_the_fast_check_must_still_refuse(verifier: RouteVerifier, clock: Clock) -> None:
    """The node checks the compact JWS itself: every shape PyJWT refused is still refused."""
    import jwt

    # A critical extension the node does not know, properly signed: refused, not ignored.
    crit = jwt.encode(claims(), TRACKER_KEY, algorithm="EdDSA", headers={"crit": ["exp"]})
    assert rejected(verifier, {ROUTE_HEADER: crit}).code == "route_malformed"
    token = headers(claims())[ROUTE_HEADER]
    head, payload, sig = token.split(".")
    for broken in (
        f"{head}.{payload}",
        f"{head}.{payload}.{sig}.{sig}",
        f"{head}.{payload}.{sig[:-8]}",
        f"{head}.{payload}.",
        "a.b.c",
        "é.é.é",
    ):
        assert rejected(verifier, {ROUTE_HEADER: broken}).status == 401, broken
    # A header nested deeper than the JSON parser goes, unsigned: a clean refusal, not a crash.
    deep = base64.urlsafe_b64encode(b"[" * 50_000).rstrip(b"=").decode()
    assert rejected(verifier, {ROUTE_HEADER: f"{deep}.{payload}.{sig}"}).code == "route_malformed"
    # Claims that are not a JSON object, signed.
    listed = jwt.api_jws.encode(b"[1, 2]", TRACKER_KEY, algorithm="EdDSA")
    assert rejected(verifier, {ROUTE_HEADER: listed}).code == "route_malformed"
    # Not valid before a time that has not come.
    err = rejected(verifier, headers(claims(nbf=int(clock.now) + 60)))
    assert (err.status, err.code) == (401, "route_not_yet_valid")


def test_expired_route_is_401_but_skew_is_tolerated(verifier: RouteVerifier, clock: Clock) -> None:
    now = int(clock.now)
    err = rejected(verifier, headers(claims(iat=now - 50, exp=now - CLOCK_SKEW_S - 1)))
    assert (err.status, err.code) == (401, "route_expired")
    # Expired by less than the skew: the node's clock may be the one that is ahead.
    verifier.verify(headers(claims(iat=now - 40, exp=now - CLOCK_SKEW_S + 2)), BODY, PATH)


def test_route_from_the_future_is_401(verifier: RouteVerifier, clock: Clock) -> None:
    now = int(clock.now)
    err = rejected(verifier, headers(claims(iat=now + 60, exp=now + 90)))
    assert (err.status, err.code) == (401, "route_not_yet_valid")


def test_route_living_longer_than_60s_is_401(verifier: RouteVerifier, clock: Clock) -> None:
    now = int(clock.now)
    err = rejected(verifier, headers(claims(iat=now, exp=now + 61)))
    assert (err.status, err.code) == (401, "route_lifetime_too_long")


def test_other_issuer_with_the_right_key_is_401(verifier: RouteVerifier) -> None:
    err = rejected(verifier, headers(claims(iss="tracker-someone-else")))
    assert (err.status, err.code) == (401, "route_wrong_issuer")


def test_missing_claim_is_401(verifier: RouteVerifier) -> None:
    c = claims()
    del c["body_sha256"]
    assert rejected(verifier, headers(c)).code == "route_malformed"


def test_route_for_another_node_is_403(verifier: RouteVerifier) -> None:
    err = rejected(verifier, headers(claims(sub="node-other")))
    assert (err.status, err.code) == (403, "route_wrong_node")
    err = rejected(verifier, headers(claims(hops=[{"node_id": "node-other", "first_layer": 0, "last_layer": 1}])))
    assert (err.status, err.code) == (403, "route_wrong_node")


def test_wrong_model_is_403(verifier: RouteVerifier) -> None:
    err = rejected(verifier, headers(claims(model="other-model")))
    assert (err.status, err.code) == (403, "route_wrong_model")


def test_multi_hop_route_is_403(verifier: RouteVerifier) -> None:
    hops = [{"node_id": NODE, "first_layer": 0, "last_layer": 0}, {"node_id": "node-b", "first_layer": 1, "last_layer": 1}]
    err = rejected(verifier, headers(claims(hops=hops)))
    assert (err.status, err.code) == (403, "route_not_single_hop")
    assert rejected(verifier, headers(claims(hops=[]))).code == "route_not_single_hop"


@pytest.mark.parametrize("first,last", [(0, 0), (1, 1), (0, 5)])
def test_partial_or_wrong_coverage_is_403(verifier: RouteVerifier, first: int, last: int) -> None:
    err = rejected(verifier, headers(claims(hops=[{"node_id": NODE, "first_layer": first, "last_layer": last}])))
    assert (err.status, err.code) == (403, "route_coverage_mismatch")


def test_tampered_body_is_403(verifier: RouteVerifier) -> None:
    tampered = BODY.replace(b'"max_tokens":8', b'"max_tokens":9999')
    err = rejected(verifier, headers(claims()), body=tampered)
    assert (err.status, err.code) == (403, "route_body_mismatch")


def test_route_for_another_endpoint_is_403(verifier: RouteVerifier) -> None:
    err = rejected(verifier, headers(claims()), path="/v1/completions")
    assert (err.status, err.code) == (403, "route_wrong_path")


def test_replay_is_403_and_refused_routes_do_not_burn_their_id(verifier: RouteVerifier) -> None:
    c = claims()
    # A refusal for another reason first: the request id must still be usable afterwards.
    rejected(verifier, headers(c), body=b"{}")
    verifier.verify(headers(c), BODY, PATH)
    err = rejected(verifier, headers(c))
    assert (err.status, err.code) == (403, "route_replayed")


def test_replay_cache_forgets_only_after_expiry_and_stays_bounded(clock: Clock) -> None:
    cache = ReplayCache(max_entries=2)
    now = clock.now
    cache.remember("a", now + 10, now)
    cache.remember("b", now + 10, now)
    with pytest.raises(RouteRejected) as info:
        cache.remember("c", now + 10, now)
    assert info.value.status == 503  # full of live routes: refuse rather than forget one
    with pytest.raises(RouteRejected):
        cache.remember("a", now + 10, now + 5)  # still live
    later = now + 10 + CLOCK_SKEW_S + 1
    cache.remember("c", later + 10, later)  # a and b expired and were pruned
    assert len(cache) == 1


def test_max_tokens_claim_reaches_the_caller(verifier: RouteVerifier) -> None:
    assert verifier.verify(headers(claims(max_tokens=3)), BODY, PATH).max_tokens == 3
    assert verifier.verify(headers(claims(max_tokens=None)), BODY, PATH).max_tokens is None


def test_tokens_signed_by_the_libsodium_encoder_are_pyjwts_byte_for_byte() -> None:
    """`encode_token` builds the JWS by hand and signs with libsodium: every token must be the very
    one PyJWT would make (Ed25519 is deterministic), so any verifier reads it, and each key signs
    with itself (the cache of libsodium keys never mixes two up)."""
    import jwt
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from meshnet_gguf.contract.signing import encode_token

    keys = [Ed25519PrivateKey.generate() for _ in range(20)]  # more than the cache holds
    samples = [
        claims(),
        {"iss": "node-x", "jti": "r-1", "iat": 1, "usage": {"prompt_tokens": 3, "ratio": 1.5, "text": 'é ☃ "q"', "none": None, "ok": True}},
        {"aud": "rpc-status", "iat": 0, "exp": 2**40, "list": [1, "two", {"three": 3}]},
    ]
    for round_ in range(2):  # the second round signs with keys the cache has already dropped
        for key in keys:
            for sample in samples:
                token = encode_token(sample, key)
                assert token == jwt.encode(sample, key, algorithm="EdDSA"), round_
                assert (
                    jwt.decode(token, key.public_key(), algorithms=["EdDSA"], options={"verify_aud": False, "verify_exp": False}) == sample
                )
