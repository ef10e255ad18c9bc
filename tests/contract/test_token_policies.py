"""Every kind of signed token, played by an attacker against `signing.verify` and its kind's policy.

For each policy: a token that lives longer than the policy allows (a day, or one second more), one
issued beyond the clock window ahead, one expired beyond it, one naming another issuer, audience or
subject, one missing each required claim, one signed for another body, one with a bad signature:
all refused, each for its reason; a token at either edge of the clock window passes. Keys are made
by the project's own helpers, as a node and a tracker make theirs.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.contract.protocol import CLOCK_SKEW_S
from meshnet_gguf.contract.signing import (
    BODY_CHECKED_LATER,
    BY_CALLER,
    HotVerifyKey,
    TokenPolicy,
    TokenRefused,
    body_sha256,
    encode_token,
    issue,
    load_or_create_private_key,
    verify,
)
from meshnet_gguf.contract.token_policies import (
    ALL_POLICIES,
    AUDIT_TOKEN,
    NODE_CONTROL_TOKEN,
    POOL_STATUS_TOKEN,
    RECEIPT_TOKEN,
    ROUTE_TOKEN,
)
from meshnet_gguf.llama.rpc_status import check_status_token, status_token

BODY = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}]}'
DAY_S = 86_400
# What the caller expects where a policy matches a claim against a value the call gives.
EXPECTED = {"iss": "the-expected-issuer", "aud": "the-expected-audience", "sub": "the-expected-subject"}
MATCHED = (("iss", "issuer", "wrong_issuer"), ("aud", "audience", "wrong_audience"), ("sub", "subject", "wrong_subject"))
WITH_LIFE = [p for p in ALL_POLICIES if p.max_life_s is not None]
BINDING_BODY = [p for p in ALL_POLICIES if p.binds_body]


@pytest.fixture(scope="module")
def signer(tmp_path_factory: pytest.TempPathFactory) -> Ed25519PrivateKey:
    return load_or_create_private_key(tmp_path_factory.mktemp("signer") / "key.pem")


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Ed25519PrivateKey:
    return load_or_create_private_key(tmp_path_factory.mktemp("stranger") / "key.pem")


def claims_for(policy: TokenPolicy, now: float, **over: Any) -> dict[str, Any]:
    """Claims a genuine signer of this kind would write, then `over` (None removes a claim)."""
    claims: dict[str, Any] = {name: f"some-{name}" for name in policy.required}
    for claim, _, _ in MATCHED:
        rule = getattr(policy, {"iss": "issuer", "aud": "audience", "sub": "subject"}[claim])
        if rule is BY_CALLER:
            claims[claim] = EXPECTED[claim]
        elif isinstance(rule, str):
            claims[claim] = rule
    claims["iat"] = int(now)
    if policy.max_life_s is not None:
        claims["exp"] = int(now) + policy.max_life_s
    if policy.binds_body:
        claims["body_sha256"] = body_sha256(BODY)
    claims.update(over)
    return {name: value for name, value in claims.items() if value is not None}


def expectations(policy: TokenPolicy) -> dict[str, Any]:
    """What the verifying site passes for this kind."""
    given: dict[str, Any] = {kwarg: EXPECTED[claim] for claim, kwarg, _ in MATCHED if getattr(policy, kwarg) is BY_CALLER}
    if policy.binds_body:
        given["body"] = BODY
    return given


def refused(token: str, key: Any, policy: TokenPolicy, now: float, **given: Any) -> TokenRefused:
    with pytest.raises(TokenRefused) as info:
        verify(token, key, policy, now=now, **{**expectations(policy), **given})
    return info.value


def by_kind(policies: list[TokenPolicy] | tuple[TokenPolicy, ...]) -> Any:
    return pytest.mark.parametrize("policy", policies, ids=[p.kind for p in policies])


@by_kind(ALL_POLICIES)
def test_a_token_at_either_edge_of_the_clock_window_passes(policy: TokenPolicy, signer: Ed25519PrivateKey) -> None:
    now = time.time()
    window = policy.clock_window_s
    ahead = claims_for(policy, now, iat=int(now) + window - 1)
    if policy.max_life_s is not None:
        ahead["exp"] = ahead["iat"] + policy.max_life_s
    assert verify(encode_token(ahead, signer), signer.public_key(), policy, now=now, **expectations(policy)) == ahead
    if policy.max_life_s is not None:
        almost_expired = claims_for(policy, now, exp=int(now) - window + 1, iat=int(now) - window + 1 - policy.max_life_s)
        verify(encode_token(almost_expired, signer), signer.public_key(), policy, now=now, **expectations(policy))


@by_kind(WITH_LIFE)
@pytest.mark.parametrize("extra_life_s", [1, DAY_S])
def test_a_token_living_longer_than_its_kind_allows_is_refused(policy: TokenPolicy, extra_life_s: int, signer: Ed25519PrivateKey) -> None:
    now = time.time()
    assert policy.max_life_s is not None
    token = encode_token(claims_for(policy, now, exp=int(now) + policy.max_life_s + extra_life_s), signer)
    assert refused(token, signer.public_key(), policy, now).fault == "life_too_long"


def test_an_audit_token_for_a_day_is_refused_and_the_tracker_issues_within_the_audit_life(signer: Ed25519PrivateKey) -> None:
    """The verifier's check promised a short life and bounded none: a captured audit token was good for as long as
    its signer wrote. Now its life is a route's, and what the tracker issues lives exactly that."""
    now = time.time()
    tracker = {"issuer": EXPECTED["iss"], "body": BODY}
    day = encode_token(claims_for(AUDIT_TOKEN, now, exp=int(now) + DAY_S), signer)
    assert refused(day, signer.public_key(), AUDIT_TOKEN, now, **tracker).fault == "life_too_long"
    issued = issue(AUDIT_TOKEN, signer, {"iss": EXPECTED["iss"], "jti": "audit-1", "body_sha256": body_sha256(BODY)}, now=now)
    claims = verify(issued, signer.public_key(), AUDIT_TOKEN, now=now, **tracker)
    assert claims["sub"] == "audit" and claims["exp"] - claims["iat"] == AUDIT_TOKEN.max_life_s == 60
    # The audit window is a node's, no longer 30 s: a token from 10 s ahead is refused.
    ahead = encode_token(claims_for(AUDIT_TOKEN, now, iat=int(now) + 10), signer)
    assert refused(ahead, signer.public_key(), AUDIT_TOKEN, now, **tracker).fault == "not_yet_valid"


