"""The curated model catalog (`catalog.toml`) and the "featured" rule.

An entry is featured only when it can actually load here: a llama-server is
available and at least one of its quants fits this machine's memory budget.
"A featured model nobody can load is an anti-feature." The caller measures the
budget and the binary (floor-2 probes) and says what each quant needs (the
quant advisor: weights + KV cache + compute buffers); this module only applies
the rule.

Entries may carry the model's attention shape (`layers`, `kv_heads`,
`head_dim_k`, `head_dim_v`), so a KV cache and a launch plan can be estimated
before a byte is downloaded (`prepare.memory.ModelFacts.from_catalog`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Any, Callable

from meshnet_gguf.models.quants import normalize_quant, strip_dynamic_prefix

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

CATALOG_RESOURCE = "catalog.toml"
DEMO_ID = "demo"


class CatalogError(ValueError):
    """The catalog file is malformed (a packaging bug, not an operator error)."""


@dataclass(frozen=True)
class CatalogQuant:
    name: str
    files: str  # glob over repo paths that matches exactly this quant's shards
    total_bytes: int
    shards: int

    def matches_path(self, path: str) -> bool:
        return fnmatchcase(path, self.files)

    @property
    def first_file(self) -> str:
        """The repo path of shard 1 (what llama-server loads): the glob's `*` is the shard number."""
        if self.shards > 1 and "*" in self.files:
            return self.files.replace("*", f"{1:05d}", 1)
        return self.files


@dataclass(frozen=True)
class ModelShape:
    """What sizes the KV cache, as the model's config (and GGUF header) states it; the same for every quant."""

    layers: int  # transformer blocks (`<arch>.block_count`)
    kv_heads: int  # `<arch>.attention.head_count_kv` (the largest, when it varies per layer)
    head_dim_k: int  # `<arch>.attention.key_length`
    head_dim_v: int  # `<arch>.attention.value_length`


@dataclass(frozen=True)
class CatalogEntry:
    id: str
    title: str
    quants: tuple[CatalogQuant, ...]
    repo: str | None = None
    package: str | None = None
    context_length: int | None = None
    notes: str = ""
    shape: ModelShape | None = None
    chat_template: str | None = None  # a Jinja file shipped in this package
    stop: tuple[str, ...] = ()

    def llama_args(self, supports: Callable[[str], bool]) -> list[str]:
        """llama-server flags this entry needs (its chat template, its stop strings), as far as the build `supports`."""
        args: list[str] = []
        if self.chat_template and supports("--chat-template-file"):
            args += ["--chat-template-file", str(packaged_file(self.chat_template))]
        if supports("--reverse-prompt"):
            for word in self.stop:
                args += ["--reverse-prompt", word]
        return args

    def quant(self, name: str) -> CatalogQuant | None:
        """Case-insensitive lookup; `UD-` optional when that leaves one candidate (as in `select_quant`)."""
        wanted = normalize_quant(name)
        exact = [q for q in self.quants if normalize_quant(q.name) == wanted]
        if exact:
            return exact[0]
        loose = [q for q in self.quants if strip_dynamic_prefix(q.name) == strip_dynamic_prefix(wanted)]
        return loose[0] if len(loose) == 1 else None

    def fitting_quants(self, budget_bytes: int, need_bytes: NeedBytes | None = None) -> list[CatalogQuant]:
        return [q for q in self.quants if quant_fits(q, budget_bytes, need_bytes)]


@dataclass(frozen=True)
class Catalog:
    entries: tuple[CatalogEntry, ...]

    def get(self, entry_id: str) -> CatalogEntry | None:
        wanted = entry_id.strip().lower()
        return next((e for e in self.entries if e.id == wanted), None)

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.entries]

    def by_repo(self, repo_id: str) -> CatalogEntry | None:
        """The entry curating `repo_id` (hub ids are case-insensitive), for its model shape."""
        wanted = repo_id.strip().lower()
        return next((e for e in self.entries if e.repo is not None and e.repo.lower() == wanted), None)


def model_aliases(
    model_id: str,
    catalog: Catalog,
    *,
    catalog_id: str | None = None,
    repo_id: str | None = None,
    quant: str | None = None,
    file_name: str | None = None,
) -> tuple[str, ...]:
    """The other names a served model answers to (besides `model_id`), for `protocol.model_answers_to`.

    - the id without its quant: the catalog id (`demo`) or the repo (`owner/name`);
    - a curated repo by both names, with and without `:QUANT`
      (`deepseek-v4-flash:UD-IQ3_XXS` = `unsloth/DeepSeek-V4-Flash-GGUF:UD-IQ3_XXS`);
    - the GGUF file name of shard 1, with and without `.gguf`.
    """
    entry = catalog.get(catalog_id) if catalog_id else (catalog.by_repo(repo_id) if repo_id else None)
    bases = [catalog_id, repo_id, entry.id if entry else None, entry.repo if entry else None]
    names: list[str] = []
    for base in filter(None, bases):
        names += [base, f"{base}:{quant}"] if quant else [base]
    if file_name:
        names += [file_name, file_name.removesuffix(".gguf")]
    seen = {model_id.lower()}
    unique = []
    for name in names:
        if name.lower() not in seen:
            seen.add(name.lower())
            unique.append(name)
    return tuple(unique)


