"""Wire models shared by the node, the reference tracker and the relay. No I/O here.

`docs/protocol.md` is the prose contract; these models are its machine form.
Times on the wire are Unix seconds; layers are the GGUF `{arch}.block_count`
transformer blocks, numbered from 0, ranges inclusive.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PROTOCOL_VERSION = "1"

FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "error", "rejected", "unknown"]
NodeState = Literal["starting", "loading", "ready", "restarting", "draining", "stopped", "failed"]
# The tracker's view of a node (docs/protocol.md, "Node state machine"); only `online` nodes get routes.
MeshState = Literal["joining", "online", "draining"]

# --- headers ---------------------------------------------------------------
ROUTE_HEADER = "X-Meshnet-Route"
REQUEST_ID_HEADER = "X-Meshnet-Request-Id"
USAGE_PROMPT_TOKENS_HEADER = "X-Meshnet-Usage-Prompt-Tokens"
USAGE_COMPLETION_TOKENS_HEADER = "X-Meshnet-Usage-Completion-Tokens"
ENROLMENT_HEADER = "X-Meshnet-Enrolment"
# node -> tracker calls carry `Authorization: Bearer <node token>` (see NodeAuthClaims).

# SSE comment the node adds just before `data: [DONE]`; standard clients ignore comments.
USAGE_COMMENT_PREFIX = "meshnet-usage "

# --- timings and limits (the contract's numbers; docs/protocol.md, "Timings") ----
# Heartbeats are cheap; 10 s keeps a dead node routable for at most ~30 s.
DEFAULT_HEARTBEAT_INTERVAL_S = 10.0
# A node missing this many heartbeats in a row is dropped: one lost packet must not evict it.
NODE_TTL_HEARTBEATS = 3
# A route authorises the *start* of one request; a short life bounds the replay cache.
MAX_ROUTE_LIFETIME_S = 60
# Clocks of volunteer machines drift; NTP keeps them well inside this.
CLOCK_SKEW_S = 5
# Node request tokens only need to outlive one HTTP call.
NODE_AUTH_LIFETIME_S = 60
# An audit token carries one post to a verifier (its body read within half a minute), like a route.
MAX_AUDIT_TOKEN_LIFETIME_S = 60
# A pool status token is good for one status read; the node signs a fresh one for each.
MAX_STATUS_TOKEN_LIFETIME_S = 60
# Pool workers are boxes on one desk, not always on NTP: their clocks may disagree this much.
POOL_CLOCK_SKEW_S = 30
# The audience of a pool status token: a token for a worker's status is good for nothing else.
STATUS_AUDIENCE = "meshnet-pool-worker-status"
# Keeps one receipts call small (each receipt is ~1 kB) and quick to verify.
MAX_RECEIPTS_PER_BATCH = 100

WELL_KNOWN_PATH = "/.well-known/meshnet-tracker"
# Served by the node: it signs the tracker's fresh nonce with its key, proving that whatever
# answers at the advertised URL holds that key (`NodeControlClaims`).
NODE_CONTROL_PATH = "/.well-known/meshnet-node"
NODE_CONTROL_NONCE_PARAM = "nonce"
# A nonce is 32 random bytes, base64url: long enough to be unguessable, short enough for a query string.
NODE_CONTROL_NONCE_MAX_CHARS = 128
# More slots than any llama-server runs on one box: a bigger claim only buys an impostor routes.
MAX_NODE_SLOTS = 256
# A node measures itself at a few context sizes; more points than this say nothing more and cost the tracker memory.
MAX_CAPABILITY_POINTS = 16
# Relays one node announces (section 9.7): two give failover; each costs the tracker a name to resolve
# and check at registration, so a few bound what one registration can make it do.
MAX_NODE_RELAYS = 4
# Models one node announces (section 3.3): each one a llama-server when loaded, so a node with more is a
# catalog, not a serving set (the node's own ceiling is the same); it bounds what one registration makes
# the tracker keep and search on every request.
MAX_ANNOUNCED_MODELS = 16
# Other names one model answers to: a catalog id, a repo, a file name, each with and without its quant (~6).
MAX_MODEL_ALIASES = 16
# A model's id or alias (`owner/name:QUANT`, a GGUF file name): a hub repo id alone may take 96 + 1 + 96
# characters, and a quant follows it; a node serving several models names each in at most 128.
MAX_MODEL_NAME_CHARS = 256
# A load slower than this is not a model waiting to be used: a claim past it is refused, not believed.
MAX_EXPECTED_LOAD_S = 3600.0

# Route refusals a node answers (status, code). Kept here so tracker, relay and docs agree.
ROUTE_ERRORS: dict[str, int] = {
    "route_missing": 401,
    "route_malformed": 401,
    "route_bad_signature": 401,
    "route_expired": 401,
    "route_not_yet_valid": 401,
    "route_wrong_issuer": 401,
    "route_lifetime_too_long": 401,
    "route_wrong_node": 403,
    "route_wrong_model": 403,
    "route_wrong_path": 403,
    "route_not_single_hop": 403,
    "route_coverage_mismatch": 403,
    "route_body_mismatch": 403,
    "route_replayed": 403,
    "route_replay_cache_full": 503,
    "route_key_unavailable": 503,
}


class WireModel(BaseModel):
    """Unknown fields are ignored so a newer peer can add fields without breaking an older one.

    Every float is finite. JSON has no NaN or infinity, yet Python's json reads and writes `NaN`
    and `1e999` (as inf); one such figure in a heartbeat made every tracker page built from it
    a 500 (json.dumps refuses it). Set here, on the base of every wire model, so that no field,
    nested list or dict of floats included, can be added without it.
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class UsageRecord(WireModel):
    """What one proxied request used. Exactly one per request, whatever its end."""

    request_id: str
    route: str = Field(description="API path, e.g. /v1/chat/completions")
    model: str
    status: int = Field(description="HTTP status the client received")
    stream: bool
    prompt_tokens: int = Field(0, ge=0)
    cached_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)
    finish_reason: FinishReason = "unknown"
    started_at: float = Field(description="Unix time the request was admitted")
    duration_s: float = 0.0
    ttft_s: float | None = Field(None, description="Time to first token (first content byte for streams)")
    decode_tokens_per_s: float | None = None


