"""Writing a file so that no reader, and no crash, ever sees half of it: the one way the node does it.

The content goes to a private temporary file beside the target (same folder, so
the same filesystem), created with its final mode before any byte is in it,
flushed to disk, and then renamed over the target in one step (or, with
`exclusive`, linked into place so that a file already there wins). A writer that
needs a file name of its own (the GGUF writer, a package's assembler) gets one
from `replaced_on_success`.

Resumable downloads are the one exception, on purpose: their `.part` files must
survive a crash to be resumed, and `download` renames them only once their
sha256 matches.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

TEMP_SUFFIX = ".tmp"
DEFAULT_FILE_MODE = 0o644


def temp_path(path: Path) -> Path:
    """A hidden name beside `path`, unique to this process: `.name.PID.tmp`."""
    return path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")


def write_atomically(path: Path, content: bytes | str, *, mode: int = DEFAULT_FILE_MODE, exclusive: bool = False) -> bool:
    """Write `content` (str as UTF-8) to `path` in one step; returns False only when `exclusive`
    and a file was already there (it is kept: two processes creating one key end up sharing it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode("utf-8") if isinstance(content, str) else content
    partial = temp_path(path)
    partial.unlink(missing_ok=True)  # left by a crashed run of a process with the same pid
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(partial, mode)  # the umask may have narrowed what os.open was given
        if not exclusive:
            os.replace(partial, path)
            return True
        try:
            os.link(partial, path)
        except FileExistsError:
            return False
        return True
    finally:
        partial.unlink(missing_ok=True)


@contextlib.contextmanager
def replaced_on_success(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write to; when the block ends without an exception the
    file is synced and replaces `path`, otherwise it is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = temp_path(path)
    partial.unlink(missing_ok=True)
    try:
        yield partial
        fd = os.open(partial, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
