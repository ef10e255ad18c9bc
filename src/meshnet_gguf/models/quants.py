"""Quants: reading a quant label from a file name, grouping files into quants, and choosing one.

Every step from `--quant` to the one set of files a launch uses is here: the label's
canonical spelling (`normalize_quant`), the label a file carries (`quant_of`), a listing or a
folder grouped into loadable models (`group_quants`, `scan_dir`) and the choice (`select_quant`,
`pick_group`: the one place a quant is chosen). `sort_quants` (`sort_folder` for a folder) does
both in one call and hands back values, so a model source asks this module once per question.
Pure functions over paths-as-strings, except `scan_dir`, which reads a folder.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Generic, Protocol, TypeVar

from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.models.gguf_names import GGUF_SUFFIX, is_auxiliary, is_gguf, shard_position, split_base

log = logging.getLogger(__name__)

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
# Folders we keep beside downloaded files; never part of a model.
_PRIVATE_DIRS = (".meshnet", ".cache", ".git")


class HasPathAndSize(Protocol):
    @property
    def path(self) -> str: ...

    @property
    def size(self) -> int: ...


FileT = TypeVar("FileT", bound=HasPathAndSize)


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
    """The files of one loadable model: a single file, or the shards of one split, in shard order.

    Its figures are fields worked out once at construction, not properties: a caller in
    another module (a model source building its offered rows) reads them without calling in.
    """

    quant: str | None
    base: str  # folder + shared file name stem, e.g. "UD-Q4_K_XL/Model-UD-Q4_K_XL"
    files: tuple[FileT, ...]
    expected_shards: int
    missing_shards: tuple[int, ...] = ()
    total_bytes: int = field(init=False, compare=False, repr=False)
    shard_count: int = field(init=False, compare=False, repr=False)
    complete: bool = field(init=False, compare=False, repr=False)
    first: FileT = field(init=False, compare=False, repr=False)
    label: str = field(init=False, compare=False, repr=False)  # the quant, else the file stem

    def __post_init__(self) -> None:
        # A frozen dataclass sets its own derived fields through object.__setattr__.
        object.__setattr__(self, "total_bytes", sum(f.size for f in self.files))
        object.__setattr__(self, "shard_count", self.expected_shards)
        object.__setattr__(self, "complete", not self.missing_shards)
        object.__setattr__(self, "first", self.files[0])
        object.__setattr__(self, "label", self.quant or PurePosixPath(self.base).name)

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


def pick_group(groups: Sequence[QuantGroup[FileT]], quant: str | None, files_glob: str | None, where: str) -> QuantGroup[FileT]:
    """The group a catalog entry's file pattern names, else the one `quant` names (`select_quant`)."""
    if files_glob is not None:
        matching = [g for g in groups if all(fnmatchcase(f.path, files_glob) for f in g.files)]
        if len(matching) == 1:
            return matching[0]
        log.warning("%s: the catalog pattern %s matches %d models; selecting by quant name", where, files_glob, len(matching))
    return select_quant(groups, quant)


@dataclass(frozen=True)
class QuantSort(Generic[FileT]):
    """Files grouped into quants, with the group a request names: what a model source needs from one call."""

    files: tuple[FileT, ...]  # every file looked at (a folder of auxiliary files only has no groups)
    groups: tuple[QuantGroup[FileT], ...]
    chosen: QuantGroup[FileT] | None  # None: `refused` says why
    refused: QuantSelectionError | None = None


def sort_quants(files: Iterable[FileT], requested: str | None, *, pattern: str | None = None, where: str = "") -> QuantSort[FileT]:
    """`files` grouped (`group_quants`) and the group `requested` names chosen (`pick_group`), in one call.
    An incomplete split can be chosen: the caller refuses it with the names of its missing shards."""
    listed = tuple(files)
    groups = group_quants(listed)
    try:
        return QuantSort(listed, tuple(groups), pick_group(groups, requested, pattern, where))
    except QuantSelectionError as exc:
        return QuantSort(listed, tuple(groups), None, exc)


# ---- a folder as a listing ----------------------------------------------------------------
@dataclass(frozen=True)
class LocalFile:
    path: str  # relative to the directory being scanned, "/"-separated
    size: int


def scan_dir(directory: Path) -> list[LocalFile]:
    """The GGUF files under `directory` (our own bookkeeping folders skipped), as a listing to group."""
    files = []
    for p in sorted(directory.rglob(f"*{GGUF_SUFFIX}")):
        rel = p.relative_to(directory)
        if any(part in _PRIVATE_DIRS for part in rel.parts) or not p.is_file():
            continue
        files.append(LocalFile(PurePosixPath(*rel.parts).as_posix(), p.stat().st_size))
    return files


def sort_folder(directory: Path, requested: str | None, *, pattern: str | None = None, where: str = "") -> QuantSort[LocalFile]:
    """`sort_quants` over the GGUF files in `directory` (`scan_dir`)."""
    return sort_quants(scan_dir(directory), requested, pattern=pattern, where=where)