# What a quant needs in memory to run: the quant advisor's weights + KV cache + compute buffers.
NeedBytes = Callable[[CatalogQuant], int]


def quant_fits(quant: CatalogQuant, budget_bytes: int, need_bytes: NeedBytes | None = None) -> bool:
    """Whether `quant` fits `budget_bytes` (the box's capacity, system reserve already kept back).

    `need_bytes` should count as the launch plan does (`prepare/memory.memory_need_bytes`, the
    KV cache and compute buffers on top of the weights); without it only the weights count,
    which over-promises by a few GB.
    """
    need = need_bytes(quant) if need_bytes is not None else quant.total_bytes
    return need <= budget_bytes


def featured(entry: CatalogEntry, budget_bytes: int, binary_available: bool, need_bytes: NeedBytes | None = None) -> bool:
    """Show an entry as featured only when it can load here (a featured model nobody can load is an anti-feature)."""
    return binary_available and any(quant_fits(q, budget_bytes, need_bytes) for q in entry.quants)


def _require(table: dict[str, Any], key: str, where: str) -> Any:
    if key not in table:
        raise CatalogError(f"catalog {where}: missing '{key}'")
    return table[key]


def parse_catalog(text: str) -> Catalog:
    data = tomllib.loads(text)
    entries: list[CatalogEntry] = []
    for raw in data.get("model", []):
        entry_id = str(_require(raw, "id", "entry")).lower()
        quants = tuple(
            CatalogQuant(
                name=normalize_quant(str(_require(q, "name", entry_id))),
                files=str(_require(q, "files", entry_id)),
                total_bytes=int(_require(q, "total_bytes", entry_id)),
                shards=int(_require(q, "shards", entry_id)),
            )
            for q in raw.get("quant", [])
        )
        if not quants:
            raise CatalogError(f"catalog entry {entry_id}: no quants")
        if (raw.get("repo") is None) == (raw.get("package") is None):
            raise CatalogError(f"catalog entry {entry_id}: give exactly one of 'repo' or 'package'")
        shape = None
        if any(k in raw for k in ("layers", "kv_heads", "head_dim_k", "head_dim_v")):
            head_dim_k = int(_require(raw, "head_dim_k", entry_id))
            shape = ModelShape(
                layers=int(_require(raw, "layers", entry_id)),
                kv_heads=int(_require(raw, "kv_heads", entry_id)),
                head_dim_k=head_dim_k,
                head_dim_v=int(raw.get("head_dim_v", head_dim_k)),
            )
        entries.append(
            CatalogEntry(
                id=entry_id,
                title=str(raw.get("title", entry_id)),
                quants=quants,
                repo=raw.get("repo"),
                package=raw.get("package"),
                context_length=raw.get("context_length"),
                notes=str(raw.get("notes", "")),
                shape=shape,
                chat_template=_packaged_name(raw.get("chat_template"), entry_id),
                stop=tuple(str(word) for word in raw.get("stop", [])),
            )
        )
    ids = [e.id for e in entries]
    if len(set(ids)) != len(ids):
        raise CatalogError(f"catalog: duplicate ids in {ids}")
    return Catalog(tuple(entries))


def packaged_file(name: str) -> Path:
    """A data file shipped inside this package, as a path llama-server can open."""
    return Path(str(files(__package__).joinpath(name)))


def _packaged_name(name: Any, entry_id: str) -> str | None:
    if name is None:
        return None
    if not packaged_file(str(name)).is_file():
        raise CatalogError(f"catalog entry {entry_id}: chat_template {name!r} is not shipped in the package")
    return str(name)


def load_catalog(path: Path | None = None) -> Catalog:
    """The packaged catalog, or the file at `path` (for tests and local curation)."""
    if path is not None:
        return parse_catalog(Path(path).read_text(encoding="utf-8"))
    return _packaged_catalog()


@lru_cache(maxsize=1)
def _packaged_catalog() -> Catalog:
    return parse_catalog(files(__package__).joinpath(CATALOG_RESOURCE).read_text(encoding="utf-8"))
