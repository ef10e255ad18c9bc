"""The download folder on disk: a repo's files under their own names, `.meshnet/` beside them, one lock.

`DOWNLOAD_DIR/<owner>/<name>/<path in repo>`, exactly as the repo names its files, because
llama.cpp loads a split model from shard 1 and finds the other shards by name (cache blobs
named by hash would break that). Beside them, `.meshnet/` keeps the last listing
(`manifest.json`, for `--offline`), the remembered sha256 results (`verified.json`) and a lock.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import filelock

from meshnet_gguf.common.atomic_file import write_atomically
from meshnet_gguf.models.download.errors import DownloadError

log = logging.getLogger(__name__)

META_DIR = ".meshnet"
MANIFEST_FILE = "manifest.json"
VERIFIED_FILE = "verified.json"
LOCK_FILE = "download.lock"
PART_SUFFIX = ".part"
# A second downloader of the same repo waits this long in silence before saying it waits.
LOCK_NOTICE_AFTER_S = 2.0


def repo_local_dir(download_dir: Path, repo_id: str) -> Path:
    return Path(download_dir).expanduser().absolute() / repo_id


def part_path(final: Path) -> Path:
    """Where the bytes of `final` live until their sha256 matches: `<name>.part` beside it."""
    return final.with_name(final.name + PART_SUFFIX)


def write_json_atomically(path: Path, data: Any) -> None:
    write_atomically(path, json.dumps(data, indent=1, sort_keys=True))


@contextmanager
def exclusive(directory: Path, what: str) -> Iterator[None]:
    """One downloader per repo folder across processes (a second `download` or `serve` waits)."""
    try:
        (directory / META_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DownloadError(
            f"cannot write into the download folder {directory}: {exc.strerror or exc}. "
            "Pick a writable one with --download-dir (or MESHNET_DOWNLOAD_DIR)."
        ) from exc
    lock = filelock.FileLock(str(directory / META_DIR / LOCK_FILE))
    try:
        lock.acquire(timeout=LOCK_NOTICE_AFTER_S)
    except filelock.Timeout:
        log.info("another process is downloading %s into %s; waiting for it", what, directory)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
