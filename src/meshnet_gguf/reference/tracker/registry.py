"""The tracker's live view of its nodes: who is registered, their state, load and health.

In memory on purpose: after a tracker restart nodes learn it from their next
heartbeat (404 unknown_node) and register again within one period.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from meshnet_gguf.contract.protocol import HealthReport, MeshState, NodeAnnouncement, NodeLoad
from meshnet_gguf.reference.tracker.market import CLAIM_BELIEVED_SLOWER, FAIR_BAND_TOLERANCE, REMEASURE_WITHIN, Market, NodeOffer
from meshnet_gguf.reference.tracker.node_address import NodeTarget
from meshnet_gguf.reference.tracker.node_models import ModelOnNode, apply_reports, by_name, models_of
from meshnet_gguf.reference.tracker.node_speed import NodeSpeed, expected_ttft_s, load_factor, overhead_floor_s

# The prompt length a caller that names none is ranked for: a short chat turn (metering's bound of one).
DEFAULT_PROMPT_TOKENS = 256


@dataclass
class NodeEntry:
    announcement: NodeAnnouncement
    target: NodeTarget  # the advertised URL as checked and pinned at registration
    state: MeshState
    load: NodeLoad
    last_seen: float
    healthy: bool = False
    health: HealthReport | None = None
    health_misses: int = 0  # polls in a row that got no answer
    in_flight: int = 0  # requests this tracker is relaying to the node right now
    in_flight_at_heartbeat: int = 0  # what `in_flight` was when the last heartbeat's load came in
    routed: int = 0
    # Its claimed and measured speed, for this registration only: a restarted node starts afresh.
    speed: NodeSpeed = field(default_factory=NodeSpeed)
    # Proof of model (tracker/audits.py): not routed while its registration probe runs or after a failed audit.
    proof_blocked: bool = False
    # Every model it announced, by id (`node_models`), and under each name it answers to; set at registration.
    models: dict[str, ModelOnNode] = field(default_factory=dict)
    names: dict[str, ModelOnNode] = field(default_factory=dict, repr=False)
    # The announcement's, kept as a plain field: the pick reads it many times a request, and it never changes
    # (a registration updates the entry of the same node id in place).
    node_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.node_id = self.announcement.node_id
        if not self.models:
            self.set_models(models_of(self.announcement, self.speed))

    def set_models(self, models: dict[str, ModelOnNode]) -> None:
        self.models, self.names = models, by_name(models)

    def model_for(self, requested: str) -> ModelOnNode | None:
        """The model a request naming `requested` is for on this node (by id or alias, `protocol.model_answers_to`);
        None when it serves none."""
        return self.names.get(requested.strip().lower())

    def primary(self) -> ModelOnNode:
        """The first model announced (`model_id`): the one an old tracker knows, audits and the node's own speed."""
        return self.models[self.announcement.model_id]

    def started(self, model: ModelOnNode) -> None:
        """A request for `model` is being relayed to the node."""
        self.in_flight += 1
        model.in_flight += 1

    def ended(self, model: ModelOnNode) -> None:
        self.in_flight -= 1
        model.in_flight -= 1

    def busy_for(self, model: ModelOnNode) -> int:
        """The node's requests that hold one of `model`'s slots, as far as the tracker can tell: the node's own
        `busy()` less what this tracker is relaying for its other models (traffic from elsewhere counts whole)."""
        if len(self.models) == 1:
            return self.busy()
        return max(self.busy() - (self.in_flight - model.in_flight), 0)

    def slots_for(self, model: ModelOnNode) -> int:
        return model.served.slots or self.announcement.slots

    def full_for(self, model: ModelOnNode) -> bool:
        """No slot for `model` here: its own are taken, or every slot of the node is."""
        return self.full() or (len(self.models) > 1 and self.busy_for(model) >= self.slots_for(model))

    def free_slots_for(self, model: ModelOnNode) -> int:
        if len(self.models) == 1:
            return self.free_slots()
        return max(min(self.slots_for(model) - self.busy_for(model), self.free_slots()), 0)

    def busy_fraction_for(self, model: ModelOnNode) -> float:
        return self.busy_for(model) / max(self.slots_for(model), 1)

    def busy(self) -> int:
        # Our own in-flight count is current; the heartbeat's is up to a period old but sees traffic
        # from elsewhere. Its count includes what this tracker had in flight then, so only the rest is
        # added: a heartbeat sent during our own last request must not keep the node looking busy
        # for a period after that request ended.
        return self.in_flight + self._from_elsewhere(self.load.slots_busy + self.load.queue_depth)

    def slots_busy(self) -> int:
        """Slots at work on the node now, as far as the tracker can tell (what its page shows)."""
        return min(self.in_flight + self._from_elsewhere(self.load.slots_busy), self.announcement.slots)

    def _from_elsewhere(self, reported: int) -> int:
        return max(reported - self.in_flight_at_heartbeat, 0)

    def busy_fraction(self) -> float:
        return self.busy() / max(self.announcement.slots, 1)

    def full(self) -> bool:
        return self.busy() >= self.announcement.slots

    def free_slots(self) -> int:
        return max(self.announcement.slots - self.busy(), 0)