class UsageTotals(WireModel):
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    cancelled: int = 0


class HealthReport(WireModel):
    """`GET /health` body. 200 only when `state == "ready"`."""

    protocol_version: str = PROTOCOL_VERSION
    state: NodeState
    detail: str | None = None
    model: str | None = None
    quant: str | None = None
    first_layer: int | None = None
    last_layer: int | None = None
    slots_total: int = 0
    slots_busy: int = 0
    uptime_s: float = 0.0
    restarts: int = 0
    recent_tokens_per_s: float | None = None
    load_progress: float | None = Field(None, description="0..1 while loading, when llama-server says")
    usage: UsageTotals = Field(default_factory=UsageTotals)
    node_version: str | None = None
    llama_build: str | None = None
    max_tokens_cap: int | None = Field(None, description="Most completion tokens one request may produce here")
    mesh_problem: str | None = Field(
        None, description="Why the node is not online on its tracker (e.g. the tracker key does not match the pin)"
    )
    relay: RelayLinkHealth | None = Field(None, description="The tunnel to the relay, when the node serves through one")
    relays: list[RelayLinkHealth] = Field(
        default_factory=list, description="Every relay tunnel, in the order announced (the first is `relay`)"
    )
    pool: PoolHealth | None = Field(None, description="The LAN pool behind this node, when it has one (never addresses)")
    capability: NodeCapability | None = Field(None, description="What the running llama-server measured at its start")


# --- registration and liveness --------------------------------------------


class ShardDigest(WireModel):
    name: str = Field(description="File name, e.g. model-00001-of-00003.gguf")
    sha256: str | None = Field(None, description="Hex digest; None when the node did not verify it")
    size: int | None = None


class HardwareSummary(WireModel):
    """What an operator or a placement policy wants to know at a glance; not a full probe."""

    summary: str = Field(description="One line, e.g. 'Vulkan0: Radeon 8060S (96 GiB), 16 cores, 128 GiB RAM'")
    backend: str | None = Field(None, description="cpu, vulkan, rocm, cuda, metal")
    memory_bytes: int | None = None
    gpu_memory_bytes: int | None = None


class RatePoint(WireModel):
    """One measured rate: tokens per second with a prompt of `ctx_tokens` tokens in the slot."""

    ctx_tokens: int = Field(ge=1)
    tokens_per_s: float = Field(gt=0)


