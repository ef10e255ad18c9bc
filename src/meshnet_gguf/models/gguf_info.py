"""Read what the node needs from a GGUF file's header and metadata.

Only the header and the key/value section are read (memory-mapped, so a 50 GB
shard costs no reading of its tensors). Used for the pre-launch header
check, the launch plan's memory estimate and the tracker announcement.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32  # GGUF's default when general.alignment is absent


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
    # The ggml types (`gguf.GGMLQuantizationType` values) of this file's tensors: which kernels it runs.
    tensor_types: frozenset[int] = frozenset()
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


# Arrays longer than this (vocabularies, merges) are skipped, not decoded: decoding a
# 262k-token vocabulary with gguf.GGUFReader takes 10-15 s, skipping it ~0.1 s.
MAX_DECODED_ARRAY = 4096
_SCALAR_FORMATS: dict[int, str] = {
    gguf.GGUFValueType.UINT8: "B",
    gguf.GGUFValueType.INT8: "b",
    gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h",
    gguf.GGUFValueType.UINT32: "I",
    gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f",
    gguf.GGUFValueType.BOOL: "?",
    gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q",
    gguf.GGUFValueType.FLOAT64: "d",
}


class _MetadataReader:
    """Reads the GGUF key/value section only (layout per the gguf package's GGUFValueType).

    gguf.GGUFReader parses every field and tensor into numpy views, which costs
    seconds on big vocabularies; the node needs a dozen scalars, so it walks the
    section itself and skips long arrays by their length prefixes.
    """

    def __init__(self, data: mmap.mmap | bytes, order: str) -> None:
        self.data = data
        self.order = order
        self.pos = 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(self.order + fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("Q")
        raw = self.data[self.pos : self.pos + length]
        if len(raw) != length:
            raise GGUFError("string runs past the end of the file")
        self.pos += length
        return bytes(raw).decode("utf-8", "replace")

    def value(self, vtype: int) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return self.string()
        if vtype == gguf.GGUFValueType.ARRAY:
            item_type = self.take("I")
            count = self.take("Q")
            if count <= MAX_DECODED_ARRAY:
                return [self.value(item_type) for _ in range(count)]
            if item_type == gguf.GGUFValueType.STRING:
                for _ in range(count):
                    self.pos += 8 + struct.unpack_from(self.order + "Q", self.data, self.pos)[0]
            elif item_type in _SCALAR_FORMATS:
                self.pos += count * struct.calcsize(_SCALAR_FORMATS[item_type])
            else:
                raise GGUFError(f"array of type {item_type} cannot be skipped")
            return None
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise GGUFError(f"unknown metadata value type {vtype}")
        return self.take(fmt)


def _tensor_data_end(reader: _MetadataReader, tensor_count: int, alignment: int) -> tuple[int, frozenset[int]]:
    """Where the last tensor's bytes end, and the tensors' types, from the tensor infos that follow the metadata."""
    data_end = 0
    types: set[int] = set()
    for _ in range(tensor_count):
        reader.string()  # name
        dims = [reader.take("Q") for _ in range(reader.take("I"))]
        ggml_type = reader.take("I")
        offset = reader.take("Q")
        try:
            block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise GGUFError(f"unknown tensor type {ggml_type}; a newer llama.cpp may know it") from None
        elements = math.prod(dims)
        data_end = max(data_end, offset + elements // block_size * type_size)
        types.add(ggml_type)
    data_start = -(-reader.pos // alignment) * alignment
    return data_start + data_end, frozenset(types)


def _read_metadata(path: Path) -> tuple[int, int, dict[str, Any], int, frozenset[int]]:
    """(version, tensor count, metadata, bytes the tensors need, tensor types) of one GGUF file; long arrays come back as None."""
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        # A big-endian GGUF shows its version byte-swapped (e.g. 0x03000000) when read little-endian.
        order = "<" if struct.unpack_from("<I", data, 4)[0] < 0x10000 else ">"
        reader = _MetadataReader(data, order)
        reader.pos = 4
        version = reader.take("I")
        tensor_count = reader.take("Q")
        kv_count = reader.take("Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = reader.string()
            metadata[key] = reader.value(reader.take("I"))
        needed, types = _tensor_data_end(reader, tensor_count, int(metadata.get("general.alignment") or DEFAULT_ALIGNMENT))
    return version, tensor_count, metadata, needed, types


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
        version, tensor_count, meta, needed_bytes, tensor_types = _read_metadata(path)
    except (struct.error, ValueError, OverflowError, MemoryError) as exc:
        raise GGUFError(f"{path}: unreadable GGUF header ({exc}); the file is probably truncated") from exc
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"{path}: GGUF version {version} is not supported (expected one of {SUPPORTED_VERSIONS})")
    size = path.stat().st_size
    if size < needed_bytes:
        raise GGUFError(f"{path}: truncated: its tensors need {needed_bytes} bytes but the file has {size}")
    arch = str(meta.get("general.architecture") or "unknown")

    def arch_int(suffix: str) -> int | None:
        return _as_int(meta.get(f"{arch}.{suffix}"))

    return GGUFInfo(
        path=path,
        version=version,
        architecture=arch,
        name=meta.get("general.name"),
        block_count=arch_int("block_count"),
        context_length=arch_int("context_length"),
        embedding_length=arch_int("embedding_length"),
        head_count=arch_int("attention.head_count"),
        head_count_kv=arch_int("attention.head_count_kv"),
        key_length=arch_int("attention.key_length"),
        value_length=arch_int("attention.value_length"),
        file_type=_as_int(meta.get("general.file_type")),
        split_index=_as_int(meta.get("split.no")) or 0,
        split_count=_as_int(meta.get("split.count")) or 1,
        tensor_count=tensor_count,
        file_bytes=size,
        tensor_types=tensor_types,
        metadata={k: v for k, v in meta.items() if v is not None and not isinstance(v, list)},
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
