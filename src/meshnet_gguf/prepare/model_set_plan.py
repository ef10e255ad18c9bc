"""The models a node serves beside its first, planned together with it.

Each entry (`common/model_entries`) runs the same pipeline as the first model (resolve, download, verify, plan)
with the binary and hardware already chosen, and is planned alone first (its own context and slots). Then
the set is placed together: the pinned models (the first one always) stay loaded, so they must fit side
by side, and each other model must fit in what they leave, on the GPU (whose budget on unified memory is
already the GTT ceiling's) and in all. A set that cannot is refused naming the model that would not fit
(`--force` tries anyway, and says so). The other models' figures become `ModelChildren`'s memory budget:
what the first model leaves, in which the others are loaded and idle ones unloaded to make room.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshnet_gguf.common.model_entries import ModelEntry
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.hardware.report import MemoryCapacity
from meshnet_gguf.llama.child import ChildSpec
from meshnet_gguf.llama.model_set import ModelSet, ModelSetError, ModelToServe
from meshnet_gguf.prepare.plan import LaunchPlan


class ModelSetDoesNotFit(ValueError):
    """The set of models cannot stay in this machine's memory as planned; the message names the model."""


@dataclass(frozen=True)
class ModelNeed:
    """What one model takes loaded, by the plan: on the GPU and in RAM outside it."""

    alias: str
    gpu_bytes: int
    host_bytes: int
    pinned: bool

    @property
    def total_bytes(self) -> int:
        return self.gpu_bytes + self.host_bytes

    def describe(self) -> str:
        gpu = f" ({format_bytes(self.gpu_bytes)} on the GPU)" if self.gpu_bytes else ""
        return f"{self.alias} {format_bytes(self.total_bytes)}{gpu}"


def need_of(alias: str, plan: LaunchPlan | None, *, pinned: bool) -> ModelNeed:
    if plan is None:
        return ModelNeed(alias, 0, 0, pinned)
    return ModelNeed(alias, plan.gpu_bytes, plan.host_bytes, pinned)