class NodeCapability(WireModel):
    """What a node measured of itself after warm-up and before serving (its pool included, through the
    same llama-server), from llama-server's own `timings`: a claim the tracker checks against what it forwards."""

    prefill_tokens_per_s: list[RatePoint] = Field(default_factory=list, max_length=MAX_CAPABILITY_POINTS)
    decode_tokens_per_s: list[RatePoint] = Field(default_factory=list, max_length=MAX_CAPABILITY_POINTS)
    measured_in_s: float | None = Field(None, ge=0, description="How long the measurement took")


class NodeLoad(WireModel):
    slots_total: int = Field(ge=0)
    slots_busy: int = Field(0, ge=0)
    queue_depth: int = Field(0, ge=0, description="Requests admitted but waiting for a slot")
    recent_tokens_per_s: float | None = None
    models: list[ModelStateReport] = Field(
        default_factory=list,
        max_length=MAX_ANNOUNCED_MODELS,
        description="The announced models' states now (a model not listed keeps its state; a model not announced is ignored)",
    )


# A model's state on a node (section 3.3): `loaded` answers at once; `loadable` is loaded on its first
# request (its `expected_load_s` first); `unavailable` is named but not served now (its load failed).
ModelLoadState = Literal["loaded", "loadable", "unavailable"]


def model_name_problem(name: str) -> str | None:
    """Why `name` cannot name a model on the wire (an id or an alias); None when it can."""
    if not name or len(name) > MAX_MODEL_NAME_CHARS:
        return f"a model name is 1 to {MAX_MODEL_NAME_CHARS} characters (got {len(name)})"
    if not name.isprintable() or name != name.strip():
        return f"model name {name[:MAX_MODEL_NAME_CHARS]!r}: printable characters only, no space at either end"
    return None


def name_of_two_models(models: Iterable[AnnouncedModel]) -> str | None:
    """A name (an id or an alias, compared without regard to case) that two of `models` answer to, or one twice."""
    seen: set[str] = set()
    for model in models:
        for name in model.names():
            if name.lower() in seen:
                return name
            seen.add(name.lower())
    return None


def _checked_names(names: Iterable[str]) -> None:
    for name in names:
        if (problem := model_name_problem(name)) is not None:
            raise ValueError(problem)


class ModelStateReport(WireModel):
    """One announced model's state now, in a heartbeat's load: what changes between registrations."""

    model_id: str = Field(max_length=MAX_MODEL_NAME_CHARS)
    state: ModelLoadState
    expected_load_s: float | None = Field(
        None, ge=0, le=MAX_EXPECTED_LOAD_S, description="Seconds a load takes here (measured at the first); None: not known yet"
    )


class AnnouncedModel(WireModel):
    """One model a node serves whole (every layer), with its state (section 3.3)."""

    model_id: str = Field(description="The `model` clients name; the node's route gate expects it in routes")
    aliases: list[str] = Field(default_factory=list, max_length=MAX_MODEL_ALIASES)
    quant: str | None = Field(None, max_length=MAX_MODEL_NAME_CHARS)
    state: ModelLoadState = "loaded"
    expected_load_s: float | None = Field(
        None, ge=0, le=MAX_EXPECTED_LOAD_S, description="Seconds a load takes here (measured at the first); None: not known yet"
    )
    slots: int | None = Field(None, gt=0, le=MAX_NODE_SLOTS, description="Its own slots; None: the node's `slots`")
    ctx_size: int | None = Field(None, ge=1)

    def answers_to(self, requested: str) -> bool:
        return model_answers_to(requested, self.model_id, self.aliases)

    def names(self) -> list[str]:
        return [self.model_id, *self.aliases]

    @model_validator(mode="after")
    def _names_are_names(self) -> AnnouncedModel:
        _checked_names(self.names())
        return self