@by_kind(ALL_POLICIES)
def test_a_token_from_beyond_the_clock_window_ahead_is_refused(policy: TokenPolicy, signer: Ed25519PrivateKey) -> None:
    now = time.time()
    too_far = int(now) + policy.clock_window_s + 1
    issued_ahead = claims_for(policy, now, iat=too_far)
    if policy.max_life_s is not None:
        issued_ahead["exp"] = too_far + 1
    error = refused(encode_token(issued_ahead, signer), signer.public_key(), policy, now)
    assert error.fault == "not_yet_valid" and error.claims == issued_ahead  # signed: a site may leave it for later
    not_before = encode_token(claims_for(policy, now, nbf=too_far), signer)
    assert refused(not_before, signer.public_key(), policy, now).fault == "not_yet_valid"


@by_kind(WITH_LIFE)
def test_a_token_expired_beyond_the_clock_window_is_refused(policy: TokenPolicy, signer: Ed25519PrivateKey) -> None:
    now = time.time()
    expired = int(now) - policy.clock_window_s - 1
    token = encode_token(claims_for(policy, now, iat=expired - 10, exp=expired), signer)
    assert refused(token, signer.public_key(), policy, now).fault == "expired"


def test_only_records_and_nonce_answers_have_no_expiry() -> None:
    """A receipt is resent until settled (each request id billed once); a control proof answers one fresh nonce.
    Every other kind authorises an act and must expire."""
    assert {p.kind for p in ALL_POLICIES if p.max_life_s is None} == {RECEIPT_TOKEN.kind, NODE_CONTROL_TOKEN.kind}
    assert ROUTE_TOKEN.clock_window_s == AUDIT_TOKEN.clock_window_s == CLOCK_SKEW_S
    assert POOL_STATUS_TOKEN.clock_window_s > CLOCK_SKEW_S  # the one exception: desk boxes without NTP


@by_kind(ALL_POLICIES)
def test_a_token_for_another_issuer_audience_or_subject_is_refused(policy: TokenPolicy, signer: Ed25519PrivateKey) -> None:
    now = time.time()
    matched = [(claim, fault) for claim, kwarg, fault in MATCHED if getattr(policy, kwarg) is not None]
    assert matched, "every kind names who it is from or for"
    for claim, fault in matched:
        token = encode_token(claims_for(policy, now, **{claim: "someone-else"}), signer)
        assert refused(token, signer.public_key(), policy, now).fault == fault, claim


@by_kind(ALL_POLICIES)
def test_a_token_missing_any_required_claim_is_refused(policy: TokenPolicy, signer: Ed25519PrivateKey) -> None:
    now = time.time()
    for claim in sorted(policy.required):
        token = encode_token(claims_for(policy, now, **{claim: None}), signer)
        error = refused(token, signer.public_key(), policy, now)
        assert error.fault == "missing_claim" and claim in str(error), claim


@by_kind(BINDING_BODY)
def test_a_token_signed_for_another_body_is_refused(policy: TokenPolicy, signer: Ed25519PrivateKey) -> None:
    now = time.time()
    token = encode_token(claims_for(policy, now), signer)
    assert refused(token, signer.public_key(), policy, now, body=BODY + b" ").fault == "body_mismatch"
    # A site cannot forget the body: it passes one, or says it checks it later.
    with pytest.raises(TypeError):
        verify(token, signer.public_key(), policy, now=now, **{**expectations(policy), "body": None})
    assert verify(token, signer.public_key(), policy, now=now, **{**expectations(policy), "body": BODY_CHECKED_LATER})


