"""What every kind of model source answers, and the one place a quant is chosen.

A source (`ModelSource`) is what `--gguf`/`--demo` names: a local file, a local
folder, a catalog entry or a hub repo. Each answers three questions the same way:

- `offered`: the quants it offers, with sizes (no model byte fetched);
- `on_disk`: the chosen quant's files as they are on disk already (no network, no writes);
- `fetch`: the chosen quant downloaded if needed and verified.

`choose_quant` picks one row of what a source offers; every caller (serve, its dry run,
`doctor`, `download`) goes through it. `checked` is the header check every returned
model has passed: nothing that failed a check is ever returned.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.models.catalog import CatalogEntry, CatalogQuant
from meshnet_gguf.models.download import FreeBytes, HubAccess, RepoListing
from meshnet_gguf.models.gguf_info import GGUFError, GGUFInfo, check_shard_set
from meshnet_gguf.models.gguf_names import shard_file_name, split_base
from meshnet_gguf.models.quants import QuantGroup, QuantRequired, QuantSelectionError, normalize_quant, quant_of, select_quant

log = logging.getLogger(__name__)

SourceKind = Literal["file", "directory", "hub", "package"]
# Called to say which quants fit: `budget()` gives the box's capacity in bytes. Only asked when
# a message lists the quants on offer, so a caller that knows its hardware never probes again.
Budget = Callable[[], int]


class ModelResolutionError(RuntimeError):
    """`--gguf`/`--quant` cannot be turned into a launchable model; the message says why and what to do."""


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready for llama-server: `first_shard` is what `--model` gets."""

    first_shard: Path
    shards: tuple[Path, ...]
    total_bytes: int
    source: SourceKind
    sha256s: tuple[str | None, ...]  # per shard; None where no reference exists (local files)
    verified: bool  # sha256 checked against the hub listing or the package
    repo_id: str | None = None
    quant: str | None = None
    catalog_id: str | None = None
    commit: str | None = None
    context_length: int | None = None  # the catalog's figure, when the model came from the catalog
    fetched_bytes: int = 0  # received from the hub while resolving (0 when everything was on disk)
    notes: tuple[str, ...] = field(default=())
    # Shard 1's parsed header, filled by the pre-launch check (parsing costs seconds on big vocabularies: reuse it).
    header: GGUFInfo | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """A short model name for `--alias`/announcements: the shared file stem (`Model-UD-IQ3_XXS`)."""
        return split_base(self.first_shard.name)

    @property
    def label(self) -> str:
        if self.catalog_id:
            return f"{self.catalog_id}:{self.quant}" if self.quant else self.catalog_id
        if self.repo_id:
            return f"{self.repo_id}:{self.quant}" if self.quant else self.repo_id
        return str(self.first_shard)


# ---- what a source offers --------------------------------------------------------------------
@dataclass(frozen=True)
class OfferedQuant:
    """One row of what a source offers: a quant with its size, shards and shard 1's file."""

    name: str
    total_bytes: int
    shards: int
    first_file: str  # a catalog row gives its file pattern
    complete: bool = True
    # Where the row came from: the files of a listing or folder, or a catalog quant.
    group: QuantGroup[Any] | None = field(default=None, compare=False, repr=False)
    catalog_quant: CatalogQuant | None = field(default=None, compare=False, repr=False)

    @property
    def quant(self) -> str | None:
        """The canonical label `select_quant` matches (None: a file name without a quant)."""
        if self.group is not None:
            return self.group.quant
        return normalize_quant(self.name)

    def describe(self, note: str = "") -> str:
        """One line for listings and error messages: label, size, shards, `note`, first file."""
        if self.group is not None:
            return self.group.describe(note)
        shards = f"{self.shards} shard{'s' if self.shards != 1 else ''}"
        return f"{self.name:<14} {format_bytes(self.total_bytes):>10}  {shards:<9}{'  ' + note if note else ''}  ({self.first_file})"


@dataclass(frozen=True)
class Offered:
    title: str
    quants: tuple[OfferedQuant, ...]
    source: str  # "catalog", "hub", "saved listing" or "directory"
    listing: RepoListing | None = field(default=None, compare=False, repr=False)  # the hub's, when it was asked


def offered_groups(groups: Sequence[QuantGroup[Any]]) -> tuple[OfferedQuant, ...]:
    return tuple(OfferedQuant(g.label, g.total_bytes, g.shard_count, g.first.path, g.complete, group=g) for g in groups)


def offered_by_catalog(entry: CatalogEntry) -> Offered:
    rows = tuple(OfferedQuant(q.name, q.total_bytes, q.shards, q.files, catalog_quant=q) for q in entry.quants)
    return Offered(f"{entry.id}: {entry.title} ({entry.repo or entry.package})", rows, "catalog")


