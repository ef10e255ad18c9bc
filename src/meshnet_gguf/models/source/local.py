"""Model sources on this machine already: a `.gguf` file (any shard of a split) and a folder of quants."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from meshnet_gguf.models.download import HubAccess, VerifiedState, load_manifest, verify_file
from meshnet_gguf.models.gguf_names import is_gguf, sibling_shards, split_base
from meshnet_gguf.models.quants import group_quants, quant_of, scan_dir
from meshnet_gguf.models.source.base import (
    HubFetch,
    ModelResolutionError,
    ModelSource,
    Offered,
    OfferedQuant,
    ResolvedModel,
    offered_groups,
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

    def offered(self, download_dir: Path, access: HubAccess, *, may_write: bool) -> Offered:
        shards = self._shards()
        name = quant_of(shards[0].name) or split_base(shards[0].name)
        row = OfferedQuant(name, sum(p.stat().st_size for p in shards), len(shards), shards[0].name)
        return Offered(str(self.path), (row,), "file")

    def on_disk(self, chosen: OfferedQuant, download_dir: Path) -> ResolvedModel:
        shards = self._shards()
        if shards[0] != self.path:
            log.info("%s is one shard of %d; llama-server loads splits from shard 1: %s", self.path.name, len(shards), shards[0].name)
        return unverified(shards, "file", quant=None)

    def fetch(self, offered: Offered, chosen: OfferedQuant, hub: HubFetch) -> ResolvedModel:
        return self.on_disk(chosen, hub.download_dir)


@dataclass(frozen=True)
class FolderSource(ModelSource):
    """A folder holding one or more quants; one we downloaded into is verified against its saved listing."""

    text: str
    quant: str | None
    path: Path
    local = True

    def offered(self, download_dir: Path, access: HubAccess, *, may_write: bool) -> Offered:
        return Offered(str(self.path), offered_groups(group_quants(scan_dir(self.path))), "directory")

    def on_disk(self, chosen: OfferedQuant, download_dir: Path) -> ResolvedModel:
        assert chosen.group is not None
        return unverified([self.path / f.path for f in chosen.group.files], "directory", chosen.group.quant)

    def fetch(self, offered: Offered, chosen: OfferedQuant, hub: HubFetch) -> ResolvedModel:
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
