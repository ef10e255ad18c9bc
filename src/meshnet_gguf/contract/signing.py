"""Ed25519 keys and EdDSA JWTs: the one signature format on the Meshnet wire.

Shared by the node and the reference tracker (floor 1), so both sides pin the
same algorithm and key encodings. Every signed token is checked by `verify`
against its kind's `TokenPolicy` (the constants are in `contract.token_policies`):
issuer, audience or subject, longest life, clock window, required claims and
body binding are decided once per kind; what only one kind means (a route's
hops, a node call's method and path) stays with its user.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import jwt
import nacl.exceptions
import nacl.signing
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshnet_gguf.common.atomic_file import write_atomically

ALGORITHM = "EdDSA"
# 26 base32 characters = 130 bits of the key's sha256: collision-free for any mesh size.
_FINGERPRINT_CHARS = 26
KEY_FILE_MODE = 0o600
STATE_DIR_MODE = 0o700


class KeyFormatError(ValueError):
    """A public key string is neither PEM nor base64url of 32 raw Ed25519 bytes."""


def public_key_text(key: Ed25519PublicKey) -> str:
    """base64url (no padding) of the 32 raw bytes: short enough for a flag or an env var."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def parse_public_key(text: str) -> Ed25519PublicKey:
    """Accept what `public_key_text` writes, or a PEM SubjectPublicKeyInfo."""
    text = text.strip()
    try:
        if text.startswith("-----BEGIN"):
            key = serialization.load_pem_public_key(text.encode("ascii"))
            if not isinstance(key, Ed25519PublicKey):
                raise KeyFormatError("the PEM key is not an Ed25519 key")
            return key
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        return Ed25519PublicKey.from_public_bytes(raw)
    except KeyFormatError:
        raise
    except (ValueError, TypeError) as exc:
        raise KeyFormatError(f"not an Ed25519 public key (PEM or base64url of 32 bytes): {exc}") from None


def key_fingerprint(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    digest = base64.b32encode(hashlib.sha256(raw).digest()).decode("ascii").lower()
    return digest[:_FINGERPRINT_CHARS]


def node_id_for(key: Ed25519PublicKey) -> str:
    """A node's id is its key's fingerprint, so the tracker can check a claimed id against its key."""
    return f"node-{key_fingerprint(key)}"


def tracker_issuer_for(key: Ed25519PublicKey) -> str:
    """The `iss` of route tokens; derived from the key, so pinning the key pins the issuer too."""
    return f"tracker-{key_fingerprint(key)}"


def body_sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def load_or_create_private_key(path: Path) -> Ed25519PrivateKey:
    """Load the PEM key at `path`, creating it (mode 0600) on first use.

    Creation is atomic: the key is written to a private temporary file and
    hard-linked into place, so a crash leaves no half-written key and two
    processes starting together end up with the same one.
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=STATE_DIR_MODE)
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        # Linked into place, not renamed: when another process won the race, its key is kept and used.
        write_atomically(path, pem, mode=KEY_FILE_MODE, exclusive=True)
    return load_private_key(path)


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Load the PEM key at `path`, never creating it (`FileNotFoundError` when there is none)."""
    path = Path(path)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(f"{path} is readable by other users (mode {mode:o}); run `chmod 600 {path}` so the key stays private")
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFormatError(f"{path} does not hold an Ed25519 private key")
    return key


# PyJWT's header for an EdDSA token, as it writes it (keys sorted, no spaces).
_JWS_HEADER_PART = base64.urlsafe_b64encode(b'{"alg":"EdDSA","typ":"JWT"}').rstrip(b"=")
# Private keys that sign often (a node's, a tracker's) keep their libsodium form.
_HOT_SIGNING_KEYS = 16


def encode_token(claims: dict[str, Any], key: Ed25519PrivateKey) -> str:
    """An EdDSA compact JWS of `claims`, byte for byte what `jwt.encode(claims, key, "EdDSA")` gives.

    Signed here with libsodium (PyNaCl), the JWS assembled by hand: every routed request has
    its route signed by the tracker and its receipt by the node; PyJWT's generic encode with
    OpenSSL's signature costs 49 µs a receipt on the 2-core dev box, this 32. Ed25519
    signatures are deterministic, so the tokens are the same. Claims that
    JSON cannot hold as they are (a datetime) go through PyJWT, which converts them.
    """
    try:
        payload = json.dumps(claims, separators=(",", ":")).encode()
    except TypeError:
        return jwt.encode(claims, key, algorithm=ALGORITHM)
    signing_input = _JWS_HEADER_PART + b"." + base64.urlsafe_b64encode(payload).rstrip(b"=")
    signature = _hot_signing_key(key).sign(signing_input).signature
    return (signing_input + b"." + base64.urlsafe_b64encode(signature).rstrip(b"=")).decode("ascii")


@functools.lru_cache(maxsize=_HOT_SIGNING_KEYS)
def _hot_signing_key(key: Ed25519PrivateKey) -> nacl.signing.SigningKey:
    return nacl.signing.SigningKey(
        key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    )


class _CompactTokenError(ValueError):
    """A compact JWS that is not a well-formed EdDSA token; `_BadTokenSignature` when only its signature fails."""


class _BadTokenSignature(_CompactTokenError):
    pass


_ED25519_SIGNATURE_BYTES = 64


class HotVerifyKey:
    """An Ed25519 public key checked on every request (the tracker's, by a node's route gate).

    The check is libsodium's (PyNaCl) rather than OpenSSL's (`cryptography`): 70 against 119 µs
    on the 2-core dev box, 106 against 206 µs on the H200 host (`bench/mesh_floor.py`,
    bench/RESULTS.md), on the path before every routed request's first token. libsodium is
    also the stricter of the two (it refuses small-order keys and non-canonical encodings).
    Same interface as `Ed25519PublicKey.verify`: raises `InvalidSignature`.
    """

    __slots__ = ("_key",)

    def __init__(self, key: Ed25519PublicKey) -> None:
        raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self._key = nacl.signing.VerifyKey(raw)

    def verify(self, signature: bytes, data: bytes) -> None:
        try:
            self._key.verify(data, signature)
        except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError):
            raise InvalidSignature() from None


