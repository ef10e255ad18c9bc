"""Room on the disk, checked before the first byte so a download never fills it."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.models.download.errors import NotEnoughDiskSpace

# Room left free after the download: a full disk breaks the ledger, logs and the OS in unrelated ways.
DISK_FREE_MARGIN_BYTES = 1 << 30

FreeBytes = Callable[[Path], int]


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
