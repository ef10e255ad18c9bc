"""A fair market among the nodes of one model: which of the near-best nodes takes the next request, the
share of requests that goes to nodes not measured yet, and each node's share of the last requests.

`registry.pick` ranks nodes by expected time to first token (`node_speed`); a strict minimum of that
sent every quiet request to one of several equal nodes (whichever was measured a hair faster) and none
to a node not measured yet, so a new node was never measured and its operator earned nothing. Here:

- **The band.** Every node whose expected first token is within `FAIR_BAND_TOLERANCE` of the best
  shares the requests, each in proportion to what it can serve now: its free slots over its expected
  TTFT. The turn goes by *smooth weighted round-robin* (nginx's): each pick, every node in the band
  earns its weight's share of one request in credit and the one picked pays one request, so equal
  nodes alternate and unequal ones interleave at their weights' ratio, with no run of luck (a
  weighted random pick and two random choices were measured against it: `bench/bench_fair_market.py`,
  `bench/RESULTS.md`, "A fair market among equal nodes"). Randomness only breaks ties.
- **Nodes not measured yet.** While a measured (trusted) node has a free slot, a node the tracker has
  not measured yet is not ranked by its claim at all: it gets `UNMEASURED_SHARE` of the requests
  until it is measured, then ranks by what it delivered. A node claiming 1,000x what it delivers so
  gets that share and no more before its claim is checked. A claim that the node is far slower than
  the best measured node (`CLAIM_BELIEVED_SLOWER`) is believed: it could only cost its maker. The same
  share measures again a node sent nothing for a while (`REMEASURE_AFTER_REQUESTS`): out of the band,
  its estimate would otherwise never change.
- **What each node got.** The last `RECENT_REQUESTS` requests of the model, by node, for the page and
  `/v1/nodes`.

Pure bookkeeping: no clock, no I/O; the registry owns one `Market` per model.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

# A node whose expected first token is at most this much later than the best node's shares the requests.
# Wider than the scatter of equal nodes' estimates (a moving average of jittery TTFTs: bench/RESULTS.md),
# narrower than one busy slot's stretch (`node_speed.BUSY_SLOT_PENALTY`, 0.25): an idle node still
# goes before an equally fast busy one.
FAIR_BAND_TOLERANCE = 0.2
# The share of a model's requests that goes to nodes not measured yet while a measured node could take
# them: a new node needs `node_speed.TRUST_AFTER_SAMPLES` (5) streams, so it is measured within its
# first ~25 requests of the model (on a network of one request every 5 s, about two minutes), and a node
# that lies about its speed draws at most this share before it is measured.
UNMEASURED_SHARE = 0.2
# Unused share is banked up to one request: a new node on a quiet network gets its first stream at
# once, and no burst of requests follows a long quiet spell.
UNMEASURED_CREDIT_CAP = 1.0
# A node not measured yet whose claim says it is more than this many times slower than the best
# measured node is believed and not sent requests to measure it (it still takes the overflow). Below
# it a claim is doubted: an honest probe's claim read against the tracker's prompt bound came out 3-6x
# slower than what the node delivered (a GPU node: 10,207 claimed, 61,176 measured), and that must not hide an equal node.
CLAIM_BELIEVED_SLOWER = 8.0
# Standard errors of two nodes' TTFT estimates by which the band is widened: at 2, two equal nodes'
# estimates fall apart by chance about once in 40 picks, where a fixed band alone dropped one of three
# equal nodes with +-30 % jitter per stream from a third of 60 requests in 89 of 300 seeded runs.
SPREAD_ALLOWANCE = 2.0
# A measured node that got none of the model's last this many requests is measured again with the
# unmeasured share: a node out of the band is sent nothing, so without this a single unlucky stream
# (a hiccup on its box) would keep its estimate, and it, out for good.
REMEASURE_AFTER_REQUESTS = 20
# ...unless its own figures put it more than this many times past the band's edge: one unlucky stream moves
# a moving average by well under this, and a node that far behind is slower, not unlucky (measured again
# every 20 requests, a node 5x slower cost 5 % of the requests a slow answer: the p95 of bench/RESULTS.md).
REMEASURE_WITHIN = 2.0
# The requests each node's share is counted over, per model: enough that one request moves a share by
# a point, few enough that an operator sees a change within minutes.
RECENT_REQUESTS = 100
# A node's credit in the turn stays within this many requests either way: a node that left the band
# owed a turn (busy, or slower for a while) comes back with at most this, never a burst.
CREDIT_BOUND = 1.0


class Candidate(Protocol):
    @property
    def node_id(self) -> str: ...


C = TypeVar("C", bound=Candidate)


@dataclass(frozen=True)
class NodeOffer(Generic[C]):
    """What one node offers this request: its expected TTFT (its load included), how far that estimate
    may be off by chance (`node_speed.NodeSpeed.ttft_spread_s`, stretched alike), its requests in flight
    and its free slots."""

    node: C
    ttft_s: float
    spread_s: float
    busy: int
    free_slots: int


class Market(Generic[C]):
    """One model's market: the band's turn, the unmeasured nodes' share, and the recent requests by node."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._credit: dict[str, float] = {}
        self._unmeasured_credit = 0.0
        self._recent: deque[str] = deque(maxlen=RECENT_REQUESTS)
        self._recent_counts: Counter[str] = Counter()
        self._requests = 0  # client requests of the model so far
        self._last_sent: dict[str, int] = {}  # node id -> `_requests` when it was last sent one

    # --- the pick ------------------------------------------------------------------
    def band(self, offers: Sequence[NodeOffer[C]]) -> list[tuple[C, float]]:
        """The nodes that share this request, each with its weight: those whose expected first token is
        within `FAIR_BAND_TOLERANCE` of the soonest, widened by `SPREAD_ALLOWANCE` standard errors of the
        two estimates (equal nodes measured on a jittery network must not fall out by chance), and of
        those the least busy (an idle node goes before an equally fast busy one). A node's weight is what
        it can serve now: its free slots over its expected TTFT."""
        if not offers:
            return []
        best = min(offers, key=lambda o: o.ttft_s)
        near = [
            o for o in offers
            if o.ttft_s <= best.ttft_s * (1 + FAIR_BAND_TOLERANCE) + SPREAD_ALLOWANCE * math.hypot(o.spread_s, best.spread_s)
        ]  # fmt: skip
        least_busy = min(o.busy for o in near)
        return [(o.node, max(o.free_slots, 1) / max(o.ttft_s, 1e-9)) for o in near if o.busy == least_busy]

    def take_turn(self, band: Sequence[tuple[C, float]]) -> C:
        """Smooth weighted round-robin over the band: each node earns its weight's share, the one with the
        most credit is picked (ties at random) and pays one request."""
        total = sum(weight for _, weight in band)
        for node, weight in band:
            self._credit[node.node_id] = self._credit.get(node.node_id, 0.0) + weight / total
        most = max(self._credit[node.node_id] for node, _ in band)
        picked = self._rng.choice([node for node, _ in band if self._credit[node.node_id] >= most - 1e-12])
        self._credit[picked.node_id] -= 1.0
        for node, _ in band:
            self._credit[node.node_id] = min(max(self._credit[node.node_id], -CREDIT_BOUND), CREDIT_BOUND)
        return picked

    def unmeasured_turn(self) -> bool:
        """Whether this request goes to a node not measured yet (`UNMEASURED_SHARE`); asked only while one
        could take it, after `earn_unmeasured`."""
        if self._unmeasured_credit >= 1.0:
            self._unmeasured_credit -= 1.0
            return True
        return False

    def earn_unmeasured(self) -> None:
        """Every client request (not a retry of one) earns the nodes not measured yet their share, whether one
        is waiting or not (banked up to `UNMEASURED_CREDIT_CAP`)."""
        self._unmeasured_credit = min(self._unmeasured_credit + UNMEASURED_SHARE, UNMEASURED_CREDIT_CAP)
        self._requests += 1

    def stale(self, node_id: str) -> bool:
        """A measured node sent none of the model's last `REMEASURE_AFTER_REQUESTS` requests."""
        return self._requests - self._last_sent.setdefault(node_id, self._requests) >= REMEASURE_AFTER_REQUESTS

    def least_measured(self, nodes: Sequence[C], samples: dict[str, int], routed: dict[str, int]) -> C:
        """Which node not measured yet is measured next: the one with the fewest streams, then the least
        routed to, ties at random."""
        key = {n.node_id: (samples[n.node_id], routed[n.node_id]) for n in nodes}
        least = min(key.values())
        return self._rng.choice([n for n in nodes if key[n.node_id] == least])

    # --- what each node got ------------------------------------------------------
    def routed(self, node_id: str) -> None:
        """A request of this model went to `node_id`."""
        if len(self._recent) == RECENT_REQUESTS:
            gone = self._recent[0]
            self._recent_counts[gone] -= 1
            if not self._recent_counts[gone]:
                del self._recent_counts[gone]
        self._recent.append(node_id)
        self._recent_counts[node_id] += 1
        self._last_sent[node_id] = self._requests

    def recent_share(self, node_id: str) -> tuple[int, int]:
        """(requests of the last ones that went to `node_id`, the last requests counted)."""
        return self._recent_counts.get(node_id, 0), len(self._recent)

    def forget(self, node_id: str) -> None:
        """A node that left: its credit in the turn goes (its share of past requests stays counted)."""
        self._credit.pop(node_id, None)
        self._last_sent.pop(node_id, None)


__all__ = [
    "CLAIM_BELIEVED_SLOWER",
    "CREDIT_BOUND",
    "FAIR_BAND_TOLERANCE",
    "RECENT_REQUESTS",
    "SPREAD_ALLOWANCE",
    "REMEASURE_AFTER_REQUESTS",
    "REMEASURE_WITHIN",
    "UNMEASURED_CREDIT_CAP",
    "UNMEASURED_SHARE",
    "Market",
    "NodeOffer",
]