def _signed_claims(token: str, key: HotVerifyKey) -> dict[str, Any]:
    """The claims of an EdDSA compact JWS whose signature `key` made; nothing else is checked (`verify` does).

    By hand rather than PyJWT's `decode`, which costs about as much again as the Ed25519 check
    itself in generic checks `verify` makes anyway. The algorithm is pinned to EdDSA (a header
    naming another one, "none" or HS256, is refused before any signature work) and a header
    with `crit` is refused, as RFC 7515 asks of extensions one does not understand.
    """
    try:
        signing_input, _, signature_text = token.encode("ascii").rpartition(b".")
        header_text, dot, payload_text = signing_input.partition(b".")
        if not dot or b"." in payload_text:
            raise _CompactTokenError("not a compact JWS (three dot-separated parts)")
        # Every Meshnet signer writes the same header bytes: those need no parsing (3 µs of a route's check).
        if header_text != _JWS_HEADER_PART:
            _check_header(json.loads(_b64url(header_text)))
        signature = _b64url(signature_text)
    except (UnicodeError, ValueError, binascii.Error, RecursionError) as exc:  # RecursionError: a header nested deep
        if isinstance(exc, _CompactTokenError):
            raise
        raise _CompactTokenError(f"not a compact JWS: {exc!r}"[:200]) from None
    if len(signature) != _ED25519_SIGNATURE_BYTES:
        raise _BadTokenSignature("the signature is not an Ed25519 signature")
    # One spelling per signature: the last base64url character carries 4 padding bits, which decoding ignores,
    # so a quarter of single-character changes there would read as the same signature (a second token text).
    if base64.urlsafe_b64encode(signature).rstrip(b"=") != signature_text:
        raise _CompactTokenError("the signature is not in canonical base64url")
    try:
        key.verify(signature, signing_input)
    except InvalidSignature:
        raise _BadTokenSignature("the signature does not match the key") from None
    try:
        claims = json.loads(_b64url(payload_text))
    except (UnicodeError, ValueError, binascii.Error, RecursionError) as exc:
        raise _CompactTokenError(f"the claims are not JSON: {exc!r}"[:200]) from None
    if not isinstance(claims, dict):
        raise _CompactTokenError("the claims are not a JSON object")
    return claims


def _check_header(header: Any) -> None:
    if not isinstance(header, dict) or header.get("alg") != ALGORITHM:
        raise _CompactTokenError(f"the token's algorithm is not {ALGORITHM}")
    if "crit" in header:
        raise _CompactTokenError("the token names critical extensions this verifier does not know")


