"""A repo's files as the hub lists them (size and LFS sha256, pinned to one commit), and the copy kept for `--offline`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from huggingface_hub.hf_api import RepoFile

from meshnet_gguf.models.download.errors import MissingOffline
from meshnet_gguf.models.download.hub_access import HubAccess, hub_errors
from meshnet_gguf.models.download.layout import MANIFEST_FILE, META_DIR, repo_local_dir, write_json_atomically

DEFAULT_REVISION = "main"
LISTING_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # LFS files carry one; small git files do not (checked by size only)


@dataclass(frozen=True)
class RepoListing:
    repo_id: str
    commit: str
    gated: bool
    files: tuple[RemoteFile, ...]

    def to_json(self) -> dict[str, Any]:
        return {"repo_id": self.repo_id, "commit": self.commit, "gated": self.gated, "files": [asdict(f) for f in self.files]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RepoListing:
        files = tuple(RemoteFile(str(f["path"]), int(f["size"]), f.get("sha256")) for f in data["files"])
        return cls(str(data["repo_id"]), str(data["commit"]), bool(data.get("gated")), files)


def list_repo(repo_id: str, access: HubAccess, *, revision: str = DEFAULT_REVISION) -> RepoListing:
    """Every file of the repo with its size and LFS sha256, pinned to one commit. Fetches no file bytes."""
    if access.offline:
        raise MissingOffline(f"offline: cannot list {repo_id} on the hub")
    api = access.api()
    with hub_errors(repo_id, access):
        info = api.model_info(repo_id, revision=revision, timeout=LISTING_TIMEOUT_S)
        commit = info.sha or revision
        entries = api.list_repo_tree(repo_id, recursive=True, revision=commit)
        files = tuple(
            RemoteFile(e.path, int(e.size), e.lfs.sha256 if e.lfs is not None else None) for e in entries if isinstance(e, RepoFile)
        )
    return RepoListing(repo_id=repo_id, commit=commit, gated=bool(info.gated), files=files)


def remote_files_for(listing: RepoListing, paths: Iterable[str]) -> list[RemoteFile]:
    by_path = {f.path: f for f in listing.files}
    return [by_path[p] for p in paths]


def save_manifest(download_dir: Path, listing: RepoListing) -> None:
    write_json_atomically(repo_local_dir(download_dir, listing.repo_id) / META_DIR / MANIFEST_FILE, listing.to_json())


def load_manifest(repo_dir: Path) -> RepoListing | None:
    """The listing saved by the last online run for the repo downloaded into `repo_dir`."""
    try:
        return RepoListing.from_json(json.loads((repo_dir / META_DIR / MANIFEST_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
