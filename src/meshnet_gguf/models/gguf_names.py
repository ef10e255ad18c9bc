"""GGUF file names: quant labels, split-shard naming and grouping a file list into quants.

Repositories lay quants out in three ways, and this module reads all of them:

- one file at the root: `Model-Q4_K_M.gguf`
- split files at the root: `Model-Q8_0-00001-of-00003.gguf`
- a folder per quant: `UD-Q4_K_XL/Model-UD-Q4_K_XL-00001-of-00005.gguf`

llama.cpp loads a split model from shard 1 and finds the others by their
names (`-0000k-of-0000K.gguf`), so the names here are load-bearing, not cosmetic.
Pure functions over paths-as-strings; no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Generic, Protocol, TypeVar

from meshnet_gguf.common.units import format_bytes

GGUF_SUFFIX = ".gguf"
SHARD_RE = re.compile(r"-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
UNSLOTH_DYNAMIC_PREFIX = "UD-"

# A quant label: llama.cpp's type names (Q4_K_M, IQ3_XXS, Q8_0, TQ1_0, F16, BF16, MXFP4...)
# plus the `_L`/`_XL` variants some uploaders add, optionally behind Unsloth's `UD-`.
# It must stand alone between separators so that e.g. "Qwen3" or "8B" are never read as quants.
_QUANT_RE = re.compile(
    r"(?<![A-Za-z0-9])"
    r"(?P<quant>(?:UD[-_])?(?:I?Q[1-8](?:_[0-9A-Z]+)*|TQ[12]_0|BF16|F16|F32|MXFP4(?:_MOE)?))"
    r"(?![A-Za-z0-9])",
    re.IGNORECASE,
)
# Multimodal projectors ship next to the weights but are not a model llama-server loads as `-m`.
_AUXILIARY_PREFIXES = ("mmproj",)


class HasPathAndSize(Protocol):
    @property
    def path(self) -> str: ...

    @property
    def size(self) -> int: ...


FileT = TypeVar("FileT", bound=HasPathAndSize)


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


def normalize_quant(label: str) -> str:
    """Canonical spelling: upper case, `UD-` with a hyphen (`ud_q4_k_xl` -> `UD-Q4_K_XL`)."""
    upper = label.strip().upper()
    if upper.startswith("UD_"):
        upper = UNSLOTH_DYNAMIC_PREFIX + upper[3:]
    return upper


def strip_dynamic_prefix(label: str) -> str:
    canonical = normalize_quant(label)
    return canonical[len(UNSLOTH_DYNAMIC_PREFIX) :] if canonical.startswith(UNSLOTH_DYNAMIC_PREFIX) else canonical


def quant_of(path: str) -> str | None:
    """The quant a GGUF path carries, from its file name, else from its folder (`Q4_K_M/model-00001-of-00002.gguf`)."""
    pure = PurePosixPath(path)
    candidates = [split_base(pure.name), *reversed(pure.parent.parts)]
    for text in candidates:
        matches = list(_QUANT_RE.finditer(text))
        if matches:
            # The last match: quant labels sit at the end of names ("Qwen2.5-Q4_K_M").
            return normalize_quant(matches[-1]["quant"])
    return None


@dataclass(frozen=True)
class QuantGroup(Generic[FileT]):
    """The files of one loadable model: a single file, or the shards of one split, in shard order."""

    quant: str | None
    base: str  # folder + shared file name stem, e.g. "UD-Q4_K_XL/Model-UD-Q4_K_XL"
    files: tuple[FileT, ...]
    expected_shards: int
    missing_shards: tuple[int, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def shard_count(self) -> int:
        return self.expected_shards

    @property
    def complete(self) -> bool:
        return not self.missing_shards

    @property
    def first(self) -> FileT:
        return self.files[0]

    @property
    def label(self) -> str:
        return self.quant or PurePosixPath(self.base).name

    def describe(self, note: str = "") -> str:
        """One line for listings and error messages: label, size, shards, `note`, first file."""
        shards = f"{self.shard_count} shard{'s' if self.shard_count != 1 else ''}"
        missing = f", MISSING shard(s) {', '.join(map(str, self.missing_shards))}" if self.missing_shards else ""
        note = f"  {note}" if note else ""
        return f"{self.label:<14} {format_bytes(self.total_bytes):>10}  {shards:<9}{missing}{note}  ({self.first.path})"


def group_quants(files: Iterable[FileT]) -> list[QuantGroup[FileT]]:
    """Group a repo's or folder's files into loadable models (auxiliary and non-GGUF files are skipped).

    Shards are grouped by folder + shared stem, so a root file and a folder
    holding the same quant stay two candidates (the caller reports them as ambiguous).
    """
    buckets: dict[tuple[str, str], list[FileT]] = {}
    for f in files:
        if not is_gguf(f.path) or is_auxiliary(f.path):
            continue
        pure = PurePosixPath(f.path)
        buckets.setdefault((str(pure.parent), split_base(pure.name)), []).append(f)

    groups: list[QuantGroup[FileT]] = []
    for (folder, stem), members in buckets.items():
        base = stem if folder in ("", ".") else f"{folder}/{stem}"
        split = [(shard_position(m.path), m) for m in members]
        whole = [m for pos, m in split if pos is None]
        shards = sorted(((pos, m) for pos, m in split if pos is not None), key=lambda pm: pm[0].index)
        for m in whole:
            groups.append(QuantGroup(quant_of(m.path), base, (m,), 1))
        if shards:
            count = max(pos.count for pos, _ in shards)
            present = {pos.index for pos, _ in shards}
            missing = tuple(i for i in range(1, count + 1) if i not in present)
            ordered = tuple(m for _, m in shards)
            groups.append(QuantGroup(quant_of(ordered[0].path), base, ordered, count, missing))
    groups.sort(key=lambda g: (g.total_bytes, g.base))
    return groups


class QuantSelectionError(LookupError):
    """No single model matches; `candidates` are what was offered (for listing with sizes)."""

    def __init__(self, message: str, candidates: Sequence[QuantGroup]) -> None:  # type: ignore[type-arg]
        super().__init__(message)
        self.candidates = list(candidates)


class QuantRequired(QuantSelectionError):
    """Several quants are offered and none was asked for."""


class QuantNotFound(QuantSelectionError):
    """The requested quant is not offered."""


class AmbiguousQuant(QuantSelectionError):
    """The requested quant matches more than one model (e.g. a root file and a folder)."""


def select_quant(groups: Sequence[QuantGroup[FileT]], requested: str | None) -> QuantGroup[FileT]:
    """Pick the one group meant by `requested` (case-insensitive; `UD-` optional when unambiguous).

    An exact label match wins over one that differs only by Unsloth's `UD-`
    prefix, so `IQ3_XXS` picks `IQ3_XXS` where both exist and `UD-IQ3_XXS` where
    only that exists. No `requested` is fine only when exactly one model is offered.
    """
    if not groups:
        raise QuantNotFound("no GGUF model files found", [])
    if requested is None:
        if len(groups) == 1:
            return groups[0]
        raise QuantRequired(f"{len(groups)} quants are offered; choose one", groups)

    wanted = normalize_quant(requested)
    exact = [g for g in groups if g.quant == wanted]
    if len(exact) == 1:
        return exact[0]
    if len(exact) > 1:
        raise AmbiguousQuant(f"quant {wanted} matches {len(exact)} models", exact)

    loose_wanted = strip_dynamic_prefix(wanted)
    loose = [g for g in groups if g.quant is not None and strip_dynamic_prefix(g.quant) == loose_wanted]
    if len(loose) == 1:
        return loose[0]
    if len(loose) > 1:
        raise AmbiguousQuant(f"quant {wanted} matches {len(loose)} models", loose)
    raise QuantNotFound(f"quant {wanted} is not offered", groups)
