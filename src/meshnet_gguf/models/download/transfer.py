"""One file's bytes from the hub into its `.part` file: resumed with a Range request, hashed as they arrive.

Why not `hf_hub_download(local_dir=...)`: huggingface_hub 2.4 downloads each
attempt into a process-unique `*.incomplete` file and deletes it on failure
(its PR 4228), so a download killed halfway starts over from zero; for a 50 GB
shard on a home link that matters. We keep our own `.part` file and resume it
with an HTTP Range request, still going through huggingface_hub for everything
else: the listing API (sizes and LFS sha256 before any byte), the file URL
(`hf_hub_url`), auth headers (`build_hf_headers`), its HTTP session (proxies,
redirects to the CDN) and its error mapping (`hf_raise_for_status`).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx2
from huggingface_hub.utils import get_session, hf_raise_for_status

from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.models.download.errors import DownloadError, HubUnreachable
from meshnet_gguf.models.download.listing import RemoteFile
from meshnet_gguf.models.download.progress import progress_bar
from meshnet_gguf.models.download.verified import sha256_of

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 15.0
# A stream silent this long is cut and resumed with a Range request rather than waited on forever.
READ_TIMEOUT_S = 60.0
# Consecutive attempts that moved no byte before giving up; any progress resets the count,
# so a flaky link that keeps delivering is never abandoned.
MAX_FRUITLESS_ATTEMPTS = 5
RETRY_BACKOFF_INITIAL_S = 1.0
RETRY_BACKOFF_MAX_S = 30.0
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# With no progress bar (not a TTY: systemd, docker logs) a line this often keeps long downloads visible.
PROGRESS_LOG_INTERVAL_S = 30.0


class _RetryableTransfer(Exception):
    pass


def _content_range_start(header: str | None, expected_total: int) -> int | None:
    """Start offset of `bytes START-END/TOTAL`, None when absent or for another total size."""
    if not header or not header.startswith("bytes "):
        return None
    span, _, total = header[len("bytes ") :].partition("/")
    if total.strip() != str(expected_total):
        return None
    start, _, _ = span.partition("-")
    return int(start) if start.isdigit() else None


def _continues_from(offset: int, response: httpx2.Response, expected: RemoteFile) -> bool:
    """Whether an answer to `Range: bytes=OFFSET-` continues the file there: False when the server sent the
    whole file instead (200); a range that starts elsewhere is an error."""
    if response.status_code == 200:
        log.warning("%s: the server ignored the Range request; starting this file over", expected.path)
        return False
    if _content_range_start(response.headers.get("Content-Range"), expected.size) != offset:
        raise DownloadError(
            f"{expected.path}: asked for bytes from {offset} but the server sent "
            f"{response.headers.get('Content-Range')!r}; the file on the hub may have changed"
        )
    return True


def _write_all(out: BinaryIO, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = out.write(view)
        if not written:
            raise OSError(errno.EIO, "write made no progress")
        view = view[written:]


@dataclass
class ByteCount:
    """Bytes received from the hub, counted as they arrive (retries and refetches included)."""

    received: int = 0


def transfer(url: str, part: Path, expected: RemoteFile, headers: dict[str, str], *, progress: bool, desc: str, count: ByteCount) -> str:
    """Bring `part` to `expected.size` bytes, resuming from what is already there; return its sha256.

    The sha256 is computed as bytes arrive (after hashing any prefix already on
    disk once), so a finished shard is never read back in full.
    """
    part.parent.mkdir(parents=True, exist_ok=True)
    offset = part.stat().st_size if part.exists() else 0
    if offset > expected.size:
        log.warning("%s: partial file is larger than the hub's copy; starting over", part.name)
        part.unlink()
        offset = 0
    digest = hashlib.sha256()
    if offset:
        log.info("resuming %s at %s of %s", expected.path, format_bytes(offset), format_bytes(expected.size))
        sha256_of(part, progress=progress, limit=offset, digest=digest)

    fruitless = 0
    backoff = RETRY_BACKOFF_INITIAL_S
    started = time.monotonic()
    fetched = 0
    next_log = started + PROGRESS_LOG_INTERVAL_S
    timeout = httpx2.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    with progress_bar(total=expected.size, initial=offset, desc=desc, enabled=progress) as bar:
        while offset < expected.size:
            request_headers = dict(headers)
            if offset:
                request_headers["Range"] = f"bytes={offset}-"
            moved = 0
            try:
                with get_session().stream("GET", url, headers=request_headers, timeout=timeout, follow_redirects=True) as response:
                    if response.status_code in RETRYABLE_STATUS:
                        raise _RetryableTransfer(f"HTTP {response.status_code}")
                    if response.status_code >= 400:
                        response.read()
                    hf_raise_for_status(response)
                    if offset and not _continues_from(offset, response, expected):
                        part.unlink(missing_ok=True)
                        offset = 0
                        digest = hashlib.sha256()
                        bar.reset(total=expected.size)
                    # Unbuffered: what reached write() is on disk even if this process is killed next.
                    with part.open("ab", buffering=0) as out:
                        for chunk in response.iter_bytes():
                            if offset + len(chunk) > expected.size:
                                raise DownloadError(f"{expected.path}: the server sent more than the {expected.size} bytes listed")
                            _write_all(out, chunk)
                            digest.update(chunk)
                            offset += len(chunk)
                            moved += len(chunk)
                            count.received += len(chunk)
                            bar.update(len(chunk))
                            if bar.disable and time.monotonic() >= next_log:
                                next_log = time.monotonic() + PROGRESS_LOG_INTERVAL_S
                                log.info("%s: %s of %s", expected.path, format_bytes(offset), format_bytes(expected.size))
                if offset < expected.size:
                    raise _RetryableTransfer(f"stream ended at {offset} of {expected.size} bytes")
            except (httpx2.TransportError, _RetryableTransfer) as exc:
                fetched += moved
                fruitless = 0 if moved else fruitless + 1
                if fruitless >= MAX_FRUITLESS_ATTEMPTS:
                    raise HubUnreachable(
                        f"{expected.path}: download stalled ({exc}); {format_bytes(offset)} of "
                        f"{format_bytes(expected.size)} kept in {part.name}, and the next run resumes from there"
                    ) from exc
                if moved:
                    backoff = RETRY_BACKOFF_INITIAL_S
                log.warning("%s: %s; retrying in %.0f s from byte %d", expected.path, exc, backoff, offset)
                time.sleep(backoff)
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)
                continue
            fetched += moved
    elapsed = max(time.monotonic() - started, 1e-6)
    log.info("%s: fetched %s in %.1f s (%s/s)", expected.path, format_bytes(fetched), elapsed, format_bytes(int(fetched / elapsed)))
    return digest.hexdigest()