def _b64url(text: bytes) -> bytes:
    return base64.urlsafe_b64decode(text + b"=" * (-len(text) % 4))


# --- one check for every signed token ----------------------------------------------------------


class Given(Enum):
    """A claim the policy checks against a value only the call knows (a node id, a tracker's issuer)."""

    BY_CALLER = "given by the caller"


BY_CALLER = Given.BY_CALLER


class BodyLater(Enum):
    """`verify(..., body=BODY_CHECKED_LATER)`: the caller checks the signed body with `check_body` once it
    has read it (a route is checked on its headers, before its body costs the node anything)."""

    BODY_CHECKED_LATER = "checked later"


BODY_CHECKED_LATER = BodyLater.BODY_CHECKED_LATER

# Why a token was refused: users map these onto their own error codes.
TokenFault = Literal[
    "malformed", "bad_signature", "missing_claim", "wrong_issuer", "wrong_audience", "wrong_subject",
    "life_too_long", "not_yet_valid", "expired", "body_mismatch",
]  # fmt: skip


class TokenRefused(ValueError):
    """A token `verify` refuses; `fault` says why. `claims` are set only when the signature checked out
    (a receipt signed by a clock running ahead is left for a resend, not refused for good)."""

    def __init__(self, fault: TokenFault, message: str, claims: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.fault: TokenFault = fault
        self.claims = claims


@dataclass(frozen=True, slots=True)
class TokenPolicy:
    """What one kind of token must be. `issuer`, `audience`, `subject`: a fixed value, `BY_CALLER`
    (the call passes the value), or None (the kind does not carry the claim, nothing to match).
    `max_life_s`: the longest `exp - iat` accepted; None for a kind with no `exp` (its freshness is
    a nonce's or its replay is stopped by its id). `required` lists every claim that must be present."""

    kind: str
    required: frozenset[str]
    clock_window_s: int
    max_life_s: int | None
    issuer: str | Given | None = None
    audience: str | Given | None = None
    subject: str | Given | None = None
    binds_body: bool = False

    def __post_init__(self) -> None:
        # A policy that matches a claim or bounds a life must also require it, so a token cannot skip
        # the check by leaving the claim out.
        must = {name for name, rule in (("iss", self.issuer), ("aud", self.audience), ("sub", self.subject)) if rule is not None}
        if self.max_life_s is not None:
            must |= {"iat", "exp"}
        if self.binds_body:
            must.add("body_sha256")
        if not must <= self.required:
            raise ValueError(f"the {self.kind} policy checks {sorted(must - self.required)} without requiring them")


def verify(
    token: str,
    key: Ed25519PublicKey | HotVerifyKey,
    policy: TokenPolicy,
    *,
    issuer: str | None = None,
    audience: str | None = None,
    subject: str | None = None,
    body: bytes | BodyLater | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The claims of `token` when `key` signed it and it meets `policy`; else `TokenRefused`.

    One pass for every kind: the compact JWS checked by hand (`_signed_claims`, EdDSA pinned)
    with libsodium's signature check, then the required claims, issuer, audience, subject, life,
    clock window and body. libsodium is the fastest path for every kind (`bench/token_check_paths.py`:
    a route token 65 µs, against 114 by OpenSSL and 141 by PyJWT's decode on the 2-core dev box),
    even with the key converted per call (1 µs); a key that checks many tokens is best passed as
    a `HotVerifyKey`, made once.
    """
    if not isinstance(key, HotVerifyKey):
        key = HotVerifyKey(key)
    try:
        claims = _signed_claims(token, key)
    except _BadTokenSignature as exc:
        raise TokenRefused("bad_signature", f"{policy.kind} token: {exc}") from None
    except _CompactTokenError as exc:
        raise TokenRefused("malformed", f"{policy.kind} token: {exc}") from None
    missing = policy.required.difference(claims)
    if missing:
        raise TokenRefused("missing_claim", f"{policy.kind} token lacks {', '.join(sorted(missing))}")
    _match(claims, "iss", policy.issuer, issuer, "wrong_issuer", policy.kind)
    _match(claims, "aud", policy.audience, audience, "wrong_audience", policy.kind)
    _match(claims, "sub", policy.subject, subject, "wrong_subject", policy.kind)
    _check_times(claims, policy, time.time() if now is None else now)
    if policy.binds_body:
        if body is None:
            raise TypeError(f"the {policy.kind} policy binds the body: pass body= (or BODY_CHECKED_LATER)")
        if body is not BODY_CHECKED_LATER:
            check_body(claims["body_sha256"], body, policy)  # type: ignore[arg-type]
    elif body is not None:
        raise TypeError(f"the {policy.kind} policy binds no body")
    return claims


def issue(
    policy: TokenPolicy,
    key: Ed25519PrivateKey,
    claims: dict[str, Any] | None = None,
    *,
    life_s: int | None = None,
    now: float | None = None,
) -> str:
    """A token of `policy`'s kind: `claims` plus the claims the policy fixes (an audience, a subject),
    `iat` now and, for a kind with a longest life, `exp` `life_s` later (that longest life by default)."""
    issued = int(time.time() if now is None else now)
    full = {name: rule for name, rule in (("aud", policy.audience), ("sub", policy.subject)) if isinstance(rule, str)}
    full.update(claims or {})
    full["iat"] = issued
    if policy.max_life_s is not None:
        life = policy.max_life_s if life_s is None else life_s
        if not 0 < life <= policy.max_life_s:
            raise ValueError(f"a {policy.kind} token lives at most {policy.max_life_s} s, not {life}")
        full["exp"] = issued + life
    elif life_s is not None:
        raise ValueError(f"a {policy.kind} token has no expiry")
    missing = policy.required.difference(full)
    if missing:
        raise ValueError(f"a {policy.kind} token needs {', '.join(sorted(missing))}")
    return encode_token(full, key)


def check_body(signed_sha256: object, body: bytes, policy: TokenPolicy) -> None:
    """The body's sha256 is the one a token of `policy` signed (its `body_sha256`, compared in constant time)."""
    if not isinstance(signed_sha256, str) or not hmac.compare_digest(body_sha256(body), signed_sha256):
        raise TokenRefused("body_mismatch", f"the body differs from the one the {policy.kind} token signed")


def _match(claims: dict[str, Any], name: str, rule: str | Given | None, given: str | None, fault: TokenFault, kind: str) -> None:
    if rule is None:
        if given is not None:
            raise TypeError(f"the {kind} policy matches no {name}")
        return
    if rule is BY_CALLER:
        if given is None:
            raise TypeError(f"the {kind} policy matches {name} against a value the call must give")
        expected = given
    else:
        if given is not None:
            raise TypeError(f"the {kind} policy fixes {name}")
        expected = rule  # type: ignore[assignment]
    if claims[name] != expected:
        raise TokenRefused(fault, f"{kind} token has {name} {claims[name]!r}, expected {expected!r}")


# JSON numbers as `json.loads` gives them; `type(...) in` also keeps out `true`, which is an int to isinstance.
_TIME_TYPES = (int, float)
# Python's json reads `NaN` and `1e999`; a time outside this (year ~33,000) or not a number at all is refused
# (NaN compares false with everything, so it would pass every window).
_LATEST_TIME_S = 1e12


def _not_a_time(value: Any) -> bool:
    return value is not None and (type(value) not in _TIME_TYPES or not -_LATEST_TIME_S < value < _LATEST_TIME_S)


def _check_times(claims: dict[str, Any], policy: TokenPolicy, now: float) -> None:
    """Life, then the clock window: a token from too far ahead, or expired beyond the window, is refused."""
    iat, exp, nbf = claims.get("iat"), claims.get("exp"), claims.get("nbf")
    if _not_a_time(iat) or _not_a_time(exp) or _not_a_time(nbf):
        raise TokenRefused("malformed", f"{policy.kind} token's iat, exp or nbf is not a time")
    window = policy.clock_window_s
    if policy.max_life_s is not None and exp - iat > policy.max_life_s:
        raise TokenRefused("life_too_long", f"{policy.kind} token lives {exp - iat:.0f} s; at most {policy.max_life_s} s allowed")
    if (iat is not None and iat > now + window) or (nbf is not None and nbf > now + window):
        raise TokenRefused("not_yet_valid", f"{policy.kind} token is not valid yet; check both clocks (NTP)", claims)
    if exp is not None and exp <= now - window:
        raise TokenRefused("expired", f"{policy.kind} token expired {now - exp:.0f} s ago")