@by_kind(ALL_POLICIES)
@pytest.mark.parametrize("claim", ["iat", "exp", "nbf"])
@pytest.mark.parametrize("bad_time", ["NaN", "Infinity", "-Infinity", "true", '"1700000000"'])
def test_a_token_whose_time_is_not_a_finite_number_is_refused(
    policy: TokenPolicy, claim: str, bad_time: str, signer: Ed25519PrivateKey
) -> None:
    """Python's json reads NaN and Infinity, and NaN passes every comparison: a signer could otherwise write a
    token that never expires (a receipt never from the future)."""
    now = time.time()
    payload = json.dumps(claims_for(policy, now, **{claim: 0})).replace(f'"{claim}": 0', f'"{claim}": {bad_time}')
    signing_input = _b64(b'{"alg":"EdDSA","typ":"JWT"}') + "." + _b64(payload.encode())
    token = signing_input + "." + _b64(signer.sign(signing_input.encode()))
    assert refused(token, signer.public_key(), policy, now).fault == "malformed"


@by_kind(ALL_POLICIES)
def test_a_token_with_a_bad_signature_is_refused(policy: TokenPolicy, signer: Ed25519PrivateKey, stranger: Ed25519PrivateKey) -> None:
    now = time.time()
    claims = claims_for(policy, now)
    by_stranger = refused(encode_token(claims, stranger), signer.public_key(), policy, now)
    assert by_stranger.fault == "bad_signature" and by_stranger.claims is None
    header, payload, signature = encode_token(claims, signer).split(".")
    tampered = _b64(json.dumps({**claims, "iat": int(now) - 1}).encode())
    assert refused(f"{header}.{tampered}.{signature}", signer.public_key(), policy, now).fault == "bad_signature"
    unsigned = _b64(b'{"alg":"none","typ":"JWT"}') + f".{payload}."
    assert refused(unsigned, signer.public_key(), policy, now).fault == "malformed"


@by_kind(ALL_POLICIES)
def test_a_signature_spelt_another_way_is_refused(policy: TokenPolicy, signer: Ed25519PrivateKey) -> None:
    """The same 64 signature bytes with other padding bits in the last base64url character: a second text
    for one token, which a lenient decoder reads as the genuine signature."""
    now = time.time()
    signing_input, signature = encode_token(claims_for(policy, now), signer).rsplit(".", 1)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    last = alphabet.index(signature[-1])
    respelt = [signature[:-1] + alphabet[(last & 0b110000) | low] for low in range(1, 16)]
    assert all(base64.urlsafe_b64decode(s + "==") == base64.urlsafe_b64decode(signature + "==") for s in respelt)
    for other in respelt:
        assert refused(f"{signing_input}.{other}", signer.public_key(), policy, now).fault == "malformed"


@by_kind(ALL_POLICIES)
def test_the_libsodium_and_openssl_keys_agree(policy: TokenPolicy, signer: Ed25519PrivateKey, stranger: Ed25519PrivateKey) -> None:
    now = time.time()
    claims = claims_for(policy, now)
    for key in (signer.public_key(), HotVerifyKey(signer.public_key())):
        assert verify(encode_token(claims, signer), key, policy, now=now, **expectations(policy)) == claims
        assert refused(encode_token(claims, stranger), key, policy, now).fault == "bad_signature"


@by_kind(ALL_POLICIES)
def test_issue_writes_a_token_its_policy_accepts_and_no_longer_lived_one(policy: TokenPolicy, signer: Ed25519PrivateKey) -> None:
    now = time.time()
    given = {name: value for name, value in claims_for(policy, now).items() if name not in ("iat", "exp")}
    verify(issue(policy, signer, given, now=now), signer.public_key(), policy, now=now, **expectations(policy))
    with pytest.raises(ValueError):
        issue(policy, signer, given, life_s=(policy.max_life_s or 0) + 1, now=now)


def test_a_pool_status_token_living_longer_than_one_read_is_refused_by_the_worker(tmp_path: Path) -> None:
    node_key = load_or_create_private_key(tmp_path / "node.pem")
    check_status_token(status_token(node_key), node_key.public_key())
    now = int(time.time())
    two_minutes = encode_token({"aud": POOL_STATUS_TOKEN.audience, "iat": now, "exp": now + 120}, node_key)
    with pytest.raises(TokenRefused, match="at most 60 s"):
        check_status_token(two_minutes, node_key.public_key())


def test_a_policy_cannot_check_a_claim_it_does_not_require() -> None:
    with pytest.raises(ValueError, match="without requiring"):
        TokenPolicy(kind="loose", required=frozenset({"iat"}), clock_window_s=5, max_life_s=60, issuer=BY_CALLER)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")