class NodeRegistry:
    """`rng` breaks ties in the pick (seeded in tests, so a run repeats)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._rng = rng or random.Random()
        self._nodes: dict[str, NodeEntry] = {}
        self._markets: dict[str, Market[NodeEntry]] = {}  # by the node's own model id
        # Model ids audited here (proof of model): routed only to nodes that announce them first, the model their
        # registration probe and audits check; a node naming one second would serve it unaudited.
        self.audited_models: frozenset[str] = frozenset()

    def __len__(self) -> int:
        return len(self._nodes)

    def all(self) -> list[NodeEntry]:
        return list(self._nodes.values())

    def get(self, node_id: str) -> NodeEntry | None:
        return self._nodes.get(node_id)

    def register(self, announcement: NodeAnnouncement, target: NodeTarget) -> tuple[NodeEntry, list[str]]:
        """Add or update a node that proved control of `target`; returns it and the ids of the nodes
        it displaced. One node per URL: whoever last proved it holds the URL's key owns it (a node
        restarted with a new identity), and the others lose their routes."""
        displaced = [
            other.node_id
            for other in self._nodes.values()
            if other.node_id != announcement.node_id and (other.target.url == target.url or other.target.endpoint == target.endpoint)
        ]
        for node_id in displaced:
            del self._nodes[node_id]
        entry = self._nodes.get(announcement.node_id)
        if entry is None:
            entry = NodeEntry(
                announcement, target, announcement.state, NodeLoad(slots_total=announcement.slots), self._clock(),
                speed=NodeSpeed(announcement.capability),
            )  # fmt: skip
            self._nodes[announcement.node_id] = entry
            return entry, displaced
        # Updated in place: relays in progress hold this entry and give their in-flight count back to it.
        entry.announcement, entry.target = announcement, target
        entry.state, entry.last_seen = announcement.state, self._clock()
        entry.load, entry.in_flight_at_heartbeat = NodeLoad(slots_total=announcement.slots), 0
        entry.healthy, entry.health_misses = False, 0  # a new announcement (new URL?) is polled afresh
        # A new registration is a restarted node (maybe on other hardware or settings): nothing measured before holds.
        entry.speed = NodeSpeed(announcement.capability)
        # Its models afresh, each keeping the requests in flight that relays in progress will give back.
        in_flight = {model_id: m.in_flight for model_id, m in entry.models.items()}
        entry.set_models(models_of(announcement, entry.speed))
        for model_id, count in in_flight.items():
            if model_id in entry.models:
                entry.models[model_id].in_flight = count
        return entry, displaced

    def heartbeat(self, node_id: str, state: MeshState, load: NodeLoad) -> NodeEntry | None:
        entry = self._nodes.get(node_id)
        if entry is None:
            return None
        entry.state, entry.load, entry.last_seen = state, load, self._clock()
        entry.in_flight_at_heartbeat = entry.in_flight
        apply_reports(entry.models, load.models)
        return entry

    def remove(self, node_id: str) -> NodeEntry | None:
        entry = self._nodes.pop(node_id, None)
        if entry is not None:
            for model_id in entry.models:
                self.market(model_id).forget(node_id)
        return entry

    def expire(self) -> list[str]:
        """Drop nodes silent for longer than the TTL; returns their ids."""
        cutoff = self._clock() - self.ttl_s
        gone = [node_id for node_id, entry in self._nodes.items() if entry.last_seen < cutoff]
        for node_id in gone:
            self.remove(node_id)
        return gone

    def routable(self, model: str) -> list[NodeEntry]:
        """Online, healthy, fresh nodes holding every layer of `model`, not `unavailable` there (an audited model
        only where it is the node's first): the only ones given single-hop routes."""
        cutoff = self._clock() - self.ttl_s
        return [entry for entry in self._nodes.values() if self._routable(entry, model, cutoff)]

    def is_routable(self, entry: NodeEntry, model: str | None = None) -> bool:
        """Whether `entry` is given routes for `model` (its own model by default) now: what `/v1/nodes` says,
        so that "online and healthy" with its heartbeats lapsed is not read as routable."""
        return self._routable(entry, model or entry.announcement.model_id, self._clock() - self.ttl_s)

    def silent_s(self, entry: NodeEntry) -> float:
        """Seconds since the node's last registration or heartbeat."""
        return max(0.0, self._clock() - entry.last_seen)

    def _routable(self, entry: NodeEntry, model: str, cutoff: float) -> bool:
        return (
            (served := entry.model_for(model)) is not None
            and served.routable
            and (served is entry.primary() or not self._audited(served))
            and entry.state == "online"
            and entry.healthy
            and entry.last_seen >= cutoff
            and entry.announcement.full_coverage
            and not entry.proof_blocked
        )

    def _audited(self, model: ModelOnNode) -> bool:
        audited = {m.lower() for m in self.audited_models}
        return any(name.lower() in audited for name in model.served.names())

    def market(self, model_id: str) -> Market[NodeEntry]:
        """The market of the nodes whose own model id is `model_id` (`market.Market`)."""
        if (market := self._markets.get(model_id)) is None:
            market = self._markets[model_id] = Market(self._rng)
        return market

    def pick(self, model: str, exclude: Collection[str] = (), prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> NodeEntry | None:
        """The routable node to send this prompt to, not one in `exclude` (those already tried: a
        non-empty `exclude` is a retry); None when there is none. Docs/protocol.md, section 8.1, R1 and R5:

        - every node full: the soonest by `route_rank` (it answers 503 and the client retries);
        - else, while a measured (trusted) node has a free slot, a node not measured yet takes its
          share (`market.UNMEASURED_SHARE`) unless its claim says it is far slower
          (`market.CLAIM_BELIEVED_SLOWER`), and the other requests are shared by the measured nodes
          within `market.FAIR_BAND_TOLERANCE` of the soonest expected first token, by smooth weighted
          turns (`market.Market.take_turn`);
        - with no measured node free, the same band among the nodes not measured yet, ranked by their
          claims; nodes with no figure at all, least busy first, then least routed to.

        Everything is per model: its slots, its speed on each node, and its cold load where it is not loaded
        (`node_models.ModelOnNode.cold_load_s`), added to the expected first token, so a warm node wins over a
        cold one of equal speed; a cold node is never sent a request only to measure it.
        """
        candidates = [e for e in self.routable(model) if e.node_id not in exclude]
        if not candidates:
            return None
        now = self._clock()
        on = {e.node_id: m for e in candidates if (m := e.model_for(model)) is not None}  # each one: it is routable for it
        cold = {e.node_id: on[e.node_id].cold_load_s(now) for e in candidates}
        floor = overhead_floor_s(on[e.node_id].speed for e in candidates)
        free = [e for e in candidates if not e.full_for(on[e.node_id])]
        if not free:
            return min(candidates, key=lambda e: route_rank(e, prompt_tokens, floor, on[e.node_id], cold[e.node_id]))
        market = self.market(on[free[0].node_id].model_id)
        if not exclude:  # a client's request, not a retry of one
            market.earn_unmeasured()
        busy = {e.node_id: e.busy_for(on[e.node_id]) for e in free}
        expected = {
            e.node_id: _plus(expected_ttft_s(on[e.node_id].speed, prompt_tokens, busy[e.node_id], floor), cold[e.node_id]) for e in free
        }
        measured = [e for e in free if on[e.node_id].speed.trusted]
        unmeasured = [e for e in free if not on[e.node_id].speed.trusted]
        if measured:
            best = min(t for e in measured if (t := expected[e.node_id]) is not None)
            # A claim of being far slower is believed (it costs only its maker): its prefill alone, overheads
            # left out, against the best measured TTFT. Any other is measured, and so is a measured node not
            # sent a request for a while unless its own figures put it well past the band.
            believed_slower = best * (1 + FAIR_BAND_TOLERANCE) * CLAIM_BELIEVED_SLOWER
            worth_measuring = [
                e for e in unmeasured
                if (t := on[e.node_id].speed.claimed_prefill_s(prompt_tokens)) is None or t <= believed_slower
            ] + [
                e for e in measured
                if market.stale(e.node_id) and expected[e.node_id] <= best * (1 + FAIR_BAND_TOLERANCE) * REMEASURE_WITHIN  # type: ignore[operator]
            ]  # fmt: skip
            worth_measuring = [e for e in worth_measuring if not cold[e.node_id]]  # a load is not a measurement
            if worth_measuring and market.unmeasured_turn():
                samples = {e.node_id: on[e.node_id].speed.samples for e in worth_measuring}
                return market.least_measured(worth_measuring, samples, {e.node_id: e.routed for e in worth_measuring})
            pool = measured
        else:
            pool = unmeasured
        offers = [
            NodeOffer(e, t, on[e.node_id].speed.ttft_spread_s(prompt_tokens) * load_factor(busy[e.node_id]), busy[e.node_id],
                      e.free_slots_for(on[e.node_id]))
            for e in pool
            if (t := expected[e.node_id]) is not None
        ]  # fmt: skip
        if not offers:  # no figure for any of them: warm before cold, then the least busy, then the least routed to
            return min(pool, key=lambda e: (cold[e.node_id], e.busy_fraction_for(on[e.node_id]), e.routed))
        return market.take_turn(market.band(offers))

    def routed_to(self, entry: NodeEntry, model: ModelOnNode | None = None) -> bool:
        """A request was sent to `entry` for `model` (its first when None): counted for it and for the model's
        recent shares. True when its stream is not to be timed for its first token: it starts the model's load
        there (`node_models.ModelOnNode.sent`)."""
        model = model or entry.primary()
        entry.routed += 1
        self.market(model.model_id).routed(entry.node_id)
        return model.sent(self._clock())

    def recent_share(self, entry: NodeEntry, model_id: str | None = None) -> tuple[int, int]:
        """(requests of the model's last ones that went to `entry`, the last requests counted: `market.RECENT_REQUESTS`);
        the model is the node's first when None."""
        return self.market(model_id or entry.announcement.model_id).recent_share(entry.node_id)

    def serves(self, model: str) -> bool:
        """Whether some registered node answers to `model`: its id or an alias (`protocol.model_answers_to`)."""
        return any(entry.model_for(model) is not None for entry in self._nodes.values())

    def models(self) -> dict[str, list[NodeEntry]]:
        """Every model some node announced (by the id the first node announcing it gave), with its routable nodes
        (possibly none)."""
        found: dict[str, list[NodeEntry]] = {}
        seen: set[str] = set()
        for entry in self._nodes.values():
            for model_id in entry.models:
                if model_id.lower() not in seen:
                    seen.add(model_id.lower())
                    found[model_id] = []
        for model in found:
            found[model] = self.routable(model)
        return found


def route_rank(
    entry: NodeEntry, prompt_tokens: int, overhead_floor_s: float = 0.0, model: ModelOnNode | None = None, cold_load_s: float = 0.0
) -> tuple[bool, bool, float, float, int]:
    """Smaller is better. A node with a free slot before a full one (a full node refuses with 503, so
    the request spills to the next); then the soonest expected first token (`node_speed.expected_ttft_s`:
    its speed for this prompt, stretched by its load; a claim is read with the overhead measured on
    the node, or before that the least measured on any, `overhead_floor_s`; plus the model's cold load there),
    nodes the tracker knows no speed of after those it does (they get the overflow until measured); then the
    least busy, then the least routed to. `model`: the requested model on the node (its first when None)."""
    model = model or entry.primary()
    expected = _plus(expected_ttft_s(model.speed, prompt_tokens, entry.busy_for(model), overhead_floor_s), cold_load_s)
    return (entry.full_for(model), expected is None, expected or cold_load_s, entry.busy_fraction_for(model), entry.routed)


def _plus(expected_s: float | None, cold_load_s: float) -> float | None:
    return None if expected_s is None else expected_s + cold_load_s
