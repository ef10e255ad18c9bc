"""A file checked against the hub's size and sha256, and the results remembered so a restart does not re-hash 100 GB.

A remembered result is trusted only while the file's size and mtime are unchanged, so a touched
file is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.models.download.layout import META_DIR, VERIFIED_FILE, write_json_atomically
from meshnet_gguf.models.download.listing import RemoteFile
from meshnet_gguf.models.download.progress import progress_bar

log = logging.getLogger(__name__)

HASH_BLOCK_BYTES = 8 << 20


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
        write_json_atomically(self._path, self._entries)

    def forget(self, file: Path) -> None:
        if self._entries.pop(self._key(file), None) is not None:
            write_json_atomically(self._path, self._entries)


def sha256_of(path: Path, *, progress: bool = False, limit: int | None = None, digest: Any = None) -> Any:
    """Hash a file (or its first `limit` bytes) into `digest` (a fresh sha256 by default) and return the digest."""
    digest = digest if digest is not None else hashlib.sha256()
    total = Path(path).stat().st_size if limit is None else limit
    with Path(path).open("rb") as fh, progress_bar(total=total, initial=0, desc=f"sha256 {Path(path).name}", enabled=progress) as bar:
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