@dataclass(frozen=True)
class Room:
    """What the first model leaves the others: in all, and on the GPU (None: no GPU to share)."""

    total_bytes: int
    gpu_bytes: int | None

    def cost(self, need: ModelNeed) -> int:
        """The model's share of `total_bytes`, such that models whose shares add up within it also fit the GPU's
        room: its GPU bytes scaled by how much scarcer the GPU's room is, when it is (one figure is what
        `ModelChildren` counts room in)."""
        if need.gpu_bytes <= 0 or self.gpu_bytes is None or self.gpu_bytes >= self.total_bytes:
            return need.total_bytes
        if self.gpu_bytes <= 0:
            return self.total_bytes + 1  # no GPU room left: never fits
        return max(need.total_bytes, -(-need.gpu_bytes * self.total_bytes // self.gpu_bytes))


def fit_together(first: ModelNeed, others: Sequence[ModelNeed], capacity: MemoryCapacity) -> Room:
    """The room the first model leaves the others, or ModelSetDoesNotFit naming what would not fit in it: the
    pinned models side by side, then each other model beside them (each counted as `Room.cost`: in all and on the GPU)."""
    gpu = capacity.gpu_bytes - first.gpu_bytes if capacity.gpu_bytes > 0 else None
    room = Room(capacity.total_bytes - first.total_bytes, gpu)
    where = capacity.describe()
    pinned = [n for n in others if n.pinned]
    pinned_cost = sum(room.cost(n) for n in pinned)
    if pinned_cost > room.total_bytes:
        names = ", ".join(n.describe() for n in (first, *pinned))
        raise ModelSetDoesNotFit(f"the pinned models do not fit together: {names}; {where}")
    left_total = room.total_bytes - pinned_cost
    left_gpu = None if room.gpu_bytes is None else room.gpu_bytes - sum(n.gpu_bytes for n in pinned)
    for need in others:
        if not need.pinned and room.cost(need) > left_total:
            on_gpu = f" ({format_bytes(max(0, left_gpu))} on the GPU)" if need.gpu_bytes and left_gpu is not None else ""
            raise ModelSetDoesNotFit(
                f"{need.describe()} does not fit beside the pinned models ({', '.join(n.alias for n in (first, *pinned))}): "
                f"they leave {format_bytes(max(0, left_total))}{on_gpu}; {where}. Lower its ctx= or the first model's --ctx-size, "
                "or give it gpu-layers=0"
            )
    return room


@dataclass(frozen=True)
class OtherModels:
    """The models beside the first, as the node runs them: the checked set, each one's llama-server command,
    the bytes they may take together, and how often idle ones are looked for."""

    models: ModelSet
    children: Mapping[str, ChildSpec]
    budget_bytes: int | None
    plans: Mapping[str, LaunchPlan] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        lines = []
        for model in self.models:
            plan = self.plans.get(model.alias)
            when = "pinned" if model.pinned else f"loaded on demand, unloaded after {model.idle_unload_s:g} s idle"
            lines.append(f"also:      {model.alias} ({model.path}): {when}")
            if plan is not None:
                lines.append("           " + plan.describe(with_argv=False).replace("\n", "\n           "))
        if self.budget_bytes is not None:
            lines.append(f"models:    {format_bytes(self.budget_bytes)} left by the first model for the others")
        lines += [f"note:      {note}" for note in self.notes]
        return "\n".join(lines)


def entry_settings(settings: NodeSettings, entry: ModelEntry) -> NodeSettings:
    """The node's settings as one entry's model is prepared with: its own source, quant, context and slots.
    The operator's --llama-arg belongs to the first model; an entry's alias is llama-server's `--alias`."""
    return settings.model_copy(
        update={
            "gguf": entry.gguf, "quant": entry.quant, "demo": False, "ctx_size": entry.ctx_size, "parallel": entry.parallel,
            "n_gpu_layers": entry.n_gpu_layers, "llama_args": ["--alias", entry.alias] if entry.alias else [], "pool_workers": [],
        }
    )  # fmt: skip


def model_to_serve(
    entry: ModelEntry, settings: NodeSettings, *, path: Path, alias: str, quant: str | None, plan: LaunchPlan | None
) -> ModelToServe:
    need = need_of(alias, plan, pinned=entry.pinned)
    return ModelToServe(
        path=path,
        alias=alias,
        context=plan.ctx_size if plan is not None and plan.ctx_size else entry.ctx_size or 0,
        slots=entry.parallel,
        quant=quant,
        pinned=entry.pinned,
        idle_unload_s=entry.idle_unload_s if entry.idle_unload_s is not None else settings.model_idle_unload_s,
        memory_bytes=need.total_bytes or None,
    )


def checked_set(models: Sequence[ModelToServe], first_names: Sequence[str], *, on_disk: bool = True) -> ModelSet:
    """The other models as a `ModelSet`, none named as the first model is (ModelSetError naming it). Without
    `on_disk` (a dry run, where a model may not be downloaded yet) a file not there yet is no problem."""
    taken = {name.lower() for name in first_names}
    clash = [m.alias for m in models if m.alias.lower() in taken]
    if clash:
        raise ModelSetError(f"{', '.join(clash)}: the first model already answers to this name; give it another with alias=")
    if on_disk:
        return ModelSet.checked(models)
    present = [replace(m, path=m.path if m.path.is_file() else Path(__file__)) for m in models]  # any file: checks the rest
    ModelSet.checked(present)
    return ModelSet(tuple(models))


__all__ = [
    "ModelNeed",
    "ModelSetDoesNotFit",
    "OtherModels",
    "Room",
    "checked_set",
    "entry_settings",
    "fit_together",
    "model_to_serve",
    "need_of",
]
