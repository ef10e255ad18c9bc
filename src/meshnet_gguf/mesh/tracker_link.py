"""The node's link to its tracker, when one is configured.

One object the node starts in its task group. The composition root (`node.build_tracker_link`)
opens the ledger, is handed the identity, builds the tracker client, the outbox and the route
gate, and hands them in; the link only runs them. It gives the proxy a
`route_gate` (only tracker-routed requests get through), a `usage_sink`
(each request's ledger row is opened before it is forwarded and settled into a
signed receipt when it ends; rows a crash left open are settled at start) and one GET
route, `control_route` (the tracker's reachability challenge, signed with the
node key), and runs the registration/heartbeat and outbox tasks. `drain()`
tells the tracker to stop routing here; `close()` makes a last delivery
attempt and deregisters.

Key trust: the tracker's key is pinned (configured, or learnt on first contact
only over https or loopback). When the tracker turns out to hold another key,
the node tells it nothing but "not online" and says why in `/health`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import anyio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from meshnet_gguf import __version__
from meshnet_gguf.common.asgi import QueryRoute
from meshnet_gguf.common.atomic_file import write_atomically
from meshnet_gguf.common.ports import is_wildcard
from meshnet_gguf.common.retry import Backoff
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.node_part import BasePart
from meshnet_gguf.contract.protocol import (
    CLOCK_SKEW_S,
    MAX_ROUTE_LIFETIME_S,
    NODE_CONTROL_NONCE_MAX_CHARS,
    NODE_CONTROL_NONCE_PARAM,
    NODE_CONTROL_PATH,
    AnnouncedModel,
    HardwareSummary,
    HealthReport,
    MeshState,
    NodeAnnouncement,
    NodeControlProof,
    NodeLoad,
    PoolDescription,
    RegistrationAck,
    RelayAttachment,
    ShardDigest,
    UsageRecord,
    name_of_two_models,
)
from meshnet_gguf.contract.signing import KeyFormatError, parse_public_key, public_key_text, tracker_issuer_for
from meshnet_gguf.mesh.announced_models import first_model_first, state_reports, wire_aliases
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.ledger import UsageLedger
from meshnet_gguf.mesh.meshed_mode import MeshedMode, RouteGate
from meshnet_gguf.mesh.receipts import LedgerUsageSink, OutboxReporter, settle_uncounted
from meshnet_gguf.mesh.route_auth import ReplayCache
from meshnet_gguf.mesh.tracker_client import (
    DEREGISTER_TIMEOUT_S,
    RETRY_INITIAL_S,
    RETRY_MAX_S,
    TRACKER_KEY_PIN_FILE,
    EnrolmentRefused,
    NodePresence,
    TrackerClient,
    TrackerRefused,
    TrackerUnavailable,
    first_contact_problem,
)

log = logging.getLogger(__name__)

# On the way out, one bounded try to deliver the last receipts; what is left goes next start.
FINAL_FLUSH_TIMEOUT_S = 5.0
# Routes admitted this recently before a restart could still be replayed; their ids come from the ledger.
REPLAY_SEED_WINDOW_S = MAX_ROUTE_LIFETIME_S + 2 * CLOCK_SKEW_S
# A tracker's nonce is base64url; anything else is not a tracker asking.
_NONCE_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


class MeshSetupError(RuntimeError):
    """The tracker link cannot be built from these settings; the message says what to fix."""


@dataclass(frozen=True)
class ServedModel:
    """What the node serves, as the tracker must hear it."""

    model_id: str
    total_layers: int
    model_aliases: Sequence[str] = ()
    max_tokens_cap: int | None = None
    quant: str | None = None
    llama_build: str | None = None
    slots: int = 1
    ctx_size: int | None = None
    pool: PoolDescription | None = None  # a LAN pool behind this node: its size and plan, no addresses
    # Every model the node serves now, with its state (a node of several fills it from its children's status,
    # `announced_models.announced_from_children`); None: this one model, loaded.
    models: Callable[[], Sequence[AnnouncedModel]] | None = None
    # This model's own slots where `slots` counts several models' (the node's total); None: `slots`.
    own_slots: int | None = None

    def announced(self) -> list[AnnouncedModel]:
        """The models the announcement and each heartbeat carry, this one first."""
        this = AnnouncedModel(
            model_id=self.model_id, aliases=wire_aliases(self.model_aliases), quant=self.quant, ctx_size=self.ctx_size,
            slots=self.own_slots,
        )  # fmt: skip
        return first_model_first(self.models() if self.models is not None else [], this)


# The shard digests and hardware summary the announcement carries. Blocking (it may hash
# shards or probe the machine): the link calls it once, in a worker thread, when it starts.
DescribeModel = Callable[[], tuple[list[ShardDigest], HardwareSummary | None]]


class TrackerLink(BasePart):
    """A node part: registration and heartbeats, the receipt outbox, the route gate and the control proof."""

    name = "tracker link"

    def __init__(
        self,
        *,
        settings: NodeSettings,
        model: ServedModel,
        identity: NodeIdentity,
        ledger: UsageLedger,
        client: TrackerClient,
        reporter: OutboxReporter,
        usage_sink: LedgerUsageSink,
        route_gate: RouteGate,
        admission_mode: MeshedMode,
        health: Callable[[], HealthReport],
        describe: DescribeModel,
        left_uncounted: Sequence[tuple[UsageRecord, bytes]] = (),
        count_prompt: Callable[[str, bytes], Awaitable[int]] | None = None,
        relay_attachments: Sequence[RelayAttachment] = (),
    ) -> None:
        self.settings = settings
        self.model = model
        self.total_layers = model.total_layers
        self.identity = identity
        self.ledger = ledger
        self.client = client
        self.reporter = reporter
        self.usage_sink = usage_sink
        self.route_gate = route_gate
        # Routes for every model the node announces pass its gate: the tracker signs each for the model it served.
        route_gate.serve_also([m.model_id for m in model.announced()[1:]])
        # What the proxy admits requests with: this link's route gate and ledger.
        self.admission_mode = admission_mode
        self._health = health
        self._describe = describe
        # Rows a previous run left before their prompt was counted, and what counts a prompt from
        # the request body kept in such a row (waiting for llama-server first).
        self._left_uncounted = list(left_uncounted)
        self._count_prompt = count_prompt
        self._draining = False
        self._tasks: anyio.CancelScope | None = None
        self.advertised_url = settings.advertised_url or default_advertised_url(settings)
        if route_gate.issuer is not None:
            self.client.audience = route_gate.issuer
        self.presence = NodePresence(
            self.client, self._announcement, self._status, check_ack=self._check_ack, explain_refusal=self._explain_refusal
        )
        self.control_route: tuple[str, QueryRoute] = (NODE_CONTROL_PATH, self.answer_control_challenge)
        self._shards: list[ShardDigest] | None = None
        self._hardware: HardwareSummary | None = None
        # Behind relays, the tracker reaches this node through them (in this order) rather than at advertised_url.
        self.relay_attachments = list(relay_attachments)
        # A relayed node's own address is loopback or private: naming it would say the tracker dials it.
        through = " and ".join(a.url for a in self.relay_attachments)
        reached = f"reached through its relay {through}" if self.relay_attachments else f"advertised as {self.advertised_url}"
        log.info("meshnet node id %s, tracker %s, %s", self.identity.node_id, settings.tracker, reached)

    # --- what the node wires in ---------------------------------------------
    def announce_beside(self, models: Callable[[], Sequence[AnnouncedModel]], *, own_slots: int, total_slots: int) -> None:
        """A node of several models: `models()` are the others, in their state at each call, announced beside this
        link's model (which keeps `own_slots` of the node's `total_slots`); the route gate passes their routes too."""
        model = replace(self.model, models=models, own_slots=own_slots, slots=total_slots)
        announced = model.announced()
        if (twice := name_of_two_models(announced)) is not None:
            raise MeshSetupError(f"the node serves two models that answer to {twice!r}: give one another alias")
        self.model = model
        self.route_gate.serve_also([m.model_id for m in announced[1:]])

    def health(self, report: HealthReport) -> HealthReport:
        return report.model_copy(update={"first_layer": 0, "last_layer": self.total_layers - 1, "mesh_problem": self.presence.problem})

    def outbox_depth(self) -> int:
        return self.ledger.outbox_depth_sync()

    async def answer_control_challenge(self, query: Mapping[str, str]) -> tuple[int, bytes, str]:
        """`GET /.well-known/meshnet-node?nonce=...`: the tracker's nonce, signed with this node's key
        for the pinned tracker only, so the tracker knows the node it registers answers at this URL."""
        nonce = query.get(NODE_CONTROL_NONCE_PARAM, "")
        if not nonce or len(nonce) > NODE_CONTROL_NONCE_MAX_CHARS or not set(nonce) <= _NONCE_ALPHABET:
            error = ApiError(
                400, "bad_nonce", f"{NODE_CONTROL_NONCE_PARAM} must be base64url, at most {NODE_CONTROL_NONCE_MAX_CHARS} characters"
            )
            return error.status, error.body(), "application/json"
        audience = self.route_gate.issuer
        if audience is None:
            error = ApiError(503, "route_key_unavailable", "this node has not learnt its tracker's key yet")
            return error.status, error.body(), "application/json"
        proof = NodeControlProof(token=self.identity.sign_control_proof(nonce, audience))
        return 200, proof.model_dump_json().encode(), "application/json"

    async def run(self) -> None:
        """Background task for the node's lifetime: outbox, key pinning, shard digests, presence."""
        refused: list[EnrolmentRefused] = []

        async def presence() -> None:
            try:
                await self.presence.run()
            except EnrolmentRefused as exc:  # the node cannot join: end it with the reason, not a task-group error
                refused.append(exc)
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            self._tasks = tg.cancel_scope
            # Receipts left by a previous run go out first; they need no registration.
            tg.start_soon(self.reporter.run)
            if self._left_uncounted and self._count_prompt is not None:
                # Billed once llama-server has counted them.
                tg.start_soon(settle_uncounted, self.ledger, self.identity, self._left_uncounted, self._count_prompt, self.reporter)
            elif self._left_uncounted:
                log.warning(
                    "%d request(s) cut short before their prompt was counted stay open: no counter given", len(self._left_uncounted)
                )
            if self.route_gate.issuer is None:
                await self._learn_tracker_key()
            self._shards, self._hardware = await anyio.to_thread.run_sync(self._describe)
            tg.start_soon(presence)
        if refused:
            raise refused[0]

    async def drain(self) -> None:
        """Say `draining` now, so the tracker stops routing here while in-flight requests finish."""
        self._draining = True
        if not self.presence.registered:
            return
        state, load = self._status()
        with anyio.move_on_after(DEREGISTER_TIMEOUT_S):
            try:
                await self.client.heartbeat(state, load)
            except TrackerUnavailable as exc:
                log.warning("could not tell the tracker this node is draining: %s", exc)

    async def close(self) -> None:
        """After the last request: deliver what can be delivered, deregister, release the ledger."""
        if self._tasks is not None:
            self._tasks.cancel()  # the reporter and heartbeats stop before the final flush
        with anyio.move_on_after(FINAL_FLUSH_TIMEOUT_S):
            try:
                await self.reporter.flush()
            except TrackerUnavailable as exc:
                log.warning("usage receipts stay in the ledger for the next start: %s", exc)
        await self.presence.deregister("shutdown")
        await self.client.aclose()
        await self.ledger.aclose()

    # --- internals ----------------------------------------------------------
    def _status(self) -> tuple[MeshState, NodeLoad]:
        report = self._health()
        if self._draining or report.state in ("draining", "stopped"):
            state: MeshState = "draining"
        else:
            state = "online" if report.state == "ready" and self.presence.problem is None else "joining"
        load = NodeLoad(
            slots_total=report.slots_total,
            slots_busy=report.slots_busy,
            recent_tokens_per_s=report.recent_tokens_per_s,
            models=state_reports(self.model.announced()),
        )
        return state, load

    def _announcement(self) -> NodeAnnouncement:
        model = self.model
        return NodeAnnouncement(
            node_id=self.identity.node_id,
            public_key=self.identity.public_key_text,
            advertised_url=self.relay_attachments[0].url if self.relay_attachments else self.advertised_url,
            # The first relay where a tracker that knows one reads it; the list only when there is more than one.
            relay=self.relay_attachments[0] if self.relay_attachments else None,
            relays=self.relay_attachments if len(self.relay_attachments) > 1 else [],
            model_id=model.model_id,
            model_aliases=wire_aliases(model.model_aliases),
            max_tokens_cap=model.max_tokens_cap,
            quant=model.quant,
            shards=self._shards or [],
            first_layer=0,
            last_layer=self.total_layers - 1,
            total_layers=self.total_layers,
            ctx_size=model.ctx_size,
            slots=model.slots,
            hardware=self._hardware,
            llama_build=model.llama_build,
            node_version=__version__,
            pool=model.pool,
            capability=self._health().capability,  # None until llama-server measured itself; /health carries it then
            models=model.announced(),
        )

    def _trust(self, key: Ed25519PublicKey) -> None:
        self.route_gate.set_tracker_key(key)
        self.client.audience = self.route_gate.issuer

    def _check_ack(self, ack: RegistrationAck) -> str | None:
        """A tracker signing as another issuer than the pinned key's would have every route refused."""
        expected = self.route_gate.issuer
        if ack.issuer == expected:
            return None
        return (
            f"the tracker signs routes as {ack.issuer} but the pinned key belongs to {expected}: every routed request "
            f"would be refused; fix tracker_public_key (or delete {TRACKER_KEY_PIN_FILE} in the state dir to re-learn it)"
        )

    async def _explain_refusal(self, refusal: TrackerRefused) -> str:
        """Say plainly when a refusal comes from a tracker key that does not match the pin."""
        if refusal.code not in ("bad_node_auth", "control_unproven"):
            return str(refusal)
        try:
            published = parse_public_key((await self.client.info()).public_key)
        except (TrackerUnavailable, KeyFormatError):
            return str(refusal)
        if tracker_issuer_for(published) != self.route_gate.issuer:
            return (
                f"tracker key mismatch: {self.settings.tracker} publishes {public_key_text(published)} but this node pinned "
                f"the key of {self.route_gate.issuer}; fix tracker_public_key (or delete {TRACKER_KEY_PIN_FILE} "
                "in the state dir to re-learn it)"
            )
        return str(refusal)

    async def _learn_tracker_key(self) -> None:
        """Trust on first use (https or loopback only): fetch the key the tracker publishes and pin it."""
        backoff = Backoff(RETRY_INITIAL_S, RETRY_MAX_S)
        while True:
            try:
                info = await self.client.info()
                key = parse_public_key(info.public_key)
                break
            except (TrackerUnavailable, KeyFormatError) as exc:
                delay = backoff.next_delay()
                log.warning("cannot fetch the tracker key yet (%s); requests get 503 until then; retrying in %.0f s", exc, delay)
                await anyio.sleep(delay)
        pin = Path(self.settings.state_dir) / TRACKER_KEY_PIN_FILE
        write_atomically(pin, info.public_key + "\n")
        self._trust(key)
        log.warning(
            "pinned tracker key %s on first contact (trust on first use) in %s; set MESHNET_TRACKER_PUBLIC_KEY to pin it explicitly",
            info.public_key,
            pin,
        )