# ---- the one place a quant is chosen ----------------------------------------------------------
def choose_quant(
    offered: Offered, quant: str | None, where: str, *, pattern: str | None = None, budget: Budget | None = None
) -> OfferedQuant:
    """The row `quant` names (`select_quant`: case-insensitive, `UD-` optional when unambiguous), or
    the only one; a catalog `pattern` picks the files of a curated quant first. The error lists what
    is offered, each row rated against `budget()` when given. An incomplete split is refused."""
    rows = offered.quants
    if pattern is not None and any(r.group is not None for r in rows):
        matching = [r for r in rows if r.group is not None and all(fnmatchcase(f.path, pattern) for f in r.group.files)]
        if len(matching) == 1:
            return _complete(matching[0], where)
        log.warning("%s: the catalog pattern %s matches %d models; selecting by quant name", where, pattern, len(matching))
    try:
        return _complete(select_quant(rows, quant), where)
    except QuantSelectionError as exc:
        raise ModelResolutionError(_selection_message(exc, where, budget)) from exc


def _complete(row: OfferedQuant, where: str) -> OfferedQuant:
    group = row.group
    if group is not None and not group.complete:
        missing = ", ".join(shard_file_name(PurePosixPath(group.base).name, k, group.shard_count) for k in group.missing_shards)
        raise ModelResolutionError(f"{where}: {group.label} is split into {group.shard_count} shards but {missing} is missing")
    return row


def _selection_message(exc: QuantSelectionError, where: str, budget: Budget | None) -> str:
    capacity = budget() if budget is not None and exc.candidates else None
    fit = {True: "fits this machine", False: "too big for this machine"}
    offered = "\n".join(
        f"  {row.describe(fit[row.total_bytes <= capacity] if capacity is not None else '')}" for row in exc.candidates
    )
    if isinstance(exc, QuantRequired):
        return f"{where} offers several quants; choose one with --quant (or {where}:QUANT):\n{offered}"
    if not exc.candidates:
        return f"{where}: no GGUF model files found"
    return f"{where}: {exc}. Offered:\n{offered}"


# ---- fetching -------------------------------------------------------------------------------
@dataclass(frozen=True)
class HubFetch:
    """Where and how a model from the hub (or the catalog) is fetched, and what this machine can hold."""

    download_dir: Path
    access: HubAccess
    progress: bool
    free_bytes: FreeBytes
    budget_of: Budget


def checked(model: ResolvedModel) -> ResolvedModel:
    """`model` with shard 1's header, once the shard set has passed the GGUF header check."""
    try:
        return replace(model, header=check_shard_set(list(model.shards)))
    except GGUFError as exc:
        raise ModelResolutionError(f"{model.label} is not a loadable GGUF: {exc}") from exc


def unverified(shards: Sequence[Path], source: SourceKind, quant: str | None, **more: Any) -> ResolvedModel:
    """Files taken as they are on disk (no reference to check their sha256 against, or a dry run)."""
    return ResolvedModel(
        first_shard=shards[0], shards=tuple(shards), total_bytes=sum(p.stat().st_size for p in shards), source=source,
        sha256s=tuple(None for _ in shards), verified=False, quant=quant or quant_of(shards[0].name), **more,
    )  # fmt: skip


# ---- the interface --------------------------------------------------------------------------
class ModelSource(ABC):
    """A model as `--gguf`/`--demo` name it: a local file or folder, a catalog entry or a hub repo."""

    text: str  # as the operator wrote it, for messages
    quant: str | None  # as asked for (spec suffix or --quant); None: not chosen
    # The catalog entry that curates this model, also when it is asked for by repo id: its
    # model shape sizes the KV cache, and its quants stand in when the hub cannot be asked.
    curated: CatalogEntry | None = None
    local = False  # on this machine already: nothing to download, nothing to rate before
    repo_id: str | None = None  # the hub repo (a catalog entry's too)

    @property
    def entry(self) -> CatalogEntry | None:
        """The catalog entry asked for by its id (not merely curating a repo asked for by id)."""
        return None

    def with_quant(self, quant: str | None) -> ModelSource:
        return replace(self, quant=quant)  # type: ignore[type-var]

    def quant_or_only(self) -> str | None:
        """The asked-for quant, or a catalog entry's only one."""
        entry = self.entry
        if self.quant is None and entry is not None and len(entry.quants) == 1:
            return entry.quants[0].name
        return self.quant

    @abstractmethod
    def offered(self, download_dir: Path, access: HubAccess, *, may_write: bool) -> Offered:
        """The quants on offer, with sizes; fetches no model byte (`may_write`: the hub's listing may be saved)."""

    @abstractmethod
    def on_disk(self, chosen: OfferedQuant, download_dir: Path) -> ResolvedModel | None:
        """The chosen quant as the files on disk have it, not sha256-verified; no network, no writes.
        None when a catalog or hub model is not (completely) downloaded yet."""

    @abstractmethod
    def fetch(self, offered: Offered, chosen: OfferedQuant, hub: HubFetch) -> ResolvedModel:
        """The chosen quant downloaded if needed, and verified where a reference exists."""
