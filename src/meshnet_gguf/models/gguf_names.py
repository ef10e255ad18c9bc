"""GGUF file names: split-shard naming, and which files are GGUF models at all.

Repositories lay quants out in three ways (reading the quant from a name and grouping files
into quants is `quants`):

- one file at the root: `Model-Q4_K_M.gguf`
- split files at the root: `Model-Q8_0-00001-of-00003.gguf`
- a folder per quant: `UD-Q4_K_XL/Model-UD-Q4_K_XL-00001-of-00005.gguf`

llama.cpp loads a split model from shard 1 and finds the others by their
names (`-0000k-of-0000K.gguf`), so the names here are load-bearing, not cosmetic.
Pure functions over paths-as-strings; no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

GGUF_SUFFIX = ".gguf"
SHARD_RE = re.compile(r"-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)

# Multimodal projectors ship next to the weights but are not a model llama-server loads as `-m`.
_AUXILIARY_PREFIXES = ("mmproj",)


@dataclass(frozen=True)
class ShardPosition:
    index: int  # 1-based, as in the file name
    count: int


def shard_position(filename: str) -> ShardPosition | None:
    """`Model-Q8_0-00002-of-00003.gguf` -> ShardPosition(2, 3); an unsplit file -> None."""
    match = SHARD_RE.search(PurePosixPath(filename).name)
    if match is None:
        return None
    return ShardPosition(int(match["index"]), int(match["count"]))


def shard_file_name(base: str, index: int, count: int) -> str:
    """The name llama.cpp expects for shard `index` of `count` (`base-0000i-of-0000N.gguf`)."""
    return f"{base}-{index:05d}-of-{count:05d}{GGUF_SUFFIX}"


def split_base(filename: str) -> str:
    """The file name without its shard suffix or `.gguf`: what all shards of one model share."""
    name = PurePosixPath(filename).name
    stripped = SHARD_RE.sub("", name)
    if stripped != name:
        return stripped
    return name[: -len(GGUF_SUFFIX)] if name.lower().endswith(GGUF_SUFFIX) else name


def sibling_shards(path: Path, count: int | None = None) -> list[Path]:
    """Every shard of the split model `path` belongs to, shard 1 first, as llama.cpp names them;
    `[path]` for an unsplit file. The one place that lists a split's files from one of them.

    `count` is the split count when the caller knows it from the header (`split.count`)
    rather than from the name. Names only: whether the files exist is the caller's check.
    """
    position = shard_position(path.name)
    total = count if count is not None else position.count if position is not None else 1
    if total <= 1:
        return [path]
    base = split_base(path.name)
    return [path.with_name(shard_file_name(base, k, total)) for k in range(1, total + 1)]


def is_gguf(path: str) -> bool:
    return path.lower().endswith(GGUF_SUFFIX)


def is_auxiliary(path: str) -> bool:
    """Files that are GGUF but not a loadable model on their own (vision projectors)."""
    return PurePosixPath(path).name.lower().startswith(_AUXILIARY_PREFIXES)
