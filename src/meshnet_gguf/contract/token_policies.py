"""Every kind of signed token on the Meshnet wire, and what `signing.verify` demands of it.

Where kinds differ, the reason is written here once. The common rule: the tracker, its nodes and
relays keep NTP time, so their tokens share `CLOCK_SKEW_S`; a token that authorises one act lives
about a minute, long enough for one HTTP call and its retries, short enough that a copied one soon
goes stale and the id caches that stop replays stay small.
"""

from __future__ import annotations

from meshnet_gguf.contract.model_proof import AUDIT_TOKEN_SUBJECT
from meshnet_gguf.contract.protocol import (
    CLOCK_SKEW_S,
    MAX_AUDIT_TOKEN_LIFETIME_S,
    MAX_ROUTE_LIFETIME_S,
    MAX_STATUS_TOKEN_LIFETIME_S,
    NODE_AUTH_LIFETIME_S,
    POOL_CLOCK_SKEW_S,
    STATUS_AUDIENCE,
)
from meshnet_gguf.contract.relay_wire import MAX_RELAY_CONNECT_TOKEN_LIFETIME_S, RELAY_PROOF_LIFETIME_S
from meshnet_gguf.contract.signing import BY_CALLER, TokenPolicy

# tracker -> node, one per routed request (`X-Meshnet-Route`). The body is bound, but checked after
# the headers pass (`BODY_CHECKED_LATER`), so a forged route costs the node no body read.
ROUTE_TOKEN = TokenPolicy(
    kind="route",
    required=frozenset({"iss", "sub", "jti", "iat", "exp", "path", "model", "hops", "body_sha256"}),
    clock_window_s=CLOCK_SKEW_S,
    max_life_s=MAX_ROUTE_LIFETIME_S,
    issuer=BY_CALLER,  # the pinned tracker's issuer
    subject=BY_CALLER,  # this node's id
    binds_body=True,
)

# tracker -> verifier node, one per audit (`X-Meshnet-Audit`). The same two clocks as a route (a
# tracker's and a node's), so the same window; a life bounded like a route's, so a captured audit
# token cannot make a verifier spend its llama-server for a day. The subject tells it from a route.
AUDIT_TOKEN = TokenPolicy(
    kind="audit",
    required=frozenset({"iss", "sub", "jti", "iat", "exp", "body_sha256"}),
    clock_window_s=CLOCK_SKEW_S,
    max_life_s=MAX_AUDIT_TOKEN_LIFETIME_S,
    issuer=BY_CALLER,  # the tracker the verifier trusts
    subject=AUDIT_TOKEN_SUBJECT,
    binds_body=True,
)

# node -> its own pool worker's status port. The wider window is the one exception: a pool worker is
# a box on the operator's desk, often without NTP, and the token only reads free memory. No issuer:
# the worker knows one key, the node's.
POOL_STATUS_TOKEN = TokenPolicy(
    kind="pool status",
    required=frozenset({"aud", "iat", "exp"}),
    clock_window_s=POOL_CLOCK_SKEW_S,
    max_life_s=MAX_STATUS_TOKEN_LIFETIME_S,
    audience=STATUS_AUDIENCE,
)

# node -> tracker calls (register, heartbeat, deregister, receipts): one call, this method, path and
# body, for this tracker; the caller checks `htm`/`htu` and uses the `jti` up.
NODE_CALL_TOKEN = TokenPolicy(
    kind="node call",
    required=frozenset({"iss", "aud", "iat", "exp", "htm", "htu", "body_sha256", "jti"}),
    clock_window_s=CLOCK_SKEW_S,
    max_life_s=NODE_AUTH_LIFETIME_S,
    issuer=BY_CALLER,  # the calling node's id
    audience=BY_CALLER,  # this tracker's issuer
    binds_body=True,
)

# node -> tracker, the answer to a reachability challenge. No `exp`, so no longest life: the
# tracker's fresh nonce (checked by the caller) makes the answer good for that one challenge only.
NODE_CONTROL_TOKEN = TokenPolicy(
    kind="node control proof",
    required=frozenset({"iss", "aud", "nonce", "iat"}),
    clock_window_s=CLOCK_SKEW_S,
    max_life_s=None,
    issuer=BY_CALLER,  # the node id being registered
    audience=BY_CALLER,  # the asking tracker's issuer
)

# node -> tracker, a usage receipt. No `exp`, so no longest life: a receipt is a record, resent until
# settled and possibly hours late; each request id is billed once, which stops a replay.
RECEIPT_TOKEN = TokenPolicy(
    kind="receipt",
    required=frozenset({"iss", "jti", "iat", "usage"}),
    clock_window_s=CLOCK_SKEW_S,
    max_life_s=None,
    issuer=BY_CALLER,  # the node id the receipt is filed under
)

# node -> relay, the attach proof: the relay's challenge on this connection (checked by the caller).
RELAY_ATTACH_TOKEN = TokenPolicy(
    kind="relay attach proof",
    required=frozenset({"iss", "aud", "nonce", "role", "iat", "exp"}),
    clock_window_s=CLOCK_SKEW_S,
    max_life_s=RELAY_PROOF_LIFETIME_S,
    issuer=BY_CALLER,  # the node id the attach names
    audience=BY_CALLER,  # this relay
)

# tracker -> relay, a CONNECT to one node, used once (the caller remembers the `jti`).
RELAY_CONNECT_TOKEN = TokenPolicy(
    kind="relay CONNECT",
    required=frozenset({"iss", "aud", "sub", "jti", "iat", "exp"}),
    clock_window_s=CLOCK_SKEW_S,
    max_life_s=MAX_RELAY_CONNECT_TOKEN_LIFETIME_S,
    issuer=BY_CALLER,  # a tracker this relay trusts
    audience=BY_CALLER,  # this relay
    subject=BY_CALLER,  # the node the CONNECT names
)

ALL_POLICIES = (
    ROUTE_TOKEN,
    AUDIT_TOKEN,
    POOL_STATUS_TOKEN,
    NODE_CALL_TOKEN,
    NODE_CONTROL_TOKEN,
    RECEIPT_TOKEN,
    RELAY_ATTACH_TOKEN,
    RELAY_CONNECT_TOKEN,
)
