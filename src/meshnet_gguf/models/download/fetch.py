"""A quant's files made present and verified under the download dir: what is there is checked, the rest fetched.

Invariant: a file under its final name was sha256-verified against the hub when it got that
name. Bytes in flight live in `<name>.part` and are renamed only after their sha256 matches.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from huggingface_hub import hf_hub_url

from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.models.download.disk_space import FreeBytes, check_free_space, default_free_bytes
from meshnet_gguf.models.download.errors import ChecksumMismatch, DownloadError, MissingOffline
from meshnet_gguf.models.download.hub_access import HubAccess, hub_errors
from meshnet_gguf.models.download.layout import exclusive, part_path, repo_local_dir
from meshnet_gguf.models.download.listing import RemoteFile, RepoListing
from meshnet_gguf.models.download.transfer import ByteCount, transfer
from meshnet_gguf.models.download.verified import VerifiedState, verify_file

log = logging.getLogger(__name__)

# One fresh download after a sha256 mismatch; a second mismatch means something between the
# hub and the disk corrupts data, and fetching again would only burn bandwidth.
MAX_VERIFY_ATTEMPTS = 2


def _fetch_verified(
    listing: RepoListing,
    file: RemoteFile,
    final: Path,
    access: HubAccess,
    state: VerifiedState,
    *,
    progress: bool,
    desc: str,
    count: ByteCount,
) -> None:
    part = part_path(final)
    url = hf_hub_url(listing.repo_id, file.path, revision=listing.commit, endpoint=access.endpoint)
    actual = ""
    for attempt in range(1, MAX_VERIFY_ATTEMPTS + 1):
        try:
            with hub_errors(listing.repo_id, access):
                actual = transfer(url, part, file, access.headers(), progress=progress, desc=desc, count=count)
        except OSError as exc:  # disk full, permissions: the partial file stays for the next run
            raise DownloadError(f"writing {part}: {exc}. What was fetched is kept and the next run resumes it.") from exc
        if file.sha256 is None or actual == file.sha256:
            os.replace(part, final)
            state.remember(final, actual)
            return
        part.unlink(missing_ok=True)
        log.error(
            "%s: downloaded sha256 %s does not match the hub's %s (attempt %d of %d); deleted it",
            file.path,
            actual,
            file.sha256,
            attempt,
            MAX_VERIFY_ATTEMPTS,
        )
    raise ChecksumMismatch(
        f"{file.path}: sha256 {actual} after {MAX_VERIFY_ATTEMPTS} downloads does not match the hub's {file.sha256}. "
        "The corrupt copy was deleted and will not be launched. Something between the hub and this disk "
        "(a proxy, a mirror, failing storage) is altering data; check it and run again."
    )


def fetch_files(
    listing: RepoListing,
    files: Sequence[RemoteFile],
    download_dir: Path,
    access: HubAccess,
    *,
    progress: bool = True,
    free_bytes: FreeBytes = default_free_bytes,
    what: str | None = None,
    count: ByteCount | None = None,
) -> list[Path]:
    """Make every file of `files` present and verified under the download dir; return their paths in order.

    Files already verified are kept; a file whose size or sha256 no longer matches
    is fetched again (or, offline, reported). Partial `.part` files are resumed.
    `count`, when given, adds up the bytes received (the node exports them as a metric).
    """
    count = count if count is not None else ByteCount()
    repo_dir = repo_local_dir(download_dir, listing.repo_id)
    what = what or listing.repo_id
    finals = [repo_dir / f.path for f in files]
    with exclusive(repo_dir, what):
        state = VerifiedState(repo_dir)
        todo: list[tuple[RemoteFile, Path]] = []
        for file, final in zip(files, finals):
            if final.exists():
                if verify_file(final, file, state, progress=progress):
                    continue
                log.warning("%s differs from the hub's copy; it will be fetched again", file.path)
                final.unlink()
            todo.append((file, final))
        if not todo:
            return finals
        if access.offline:
            names = ", ".join(f.path for f, _ in todo)
            raise MissingOffline(
                f"offline, and {what} is not complete on disk: missing or unverified {names}. "
                "Run `meshnet-gguf download` for it while online, or drop --offline."
            )
        needed = 0
        for file, final in todo:
            part = part_path(final)
            needed += file.size - (part.stat().st_size if part.exists() else 0)
        check_free_space(repo_dir, needed, free_bytes, what=f"Downloading {what}")
        log.info("downloading %d file(s) of %s (%s to fetch) into %s", len(todo), what, format_bytes(needed), repo_dir)
        for i, (file, final) in enumerate(todo, start=1):
            final.parent.mkdir(parents=True, exist_ok=True)
            desc = f"[{i}/{len(todo)}] {final.name}"
            _fetch_verified(listing, file, final, access, state, progress=progress, desc=desc, count=count)
    return finals
