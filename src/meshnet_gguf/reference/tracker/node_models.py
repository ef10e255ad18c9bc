"""The models one node serves, as the tracker tracks them: each one's state, its requests in flight, its speed, and
what a cold load adds to a request's first token there.

A node announces every model it serves (`NodeAnnouncement.models`), each `loaded`, `loadable` (loaded on its
first request, which waits `expected_load_s` first) or `unavailable`; its heartbeats say what changed since. A
request for a loadable model starts its load, so the tracker counts that load from when it sent the request: a
second request right after waits only for what is left of it, not a whole load again. Pure bookkeeping: no clock
of its own, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from meshnet_gguf.contract.protocol import AnnouncedModel, ModelLoadState, ModelStateReport, NodeAnnouncement
from meshnet_gguf.reference.tracker.node_speed import NodeSpeed

# A loadable model whose node has not measured a load yet (it measures the first): what a small model's load
# takes on a modest box (bench/RESULTS.md, "Several models per node": ~0.1 s for a tiny model, ~1 s for the
# demo), rounded up so that a warm node of the same speed always wins.
UNMEASURED_LOAD_S = 10.0
# At most one stream a model goes untimed for its first token in this long on one node: a node unloads a model only
# after it sat idle at least this long (`llama.model_set.MIN_IDLE_UNLOAD_S`), so an honest one loads it no more
# often; a node flipping its model's state at every heartbeat to stay unmeasured is timed all the same.
UNTIMED_LOAD_INTERVAL_S = 10.0


@dataclass
class ModelOnNode:
    """One announced model on one node."""

    served: AnnouncedModel
    speed: NodeSpeed  # per model: a node is as fast as the model it runs (the first model's is the node's own)
    state: ModelLoadState = "loaded"
    expected_load_s: float | None = None
    in_flight: int = 0  # requests for this model this tracker is relaying to the node now
    load_sent_at: float | None = field(default=None)  # when this tracker sent the request that loads it
    untimed_at: float | None = None  # when a stream of it last went untimed for its first token (it started a load)
    # What its last load here took as this tracker saw it: the first token of the stream that started it, less what
    # the node's first token takes warm. A node is believed for a load slower than this, never for a faster one.
    seen_load_s: float | None = None

    @property
    def model_id(self) -> str:
        return self.served.model_id

    @property
    def routable(self) -> bool:
        return self.state != "unavailable"

    def cold_load_s(self, now: float) -> float:
        """What loading the model adds to a request's first token now: 0 when loaded; else its expected load, less
        what went by since this tracker sent the request that started it."""
        if self.state == "loaded":
            return 0.0
        expected = self.expected_load_s if self.expected_load_s is not None else UNMEASURED_LOAD_S
        expected = max(expected, self.seen_load_s or 0.0)
        if self.load_sent_at is None:
            return expected
        return max(expected - (now - self.load_sent_at), 0.0)

    def sent(self, now: float) -> bool:
        """A request was sent for the model; True when its stream is not to be timed for its first token: it starts
        a load here (its first token waits for it). Only the request that starts one, and at most one in
        `UNTIMED_LOAD_INTERVAL_S`: the others are timed whatever the node says, so a node that calls its model
        loadable forever, or flips it at every heartbeat, is measured all the same."""
        starts_load = self.state != "loaded" and self.load_sent_at is None
        if starts_load:
            self.load_sent_at = now
        untimed = starts_load and (self.untimed_at is None or now - self.untimed_at >= UNTIMED_LOAD_INTERVAL_S)
        if untimed:
            self.untimed_at = now
        return untimed

    def load_seen(self, ttft_s: float, warm_ttft_s: float | None) -> None:
        """The stream that started a load gave its first token after `ttft_s`; the model's first token takes
        `warm_ttft_s` here when loaded (None: not known, counted as nothing)."""
        self.seen_load_s = max(ttft_s - (warm_ttft_s or 0.0), 0.0)

    def report(self, state: ModelStateReport) -> None:
        """The node's word on the model's state (a heartbeat): it replaces what the tracker assumed."""
        if state.state != self.state:
            self.load_sent_at = None
        self.state = state.state
        if state.expected_load_s is not None:
            self.expected_load_s = state.expected_load_s

    def view(self, now: float) -> dict[str, object]:
        """What `/v1/nodes` and the tracker page show of the model on this node."""
        return {
            "model": self.model_id,
            "state": self.state,
            "loading": self.state != "loaded" and self.load_sent_at is not None,
            "expected_load_s": self.expected_load_s,
            "seen_load_s": None if self.seen_load_s is None else round(self.seen_load_s, 3),
            "cold_load_s": round(self.cold_load_s(now), 3),
            "in_flight": self.in_flight,
            "slots": self.served.slots,
        }


def models_of(announcement: NodeAnnouncement, node_speed: NodeSpeed) -> dict[str, ModelOnNode]:
    """The announced models by their ids, in the announced order; the first gets the node's own speed (its claim
    is the first model's), the others start unmeasured."""
    found: dict[str, ModelOnNode] = {}
    for index, served in enumerate(announcement.served_models()):
        speed = node_speed if index == 0 else NodeSpeed()
        found[served.model_id] = ModelOnNode(served, speed, served.state, served.expected_load_s)
    return found


def by_name(models: dict[str, ModelOnNode]) -> dict[str, ModelOnNode]:
    """Each model under every name it answers to, in lower case (`protocol.model_answers_to`, looked up once a
    request rather than matched against every name)."""
    return {name.lower(): model for model in models.values() for name in model.served.names()}


def apply_reports(models: dict[str, ModelOnNode], reports: Iterable[ModelStateReport]) -> None:
    """A heartbeat's model states onto the node's models; a model it did not announce is ignored (a heartbeat
    cannot add one: only a registration, with its checks, can)."""
    for report in reports:
        if (model := models.get(report.model_id)) is not None:
            model.report(report)


__all__ = ["UNMEASURED_LOAD_S", "UNTIMED_LOAD_INTERVAL_S", "ModelOnNode", "apply_reports", "by_name", "models_of"]
