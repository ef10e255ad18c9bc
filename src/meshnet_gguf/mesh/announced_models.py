"""The models a node tells its tracker it serves, each with its state: what its announcement and heartbeats carry.

A node serving one model announces it, loaded. A node serving several (one llama-server per model) fills the list
from its children's status: a loaded model is `loaded`; one unloaded, loading or being unloaded is `loadable`
(a request for it loads it, after the load time measured at its first load); one whose load failed is
`unavailable` (not routed here) until its retry is due, then `loadable` again: the next request tries it. The first model is the one the announcement's `model_id`
names: a tracker that predates the list routes that one alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from meshnet_gguf.contract.protocol import MAX_MODEL_ALIASES, AnnouncedModel, ModelLoadState, ModelStateReport, model_name_problem

# A child's state (`llama.model_children.ModelState`) as the tracker hears it.
CHILD_STATE_ON_WIRE: Mapping[str, ModelLoadState] = {
    "loaded": "loaded",
    "loading": "loadable",
    "unloaded": "loadable",
    "unloading": "loadable",
    "failed": "unavailable",
}


class ChildStatus(Protocol):
    """What the announcement reads of one model's status (`llama.model_children.ModelStatus` has it)."""

    @property
    def alias(self) -> str: ...

    @property
    def state(self) -> str: ...

    @property
    def expected_load_s(self) -> float | None: ...

    @property
    def retry_in_s(self) -> float | None: ...


def announced_from_children(statuses: Iterable[ChildStatus], described: Mapping[str, AnnouncedModel] | None = None) -> list[AnnouncedModel]:
    """Each child's model with its state now; `described` gives a model's other fields (aliases, quant, slots,
    context) by its alias. A state the wire has no word for is `unavailable`: never routed on a guess."""
    described = described or {}
    found = []
    for status in statuses:
        base = described.get(status.alias) or AnnouncedModel(model_id=status.alias)
        state = CHILD_STATE_ON_WIRE.get(status.state, "unavailable")
        if status.state == "failed" and status.retry_in_s == 0:
            state = "loadable"  # its retry is due: the next request tries it, so the tracker must send one
        found.append(base.model_copy(update={"state": state, "expected_load_s": status.expected_load_s}))
    return found


def first_model_first(models: Sequence[AnnouncedModel], first: AnnouncedModel) -> list[AnnouncedModel]:
    """`models` with the one named `first.model_id` at the head (the contract's order); `first` itself, loaded,
    where the list does not name it (a list that lost its first model still announces what the node was built for)."""
    head = next((m for m in models if m.model_id == first.model_id), first)
    return [head, *(m for m in models if m.model_id != first.model_id)]


def wire_aliases(aliases: Iterable[str]) -> list[str]:
    """The aliases the contract takes (`model_name_problem`, `MAX_MODEL_ALIASES`), in order: an alias it would refuse
    (a file name with a control character in it) is left out rather than keep the whole node off its tracker."""
    return [a for a in aliases if model_name_problem(a) is None][:MAX_MODEL_ALIASES]


def state_reports(models: Iterable[AnnouncedModel]) -> list[ModelStateReport]:
    """What a heartbeat says of each model: its state and its expected load, nothing that needs a registration."""
    return [ModelStateReport(model_id=m.model_id, state=m.state, expected_load_s=m.expected_load_s) for m in models]


__all__ = ["CHILD_STATE_ON_WIRE", "ChildStatus", "announced_from_children", "first_model_first", "state_reports", "wire_aliases"]
