"""Model sources on this machine already: a `.gguf` file (any shard of a split) and a folder of quants."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from meshnet_gguf.models.download import HubAccess, VerifiedState, load_manifest, verify_file
from meshnet_gguf.models.gguf_names import is_gguf, sibling_shards, split_base
from meshnet_gguf.models.quants import quant_of, sort_folder
from meshnet_gguf.models.source.base import (
    Budget,
    HubFetch,
    ModelResolutionError,
    ModelSource,
    Offer,
    OfferedQuant,
    ResolvedModel,
    offer_of_files,
    unverified,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileSource(ModelSource):
    """A `.gguf` file: the one quant it offers is itself, with its sibling shards."""

    text: str
    quant: str | None
    path: Path
    local = True

    def _shards(self) -> list[Path]:
        if not is_gguf(self.path.name):
            raise ModelResolutionError(f"--gguf {self.path}: not a .gguf file")
        shards = sibling_shards(self.path)
        missing = [p.name for p in shards if not p.is_file()]
        if missing:
            raise ModelResolutionError(
                f"--gguf {self.path}: a split model of {len(shards)} shards, but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} missing next to it"
            )
        return shards

    def offered(self, download_dir: Path, access: HubAccess, *, may_write: bool, budget: Budget | None = None) -> Offer:
        """The file's one row, chosen: there is nothing to choose between."""
        shards = self._shards()
        quant = quant_of(shards[0].name)
        row = OfferedQuant(
            quant or split_base(shards[0].name), sum(p.stat().st_size for p in shards), len(shards), shards[0].name, quant=quant
        )
        return Offer(str(self.path), (row,), "file", chosen=row)

    def _found(self, chosen: OfferedQuant, download_dir: Path) -> ResolvedModel:
        shards = self._shards()
        if shards[0] != self.path:
            log.info("%s is one shard of %d; llama-server loads splits from shard 1: %s", self.path.name, len(shards), shards[0].name)
        return unverified(shards, "file", chosen.quant)

    def _fetched(self, offer: Offer, chosen: OfferedQuant, hub: HubFetch) -> ResolvedModel:
        return self._found(chosen, hub.download_dir)


@dataclass(frozen=True)
class FolderSource(ModelSource):
    """A folder holding one or more quants; one we downloaded into is verified against its saved listing."""

    text: str
    quant: str | None
    path: Path
    local = True

    def offered(self, download_dir: Path, access: HubAccess, *, may_write: bool, budget: Budget | None = None) -> Offer:
        return offer_of_files(str(self.path), sort_folder(self.path, self.quant), "directory", self.text, budget=budget)

    def _found(self, chosen: OfferedQuant, download_dir: Path) -> ResolvedModel:
        assert chosen.group is not None
        return unverified([self.path / f.path for f in chosen.group.files], "directory", chosen.group.quant)

    def _fetched(self, offer: Offer, chosen: OfferedQuant, hub: HubFetch) -> ResolvedModel:
        return verified_folder(self.path, chosen, progress=hub.progress)


def verified_folder(directory: Path, chosen: OfferedQuant, *, progress: bool) -> ResolvedModel:
    """The chosen quant of a folder, checked against the hub's listing when we downloaded into it."""
    group = chosen.group
    assert group is not None
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
    return unverified(shards, "directory", group.quant)
