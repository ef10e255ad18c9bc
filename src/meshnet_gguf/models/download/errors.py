"""What can go wrong fetching a model; every message says what to do about it.

DownloadError            a model could not be fetched or verified
├── HubUnreachable       the hub cannot be reached, or a transfer stalled
├── RepoNotFound         no such repo or revision on the hub
├── AccessDenied         a gated or private repo without (sufficient) credentials
├── NotEnoughDiskSpace   the files will not fit (with the figures)
├── ChecksumMismatch     the bytes fetched are not the hub's
└── MissingOffline       `--offline` and the files are not (all) on disk
"""

from __future__ import annotations

from pathlib import Path


class DownloadError(RuntimeError):
    """A model could not be fetched or verified; the message says what to do."""


class HubUnreachable(DownloadError):
    pass


class RepoNotFound(DownloadError):
    pass


class AccessDenied(DownloadError):
    """Gated or private repo without (sufficient) credentials."""


class NotEnoughDiskSpace(DownloadError):
    def __init__(self, message: str, *, needed_bytes: int, free_bytes: int, directory: Path) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        self.directory = directory


class ChecksumMismatch(DownloadError):
    pass


class MissingOffline(DownloadError):
    """`--offline` and the files are not (all) on disk."""
