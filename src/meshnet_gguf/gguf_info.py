"""Read what the node needs from a GGUF file's header and metadata (via the `gguf` package).

Only the header and metadata are parsed (the reader memory-maps the file, so a
50 GB shard costs no reading of its tensors). Used for the pre-launch header
check, the launch plan's memory estimate and the tracker announcement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)


class GGUFError(ValueError):
    """The file is not a GGUF llama.cpp can load, or the shard set is inconsistent."""


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    version: int
    architecture: str
    name: str | None
    block_count: int | None
    context_length: int | None
    embedding_length: int | None
    head_count: int | None
    # Per-layer lists are collapsed to their maximum: it bounds the KV cache from above.
    head_count_kv: int | None
    key_length: int | None
    value_length: int | None
    file_type: int | None
    split_index: int
    split_count: int
    tensor_count: int
    file_bytes: int
    metadata: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def head_dim_k(self) -> int | None:
        if self.key_length:
            return self.key_length
        if self.embedding_length and self.head_count:
            return self.embedding_length // self.head_count
        return None

    @property
    def head_dim_v(self) -> int | None:
        return self.value_length or self.head_dim_k


def _scalar(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    # Arrays of numbers (e.g. per-layer head_count_kv) are reduced by the caller.
    return f.contents()


def _as_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, list):
        return max((int(v) for v in value), default=None)
    return int(value)


def read_gguf_info(path: Path) -> GGUFInfo:
    """Parse one GGUF file's header. Raises `GGUFError` with the file's name on anything wrong."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # the reader raises bare ValueError/struct errors on truncation
        raise GGUFError(f"{path}: unreadable GGUF header ({exc}); the file is probably truncated") from exc

    version = _as_int(_scalar(reader, "GGUF.version")) or 0
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"{path}: GGUF version {version} is not supported (expected one of {SUPPORTED_VERSIONS})")
    arch = _scalar(reader, "general.architecture") or "unknown"

    def arch_int(suffix: str) -> int | None:
        return _as_int(_scalar(reader, f"{arch}.{suffix}"))

    scalar_keys = {k: _scalar(reader, k) for k, f in reader.fields.items() if len(f.types) == 1 and not k.startswith("GGUF.")}
    split_count = _as_int(_scalar(reader, "split.count")) or 1
    return GGUFInfo(
        path=path,
        version=version,
        architecture=str(arch),
        name=_scalar(reader, "general.name"),
        block_count=arch_int("block_count"),
        context_length=arch_int("context_length"),
        embedding_length=arch_int("embedding_length"),
        head_count=arch_int("attention.head_count"),
        head_count_kv=arch_int("attention.head_count_kv"),
        key_length=arch_int("attention.key_length"),
        value_length=arch_int("attention.value_length"),
        file_type=_as_int(_scalar(reader, "general.file_type")),
        split_index=_as_int(_scalar(reader, "split.no")) or 0,
        split_count=split_count,
        tensor_count=len(reader.tensors),
        file_bytes=path.stat().st_size,
        metadata=scalar_keys,
    )


def check_shard_set(shards: list[Path]) -> GGUFInfo:
    """Check every shard's header and that they form one complete split; return shard 1's info.

    llama.cpp loads a split model from shard 1 and finds the others by name, so
    a missing, truncated or foreign shard would fail late (or worse, mid-load).
    """
    if not shards:
        raise GGUFError("no GGUF files given")
    infos = [read_gguf_info(p) for p in shards]
    first = min(infos, key=lambda i: i.split_index)
    expected = first.split_count
    if len(infos) != expected:
        raise GGUFError(f"{first.path.name}: the model has {expected} shards but {len(infos)} were found")
    indices = sorted(i.split_index for i in infos)
    if indices != list(range(expected)):
        raise GGUFError(f"{first.path.name}: shard numbers {[i + 1 for i in indices]} do not form 1..{expected}")
    for info in infos:
        if info.split_count != expected:
            raise GGUFError(f"{info.path.name}: says it is one of {info.split_count} shards, shard 1 says {expected}")
    return first


def total_bytes(shards: list[Path]) -> int:
    return sum(Path(p).stat().st_size for p in shards)
