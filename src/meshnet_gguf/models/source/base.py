"""What every kind of model source answers, and a quant chosen from what it offers (refusals worded here).

A source (`ModelSource`) is what `--gguf`/`--demo` names: a local file, a local
folder, a catalog entry or a hub repo. Each answers three questions the same way, each
with one call that returns a value the caller reads as plain fields:

- `offered`: an `Offer`: the quants it offers, with sizes (no model byte fetched), and the
  row its quant names (or the refusal that says why none);
- `on_disk`: an `OnDisk`: the chosen quant's files as they are on disk already, header-checked
  (no network, no writes), or, not downloaded yet, the catalog's row it will be planned from;
- `fetch`: the chosen quant downloaded if needed, verified and header-checked.

`quants.pick_group` (through `quants.sort_quants`) and `choose_quant` pick one row of what a
source offers, and `choose_quant` words every refusal; every caller (serve, its dry run,
`doctor`, `download`) goes through them. `checked` is the header check every returned
model has passed: nothing that failed a check is ever returned.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.models.catalog import CatalogEntry, CatalogQuant
from meshnet_gguf.models.download import FreeBytes, HubAccess, RepoListing, repo_local_dir
from meshnet_gguf.models.gguf_info import GGUFError, GGUFInfo, check_shard_set
from meshnet_gguf.models.gguf_names import shard_file_name, split_base
from meshnet_gguf.models.quants import QuantGroup, QuantRequired, QuantSelectionError, QuantSort, pick_group, select_quant

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
    # Worked out once here (fields, not properties: the pipeline reads them without calling in).
    # A short model name for `--alias`/announcements: the shared file stem (`Model-UD-IQ3_XXS`).
    name: str = field(init=False, compare=False, repr=False)
    label: str = field(init=False, compare=False, repr=False)  # catalog id or repo id with its quant, else the path

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", split_base(self.first_shard.name))
        object.__setattr__(self, "label", self._label())

    def _label(self) -> str:
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
    quant: str | None = None  # the canonical label `select_quant` matches (None: a file name without a quant)
    # Where the row came from: the files of a listing or folder, or a catalog quant.
    group: QuantGroup[Any] | None = field(default=None, compare=False, repr=False)
    catalog_quant: CatalogQuant | None = field(default=None, compare=False, repr=False)

    def describe(self, note: str = "") -> str:
        """One line for listings and error messages: label, size, shards, `note`, first file."""
        if self.group is not None:
            return self.group.describe(note)
        shards = f"{self.shards} shard{'s' if self.shards != 1 else ''}"
        return f"{self.name:<14} {format_bytes(self.total_bytes):>10}  {shards:<9}{'  ' + note if note else ''}  ({self.first_file})"


@dataclass(frozen=True)
class Offer:
    """What a source offers and the row its quant names: step 4's whole answer from one call, read as fields."""

    title: str
    quants: tuple[OfferedQuant, ...]
    source: str  # where the rows come from: "catalog", "hub", "saved listing", "directory" or "file"
    listing: RepoListing | None = field(default=None, compare=False, repr=False)  # the hub's, when it was asked
    chosen: OfferedQuant | None = None  # the row the source's quant names, or its only one
    # Why no row is chosen (its `__cause__` the `QuantSelectionError`, if a selection failed).
    refusal: ModelResolutionError | None = field(default=None, compare=False, repr=False)


def offer_of_files(
    title: str, sort: QuantSort[Any], source: str, where: str, *, budget: Budget | None = None, listing: RepoListing | None = None
) -> Offer:
    """The rows of a listing or folder that `quants.sort_quants` grouped, with the group it chose as `chosen`."""
    rows = tuple(OfferedQuant(g.label, g.total_bytes, g.shard_count, g.first.path, g.complete, quant=g.quant, group=g) for g in sort.groups)
    if sort.chosen is None:
        assert sort.refused is not None, "quants.sort_quants chooses a group or says why not"
        return Offer(title, rows, source, listing, refusal=_refused(sort.refused, where, budget))
    try:
        chosen = _complete(next(r for r in rows if r.group is sort.chosen), where)  # `is`: the row of that very group
    except ModelResolutionError as exc:
        return Offer(title, rows, source, listing, refusal=exc)
    return Offer(title, rows, source, listing, chosen)


def offered_by_catalog(entry: CatalogEntry, quant: str | None = None, where: str | None = None, *, budget: Budget | None = None) -> Offer:
    """A catalog entry's quants (its names are canonical already: the catalog normalises them), and the one `quant` names."""
    rows = tuple(OfferedQuant(q.name, q.total_bytes, q.shards, q.files, quant=q.name, catalog_quant=q) for q in entry.quants)
    title = f"{entry.id}: {entry.title} ({entry.repo or entry.package})"
    try:
        return Offer(title, rows, "catalog", chosen=choose_quant(rows, quant, where or entry.id, budget=budget))
    except ModelResolutionError as exc:
        return Offer(title, rows, "catalog", refusal=exc)


@dataclass(frozen=True)
class OnDisk:
    """Step 5 of a dry run from one call: the chosen quant's files as the disk has them (header-checked,
    not re-hashed), or, not downloaded yet, the catalog's row and where its shard 1 will land."""

    model: ResolvedModel | None
    quant: str | None  # the quant looked for: the chosen row's, else the asked-for one (or a catalog entry's only one)
    catalog_quant: CatalogQuant | None = None  # not downloaded: the curating entry's row, the plan's figures
    first_shard: Path | None = None  # not downloaded: where `catalog_quant`'s shard 1 will land


