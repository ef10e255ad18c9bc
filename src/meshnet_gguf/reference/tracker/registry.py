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

    @property
    def node_id(self) -> str:
        return self.announcement.node_id

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
        return entry, displaced

    def heartbeat(self, node_id: str, state: MeshState, load: NodeLoad) -> NodeEntry | None:
        entry = self._nodes.get(node_id)
        if entry is None:
            return None
        entry.state, entry.load, entry.last_seen = state, load, self._clock()
        entry.in_flight_at_heartbeat = entry.in_flight
        return entry

    def remove(self, node_id: str) -> NodeEntry | None:
        entry = self._nodes.pop(node_id, None)
        if entry is not None:
            self.market(entry.announcement.model_id).forget(node_id)
        return entry

    def expire(self) -> list[str]:
        """Drop nodes silent for longer than the TTL; returns their ids."""
        cutoff = self._clock() - self.ttl_s
        gone = [node_id for node_id, entry in self._nodes.items() if entry.last_seen < cutoff]
        for node_id in gone:
            self.remove(node_id)
        return gone

    def routable(self, model: str) -> list[NodeEntry]:
        """Online, healthy, fresh nodes holding every layer of `model`: the only ones given single-hop routes."""
        cutoff = self._clock() - self.ttl_s
        return [
            entry
            for entry in self._nodes.values()
            if entry.announcement.answers_to(model)
            and entry.state == "online"
            and entry.healthy
            and entry.last_seen >= cutoff
            and entry.announcement.full_coverage
            and not entry.proof_blocked
        ]

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
        """
        candidates = [e for e in self.routable(model) if e.node_id not in exclude]
        if not candidates:
            return None
        floor = overhead_floor_s(e.speed for e in candidates)
        free = [e for e in candidates if not e.full()]
        if not free:
            return min(candidates, key=lambda e: route_rank(e, prompt_tokens, floor))
        market = self.market(free[0].announcement.model_id)
        if not exclude:  # a client's request, not a retry of one
            market.earn_unmeasured()
        expected = {e.node_id: expected_ttft_s(e.speed, prompt_tokens, e.busy(), floor) for e in free}
        measured = [e for e in free if e.speed.trusted]
        unmeasured = [e for e in free if not e.speed.trusted]
        if measured:
            best = min(t for e in measured if (t := expected[e.node_id]) is not None)
            # A claim of being far slower is believed (it costs only its maker): its prefill alone, overheads
            # left out, against the best measured TTFT. Any other is measured, and so is a measured node not
            # sent a request for a while unless its own figures put it well past the band.
            believed_slower = best * (1 + FAIR_BAND_TOLERANCE) * CLAIM_BELIEVED_SLOWER
            worth_measuring = [
                e for e in unmeasured if (t := e.speed.claimed_prefill_s(prompt_tokens)) is None or t <= believed_slower
            ] + [
                e for e in measured
                if market.stale(e.node_id) and expected[e.node_id] <= best * (1 + FAIR_BAND_TOLERANCE) * REMEASURE_WITHIN  # type: ignore[operator]
            ]  # fmt: skip
            if worth_measuring and market.unmeasured_turn():
                samples = {e.node_id: e.speed.samples for e in worth_measuring}
                return market.least_measured(worth_measuring, samples, {e.node_id: e.routed for e in worth_measuring})
            pool = measured
        else:
            pool = unmeasured
        offers = [
            NodeOffer(e, t, e.speed.ttft_spread_s(prompt_tokens) * load_factor(e.busy()), e.busy(), e.free_slots())
            for e in pool
            if (t := expected[e.node_id]) is not None
        ]
        if not offers:  # no figure for any of them
            return min(pool, key=lambda e: (e.busy_fraction(), e.routed))
        return market.take_turn(market.band(offers))

    def routed_to(self, entry: NodeEntry) -> None:
        """A request was sent to `entry`: counted for it and for its model's recent shares."""
        entry.routed += 1
        self.market(entry.announcement.model_id).routed(entry.node_id)

    def recent_share(self, entry: NodeEntry) -> tuple[int, int]:
        """(requests of its model's last ones that went to `entry`, the last requests counted: `market.RECENT_REQUESTS`)."""
        return self.market(entry.announcement.model_id).recent_share(entry.node_id)

    def serves(self, model: str) -> bool:
        """Whether some registered node answers to `model`: its id or an alias (`protocol.model_answers_to`)."""
        return any(entry.announcement.answers_to(model) for entry in self._nodes.values())

    def models(self) -> dict[str, list[NodeEntry]]:
        """Every model some node announced, with its routable nodes (possibly none)."""
        found: dict[str, list[NodeEntry]] = {}
        for entry in self._nodes.values():
            found.setdefault(entry.announcement.model_id, [])
        for model in found:
            found[model] = self.routable(model)
        return found


def route_rank(entry: NodeEntry, prompt_tokens: int, overhead_floor_s: float = 0.0) -> tuple[bool, bool, float, float, int]:
    """Smaller is better. A node with a free slot before a full one (a full node refuses with 503, so
    the request spills to the next); then the soonest expected first token (`node_speed.expected_ttft_s`:
    its speed for this prompt, stretched by its load; a claim is read with the overhead measured on
    the node, or before that the least measured on any, `overhead_floor_s`), nodes the tracker knows no speed of after those
    it does (they get the overflow until measured); then the least busy, then the least routed to."""
    expected = expected_ttft_s(entry.speed, prompt_tokens, entry.busy(), overhead_floor_s)
    return (entry.full(), expected is None, expected or 0.0, entry.busy_fraction(), entry.routed)
