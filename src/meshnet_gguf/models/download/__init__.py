"""Fetch a quant's files from a Hugging Face hub into the download dir: resumable, verified, original names.

The public surface is this package's; each job is a module of its own:

- `errors`: the exceptions, each message saying what to do;
- `hub_access`: where and how to reach the hub (`HubAccess`), its exceptions in the operator's words;
- `listing`: a repo's files with size and sha256 pinned to one commit, and the copy kept for `--offline`;
- `layout`: the download folder on disk (original names, `.meshnet/`, `.part` files, the lock);
- `verified`: a file checked against the hub's sha256, results remembered by size and mtime;
- `disk_space`: room on the disk, checked before the first byte;
- `transfer`: one file's bytes into its `.part`, resumed with a Range request, hashed as they arrive;
- `fetch`: a quant's files made present and verified (`fetch_files`);
- `packaged`: a model shipped as a Python package (the demo), assembled and verified once.

Invariant: a file under its final name was sha256-verified against the hub when it got that
name. Bytes in flight live in `<name>.part` and are renamed only after their sha256 matches.
"""

from __future__ import annotations

from meshnet_gguf.models.download.disk_space import DISK_FREE_MARGIN_BYTES, FreeBytes, check_free_space, default_free_bytes
from meshnet_gguf.models.download.errors import (
    AccessDenied,
    ChecksumMismatch,
    DownloadError,
    HubUnreachable,
    MissingOffline,
    NotEnoughDiskSpace,
    RepoNotFound,
)
from meshnet_gguf.models.download.fetch import fetch_files
from meshnet_gguf.models.download.hub_access import HubAccess, gated_message
from meshnet_gguf.models.download.layout import META_DIR, PART_SUFFIX, repo_local_dir
from meshnet_gguf.models.download.listing import (
    RemoteFile,
    RepoListing,
    list_repo,
    load_manifest,
    remote_files_for,
    save_manifest,
)
from meshnet_gguf.models.download.packaged import PackagedModel, materialize_package_model
from meshnet_gguf.models.download.transfer import ByteCount
from meshnet_gguf.models.download.verified import VerifiedState, sha256_of, verify_file

__all__ = [
    "DISK_FREE_MARGIN_BYTES",
    "META_DIR",
    "PART_SUFFIX",
    "AccessDenied",
    "ByteCount",
    "ChecksumMismatch",
    "DownloadError",
    "FreeBytes",
    "HubAccess",
    "HubUnreachable",
    "MissingOffline",
    "NotEnoughDiskSpace",
    "PackagedModel",
    "RemoteFile",
    "RepoListing",
    "RepoNotFound",
    "VerifiedState",
    "check_free_space",
    "default_free_bytes",
    "fetch_files",
    "gated_message",
    "list_repo",
    "load_manifest",
    "materialize_package_model",
    "remote_files_for",
    "repo_local_dir",
    "save_manifest",
    "sha256_of",
    "verify_file",
]