class NodeAnnouncement(WireModel):
    """`POST /v1/nodes/register` body: everything the tracker needs to route to this node."""

    protocol_version: str = PROTOCOL_VERSION
    node_id: str
    public_key: str = Field(description="Ed25519 public key, base64url of the 32 raw bytes, no padding")
    advertised_url: str = Field(description="Base URL the tracker (or relay) uses to reach the node")
    model_id: str = Field(description="The `model` clients name; the node answers /v1/models with it")
    model_aliases: list[str] = Field(
        default_factory=list,
        max_length=MAX_MODEL_ALIASES,
        description="Other names clients may use for this model (see `model_answers_to`)",
    )
    quant: str | None = None
    shards: list[ShardDigest] = Field(default_factory=list)
    first_layer: int = Field(ge=0)
    last_layer: int = Field(ge=0)
    total_layers: int = Field(gt=0, description="GGUF block count")
    ctx_size: int | None = None
    slots: int = Field(gt=0, le=MAX_NODE_SLOTS)
    hardware: HardwareSummary | None = None
    llama_build: str | None = None
    max_tokens_cap: int | None = Field(None, ge=1, description="Most completion tokens one request may produce here")
    node_version: str
    state: MeshState = "joining"
    relay: RelayAttachment | None = Field(None, description="Set when the node is reachable only through a relay")
    # Beside `relay`, not instead of it: a tracker that predates the list still reads the first relay there.
    relays: list[RelayAttachment] = Field(
        default_factory=list,
        max_length=MAX_NODE_RELAYS,
        description="Every relay the node holds a tunnel at, in the order to try them; the first is `relay` (section 9.7)",
    )
    pool: PoolDescription | None = Field(None, description="Set when a LAN pool behind the node holds the model with it")
    capability: NodeCapability | None = Field(None, description="The node's own speed figures, once it measured them")
    # Beside `model_id`, not instead of it: a tracker that predates the list routes the first model alone.
    models: list[AnnouncedModel] = Field(
        default_factory=list,
        max_length=MAX_ANNOUNCED_MODELS,
        description="Every model the node serves, with its state; the first is `model_id` (section 3.3). Empty: that one, loaded",
    )

    def answers_to(self, requested: str) -> bool:
        return self.served_as(requested) is not None

    def served_models(self) -> list[AnnouncedModel]:
        """Every model the node serves: `models`, or from a node that sends no list its one model, loaded."""
        if self.models:
            return list(self.models)
        only = AnnouncedModel.model_construct(
            model_id=self.model_id, aliases=list(self.model_aliases), quant=self.quant, state="loaded",
            expected_load_s=None, slots=None, ctx_size=self.ctx_size,
        )  # fmt: skip
        return [only]

    def served_as(self, requested: str) -> AnnouncedModel | None:
        """The model a request naming `requested` is for here (by id or alias, `model_answers_to`); None: none."""
        return next((m for m in self.served_models() if m.answers_to(requested)), None)

    @property
    def full_coverage(self) -> bool:
        return self.first_layer == 0 and self.last_layer == self.total_layers - 1

    def relay_attachments(self) -> list[RelayAttachment]:
        """The relays to reach the node through, in order: `relays`, or `relay` alone from a node that sends no list."""
        if self.relays:
            return list(self.relays)
        return [self.relay] if self.relay is not None else []

    @model_validator(mode="after")
    def _relays_agree(self) -> NodeAnnouncement:
        # One node, one certificate: a list that disagreed with `relay`, or named a relay twice, would
        # make an old and a new tracker reach the node differently (or dial one relay twice for nothing).
        if not self.relays:
            return self
        if self.relay is None or self.relays[0] != self.relay:
            raise ValueError("relays: the first relay must be the one in `relay`")
        if any(r.tls_certificate != self.relay.tls_certificate for r in self.relays):
            raise ValueError("relays: every relay carries the node's one certificate")
        if len({relay_audience(r.url) for r in self.relays}) != len(self.relays):
            raise ValueError("relays: a relay is named twice")
        return self

    @model_validator(mode="after")
    def _models_agree(self) -> NodeAnnouncement:
        # The first model is the one an old tracker routes (`model_id`); a name two models answer to would
        # make the tracker's pick between them arbitrary.
        _checked_names([self.model_id, *self.model_aliases])
        if not self.models:
            return self
        if self.models[0].model_id != self.model_id:
            raise ValueError("models: the first model must be the one in `model_id`")
        if (twice := name_of_two_models(self.models)) is not None:
            raise ValueError(f"models: {twice!r} names two models (or one twice)")
        return self

    @model_validator(mode="after")
    def _ordered_layers(self) -> NodeAnnouncement:
        if self.last_layer < self.first_layer or self.last_layer >= self.total_layers:
            raise ValueError("layers must satisfy first_layer <= last_layer < total_layers")
        return self