def configured_tracker_key(settings: NodeSettings) -> Ed25519PublicKey | None:
    """The tracker key this node trusts before contacting it: configured, or pinned on an earlier first contact."""
    text = settings.tracker_public_key
    source = "tracker_public_key"
    pin = Path(settings.state_dir) / TRACKER_KEY_PIN_FILE
    if not text and pin.exists():
        text, source = pin.read_text(), str(pin)
    if not text:
        return None
    try:
        return parse_public_key(text)
    except KeyFormatError as exc:
        raise MeshSetupError(f"{source}: {exc}") from exc


def check_first_contact(settings: NodeSettings, pinned: Ed25519PublicKey | None) -> None:
    """Refuse settings that would learn the tracker key where it could be spoofed (plain http to another machine)."""
    if not settings.tracker:
        raise MeshSetupError("the tracker link needs a tracker URL (--tracker or MESHNET_TRACKER)")
    if pinned is None and (problem := first_contact_problem(settings.tracker)):
        raise MeshSetupError(problem)
    if not settings.advertised_url:
        default_advertised_url(settings)


def seed_replay_cache(cache: ReplayCache, ledger: UsageLedger) -> None:
    """Refuse, after a restart, every route this node ever forwarded that has not expired.

    Each row is written before its request is forwarded and carries its route's own
    expiry, so a route cut short by a crash at any instant is refused on its return.
    Rows from a ledger older than that column fall back to admission time + the longest
    route lifetime.
    """
    now = time.time()
    seeded: set[str] = set()
    for request_id, expires_at in ledger.unexpired_routes_sync(now - CLOCK_SKEW_S):
        cache.remember(request_id, expires_at, now)
        seeded.add(request_id)
    for request_id, started_at in ledger.request_ids_since_sync(now - REPLAY_SEED_WINDOW_S):
        if request_id not in seeded:
            cache.remember(request_id, started_at + MAX_ROUTE_LIFETIME_S, now)


def default_advertised_url(settings: NodeSettings) -> str:
    if is_wildcard(settings.host):
        raise MeshSetupError(
            f"listening on {settings.host!r} (all addresses): set --advertised-url / MESHNET_ADVERTISED_URL "
            "to the address the tracker should use"
        )
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"http://{host}:{settings.port}"