# ---- the one place a quant is chosen ----------------------------------------------------------
def choose_quant(
    rows: Sequence[OfferedQuant], quant: str | None, where: str, *, pattern: str | None = None, budget: Budget | None = None
) -> OfferedQuant:
    """The row `quant` names (`select_quant`: case-insensitive, `UD-` optional when unambiguous), or
    the only one; a catalog `pattern` picks the files of a curated quant first (`pick_group`). The error
    lists what is offered, each row rated against `budget()` when given. An incomplete split is refused."""
    groups = [r.group for r in rows if r.group is not None]
    try:
        if groups:
            picked = pick_group(groups, quant, pattern, where)
            return _complete(next(r for r in rows if r.group is picked), where)
        return _complete(select_quant(rows, quant), where)
    except QuantSelectionError as exc:
        raise _refused(exc, where, budget) from exc


def _refused(exc: QuantSelectionError, where: str, budget: Budget | None) -> ModelResolutionError:
    refusal = ModelResolutionError(_selection_message(exc, where, budget))
    refusal.__cause__ = exc  # what `raise ... from exc` sets, for a refusal an `Offer` carries unraised
    return refusal


def _complete(row: OfferedQuant, where: str) -> OfferedQuant:
    group = row.group
    if group is not None and not group.complete:
        missing = ", ".join(shard_file_name(PurePosixPath(group.base).name, k, group.shard_count) for k in group.missing_shards)
        raise ModelResolutionError(f"{where}: {group.label} is split into {group.shard_count} shards but {missing} is missing")
    return row


def _selection_message(exc: QuantSelectionError, where: str, budget: Budget | None) -> str:
    capacity = budget() if budget is not None and exc.candidates else None
    fit = {True: "fits this machine", False: "too big for this machine"}
    offered = "\n".join(f"  {row.describe(fit[row.total_bytes <= capacity] if capacity is not None else '')}" for row in exc.candidates)
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
    """Files taken as they are on disk (no reference to check their sha256 against, or a dry run);
    `quant` as the offered row has it (None: a file name without a quant)."""
    return ResolvedModel(
        first_shard=shards[0], shards=tuple(shards), total_bytes=sum(p.stat().st_size for p in shards), source=source,
        sha256s=tuple(None for _ in shards), verified=False, quant=quant, **more,
    )  # fmt: skip


def expected_first_shard(entry: CatalogEntry, quant: CatalogQuant, download_dir: Path) -> Path:
    """Where shard 1 of a catalog quant lands once downloaded (or assembled, for a packaged model)."""
    base = Path(download_dir).expanduser().absolute()
    if entry.package is not None:
        return base / entry.id / quant.first_file
    assert entry.repo is not None
    return repo_local_dir(base, entry.repo) / quant.first_file


# ---- the interface --------------------------------------------------------------------------
class ModelSource(ABC):
    """A model as `--gguf`/`--demo` name it: a local file or folder, a catalog entry or a hub repo.

    What the pipeline reads of it are plain fields (set when `pick_source` makes it); what it
    asks are the three questions, one call each.
    """

    text: str  # as the operator wrote it, for messages
    quant: str | None  # as asked for (spec suffix or --quant); None: not chosen
    # The catalog entry that curates this model, also when it is asked for by repo id: its
    # model shape sizes the KV cache, and its quants stand in when the hub cannot be asked.
    curated: CatalogEntry | None = None
    entry: CatalogEntry | None = None  # the catalog entry asked for by its id (not merely curating a repo asked for by id)
    local = False  # on this machine already: nothing to download, nothing to rate before
    repo_id: str | None = None  # the hub repo (a catalog entry's too)

    def quant_or_only(self) -> str | None:
        """The asked-for quant, or a catalog entry's only one."""
        entry = self.entry
        if self.quant is None and entry is not None and len(entry.quants) == 1:
            return entry.quants[0].name
        return self.quant

    @abstractmethod
    def offered(self, download_dir: Path, access: HubAccess, *, may_write: bool, budget: Budget | None = None) -> Offer:
        """The quants on offer, with sizes, and the one `quant` names; fetches no model byte (`may_write`: the
        hub's listing may be saved). A refusal lists the rows, rated against `budget()` when given."""

    def on_disk(self, chosen: OfferedQuant | None, download_dir: Path) -> OnDisk:
        """The chosen quant as the files on disk have it, header-checked but not sha256-verified; no network,
        no writes. Not (completely) downloaded, or nothing chosen (the source could not be listed): the
        curating catalog entry's row for the quant, and where its shard 1 will land, when there is one."""
        found = self._found(chosen, download_dir) if chosen is not None else None
        if found is not None:
            return OnDisk(checked(found), found.quant)
        quant = chosen.name if chosen is not None else self.quant_or_only()
        curated = self.curated.quant(quant) if self.curated is not None and quant else None
        if self.curated is None or curated is None:
            return OnDisk(None, quant)
        return OnDisk(None, quant, curated, expected_first_shard(self.curated, curated, download_dir))

    def fetch(self, offer: Offer, chosen: OfferedQuant, hub: HubFetch) -> ResolvedModel:
        """The chosen quant downloaded if needed, verified where a reference exists, and header-checked."""
        return checked(self._fetched(offer, chosen, hub))

    @abstractmethod
    def _found(self, chosen: OfferedQuant, download_dir: Path) -> ResolvedModel | None:
        """The chosen quant's files on disk, unchecked; None when a catalog or hub model is not (completely) downloaded yet."""

    @abstractmethod
    def _fetched(self, offer: Offer, chosen: OfferedQuant, hub: HubFetch) -> ResolvedModel:
        """The chosen quant downloaded if needed, and verified where a reference exists (not yet header-checked)."""