class RegistrationAck(WireModel):
    node_id: str
    issuer: str = Field(description="The `iss` this tracker puts in route tokens")
    heartbeat_interval_s: float = Field(gt=0, description="The node sends heartbeats this often")
    ttl_s: float = Field(gt=0, description="Without a heartbeat for this long the node is dropped")


class Heartbeat(WireModel):
    """`POST /v1/nodes/{node_id}/heartbeat` body."""

    node_id: str
    state: MeshState
    load: NodeLoad


class HeartbeatAck(WireModel):
    ttl_s: float


class Deregistration(WireModel):
    """`POST /v1/nodes/{node_id}/deregister` body."""

    node_id: str
    reason: str = "shutdown"


class TrackerInfo(WireModel):
    """`GET /.well-known/meshnet-tracker`: what a node pins and how often it must report."""

    protocol_version: str = PROTOCOL_VERSION
    issuer: str
    public_key: str = Field(description="Ed25519 public key, base64url raw, to pin as tracker_public_key")
    heartbeat_interval_s: float
    ttl_s: float
    max_route_lifetime_s: int = MAX_ROUTE_LIFETIME_S


# --- tokens (JWT claims, EdDSA) ---------------------------------------------


class RouteHop(WireModel):
    node_id: str
    first_layer: int = Field(ge=0)
    last_layer: int = Field(ge=0)


class RouteClaims(WireModel):
    """Claims of `X-Meshnet-Route`, signed by the tracker."""

    iss: str
    sub: str = Field(description="Node id the route is for")
    jti: str = Field(description="Request id; one route authorises one request")
    iat: int
    exp: int
    v: str = PROTOCOL_VERSION
    path: str = Field(description="API path the route is for, e.g. /v1/chat/completions")
    model: str
    hops: list[RouteHop]
    body_sha256: str = Field(description="Hex sha256 of the exact request body bytes")
    max_tokens: int | None = Field(None, ge=1, description="Most completion tokens the node may produce")


class NodeAuthClaims(WireModel):
    """Claims of the bearer token on node -> tracker calls, signed by the node key."""

    iss: str = Field(description="Node id")
    aud: str = Field(description="The tracker's issuer: a token captured on the way to one tracker is useless at another")
    iat: int
    exp: int
    htm: str = Field(description="HTTP method of the call")
    htu: str = Field(description="Path of the call, e.g. /v1/nodes/node-x/heartbeat")
    body_sha256: str
    jti: str = Field(description="Fresh per call: the tracker remembers it for the token's lifetime and refuses it again")


class NodeControlClaims(WireModel):
    """Answer of `GET {advertised_url}/.well-known/meshnet-node?nonce=...`, signed by the node key.

    It proves that whatever answers at the advertised URL holds the key the node registered with.
    """

    iss: str = Field(description="Node id")
    aud: str = Field(description="Issuer of the tracker that asked")
    nonce: str = Field(description="The tracker's fresh nonce, echoed")
    iat: int


class NodeControlProof(WireModel):
    token: str = Field(description="JWT (EdDSA, node key) whose claims are NodeControlClaims")


class ReceiptClaims(WireModel):
    """Claims of a usage receipt, signed by the node. No `exp`: a receipt may arrive hours late."""

    iss: str = Field(description="Node id")
    jti: str = Field(description="Request id, equal to usage.request_id")
    iat: int
    usage: UsageRecord


# --- billing ----------------------------------------------------------------


class UsageReceipt(WireModel):
    request_id: str
    token: str = Field(description="JWT (EdDSA, node key) whose claims are ReceiptClaims")


class ReceiptBatch(WireModel):
    """`POST /v1/nodes/{node_id}/receipts` body. Resending a receipt is harmless (idempotent by request id)."""

    node_id: str
    receipts: list[UsageReceipt] = Field(max_length=MAX_RECEIPTS_PER_BATCH)


class ReceiptRejection(WireModel):
    request_id: str
    code: str = Field(description="bad_signature, wrong_node, unknown_request, malformed, implausible, from_the_future")
    message: str


class ReceiptAck(WireModel):
    """`accepted` (new or already stored) is final; `rejected` is final too: never resend those.
    A receipt in neither list (e.g. signed a little in the future) is to be sent again later."""

    accepted: list[str] = Field(default_factory=list)
    rejected: list[ReceiptRejection] = Field(default_factory=list)


class UsageCounts(WireModel):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


UsageAgreement = Literal["agree", "mismatch", "awaiting_receipt", "unmetered"]


