"""The models one node serves at once: each with its file, the name requests use, and how it is run.

A `ModelToServe` is one model: its GGUF (first shard), its alias (the `model` field of a request), its quant,
context and slots, whether it is pinned (loaded at start, never unloaded for another) and, for the others,
how long it may sit idle before it is unloaded. A `ModelSet` is the node's list: checked once, with every
limit a named constant, so a bad set is refused before anything is launched. Where each model lives in
memory is the launch plan's question, not this module's: `memory_bytes` is what that plan said it needs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from meshnet_gguf.models.quants import quant_of

# An alias names a model in requests (the `model` field), logs and the tracker's listing, as the node names
# its model today: `owner/name:QUANT`, `demo:Q4_K_M`. Never a path: each model's state folder is named by a digest.
ALIAS_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")
MAX_ALIAS_CHARS = 128
# More models than this on one node is a catalog, not a serving set: each one is a llama-server when loaded.
MAX_MODELS = 16
MIN_CONTEXT = 256
MAX_CONTEXT = 1 << 21
MAX_SLOTS = 256
# Unloading a model sooner than this after its last request only trades memory for a reload (a load takes
# ~0.1 s for a tiny model and ~1 s for the demo here: bench/RESULTS.md, "Several models per node").
MIN_IDLE_UNLOAD_S = 10.0
DEFAULT_IDLE_UNLOAD_S = 15 * 60.0


class ModelSetError(ValueError):
    """The set of models cannot be served as given; the message names the model and what is wrong."""


@dataclass(frozen=True)
class ModelToServe:
    path: Path
    alias: str
    context: int
    slots: int = 1
    quant: str | None = None  # None: read from the file name where it says
    pinned: bool = False
    # None: never unloaded for idleness (a pinned model never is, whatever this says).
    idle_unload_s: float | None = DEFAULT_IDLE_UNLOAD_S
    # What the launch plan says this model needs loaded (weights, KV cache, buffers); None: not planned.
    memory_bytes: int | None = None

    @property
    def quant_label(self) -> str | None:
        return self.quant or quant_of(str(self.path))

    @property
    def unloads_when_idle(self) -> bool:
        return not self.pinned and self.idle_unload_s is not None

    def llama_args(self) -> list[str]:
        """llama-server's arguments for this model alone (the node adds its launch plan's: layers, threads...)."""
        return ["--model", str(self.path), "--alias", self.alias, "--ctx-size", str(self.context), "--parallel", str(self.slots)]

    def problems(self) -> list[str]:
        found = []
        if len(self.alias) > MAX_ALIAS_CHARS or not ALIAS_PATTERN.fullmatch(self.alias):
            found.append(f"alias {self.alias!r}: use up to {MAX_ALIAS_CHARS} letters, digits, '.', '_', ':', '/' or '-'")
        if not self.path.is_file():
            found.append(f"{self.path}: no such file")
        if not MIN_CONTEXT <= self.context <= MAX_CONTEXT:
            found.append(f"context {self.context}: between {MIN_CONTEXT} and {MAX_CONTEXT} tokens")
        if not 1 <= self.slots <= MAX_SLOTS:
            found.append(f"slots {self.slots}: between 1 and {MAX_SLOTS}")
        if self.idle_unload_s is not None and self.idle_unload_s < MIN_IDLE_UNLOAD_S:
            found.append(f"idle unload after {self.idle_unload_s:g} s: at least {MIN_IDLE_UNLOAD_S:g} s (a reload costs more)")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            found.append(f"memory {self.memory_bytes} bytes: must be positive")
        return found


@dataclass(frozen=True)
class ModelSet:
    models: tuple[ModelToServe, ...]

    @classmethod
    def checked(cls, models: Iterable[ModelToServe]) -> ModelSet:
        """The set, or ModelSetError naming every problem of every model."""
        listed = tuple(models)
        problems: list[str] = []
        if not listed:
            problems.append("no model to serve")
        if len(listed) > MAX_MODELS:
            problems.append(f"{len(listed)} models: at most {MAX_MODELS} on one node")
        seen: set[str] = set()
        for model in listed:
            problems += [f"{model.alias}: {p}" for p in model.problems()]
            if model.alias.lower() in seen:
                problems.append(f"{model.alias}: two models have this alias (aliases are compared without case)")
            seen.add(model.alias.lower())
        if problems:
            raise ModelSetError("cannot serve this set of models:\n  " + "\n  ".join(problems))
        return cls(listed)

    def __iter__(self) -> Iterator[ModelToServe]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    def get(self, alias: str) -> ModelToServe | None:
        """The model a request names (aliases are compared without case, as requests spell them freely)."""
        wanted = alias.lower()
        return next((m for m in self.models if m.alias.lower() == wanted), None)

    @property
    def aliases(self) -> list[str]:
        return [m.alias for m in self.models]

    @property
    def pinned(self) -> list[ModelToServe]:
        return [m for m in self.models if m.pinned]