class TrackerUsage(WireModel):
    """`GET /v1/usage/{request_id}` on the tracker: its own count beside the node's receipt."""

    request_id: str
    node_id: str
    model: str
    stream: bool
    status: int | None = None
    outcome: str | None = Field(None, description="complete, cancelled, upstream_error, timed_out, refused, interrupted, in_flight")
    tracker: UsageCounts
    node: UsageCounts | None = None
    node_finish_reason: FinishReason | None = None
    agreement: UsageAgreement
    billed: UsageCounts | None = Field(None, description="What the tracker bills: the receipt, capped per field by the tracker's ceiling")
    flagged: bool = Field(False, description="The receipt claims more than the tracker's ceilings, or the request was interrupted")
    ceiling: UsageCounts | None = Field(
        None, description="The most the tracker bills, from the request it received and the bytes it forwarded"
    )


# --- relay (docs/protocol.md, "Relay"): the handshake is `relay_wire`; here what announcements and /health say of relays
def relay_audience(url: str) -> str:
    """How a relay is named in the tokens meant for it: its base URL as nodes dial it, without a trailing slash."""
    return url.strip().rstrip("/").lower()


class RelayAttachment(WireModel):
    """In a node's announcement: reach me through this relay, over TLS with this certificate."""

    url: str = Field(description="The relay's base URL; the tracker uses it as an HTTP CONNECT proxy")
    tls_certificate: str = Field(
        description="base64url DER of the node's self-signed X.509 certificate: Ed25519, the node's own key, subjectAltName DNS = node id"
    )


RelayLinkState = Literal["connecting", "attached", "disconnected", "refused", "draining"]


PoolWorkerState = Literal["up", "away"]


class PoolWorkerHealth(WireModel):
    """One pool worker as `/health` shows it: named by its place in the pool, never by its address."""

    name: str = Field(description="e.g. 'worker 1', in the order the operator listed the workers")
    state: PoolWorkerState
    protocol: str | None = Field(None, description="The RPC protocol version it last reported")
    assigned_bytes: int = Field(0, ge=0, description="The memory the plan puts on it")
    last_heartbeat_s: float | None = Field(None, description="Seconds since its status last answered well; None: never")
    problem: str | None = None


class PoolDescription(WireModel):
    """What registration says of a LAN pool behind the node: its size and plan, never where its workers are."""

    workers: int = Field(ge=1, description="Pool workers lending memory to this node")
    total_bytes: int = Field(0, ge=0, description="Memory the pooled plan spreads the model over, this node included")
    plan: str | None = Field(None, description="The pooled plan in one line: devices and shares")


class PoolHealth(WireModel):
    """The LAN pool behind one node: its size and plan; the network still sees one node."""

    workers: list[PoolWorkerHealth] = Field(default_factory=list)
    total_bytes: int = Field(0, ge=0, description="Memory the pooled plan spreads the model over, this node included")
    plan: str | None = Field(None, description="The pooled plan in one line: devices and shares")


class RelayLinkHealth(WireModel):
    """What `/health` says about the node's tunnel."""

    url: str
    state: RelayLinkState
    attached_for_s: float | None = None
    connects: int = Field(0, description="Control connections attached since start")
    idle_work: int = 0
    streams_active: int = 0
    streams_total: int = 0
    last_error: str | None = None


# --- errors -----------------------------------------------------------------


class ErrorDetail(WireModel):
    message: str
    type: str
    code: str | int | None = None
    param: str | None = None


class ErrorBody(WireModel):
    """OpenAI's error shape, used for every refusal so SDKs surface the message (`errors.ApiError` writes it)."""

    error: ErrorDetail


HealthReport.model_rebuild()
NodeLoad.model_rebuild()
NodeAnnouncement.model_rebuild()


def model_answers_to(requested: str, model_id: str, aliases: Iterable[str] = ()) -> bool:
    """Whether a request naming `requested` is for the model served as `model_id`.

    The one rule for model names, used by nodes and trackers alike: the served id
    (`demo:Q4_K_M`, `owner/name:Q4_K_M`, a local file's stem) or any alias the node
    announced (the id without its quant, a curated repo's catalog id, the GGUF file
    name), compared without regard to case.
    """
    wanted = requested.strip().lower()
    return any(wanted == name.lower() for name in (model_id, *aliases))
