"""The models on disk: what `meshnet-gguf models --local` lists and `meshnet-gguf rm` removes.

Downloads live in `<download dir>/<owner>/<name>/` (`download.repo_local_dir`), the quant in the file
name or a folder; each quant is grouped the way a model source groups a folder (`quants.scan_dir`,
`group_quants`), so a split model is one row. Unfinished downloads (`*.part`) are rows of their own,
so `rm` can clear them too. A model the catalog ships as a package (the demo) is assembled into
`<download dir>/<catalog id>/` and listed under its catalog id, as `serve --gguf demo` names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshnet_gguf.models.catalog import Catalog, load_catalog
from meshnet_gguf.models.download import META_DIR
from meshnet_gguf.models.quants import group_quants, normalize_quant, scan_dir

PARTIAL_SUFFIX = ".part"
# `owner/name`: the two folder levels a download goes in.
REPO_DEPTH = 2


@dataclass(frozen=True)
class LocalModel:
    model: str  # owner/name, as `serve --gguf owner/name:QUANT` names it
    quant: str  # the quant label, else the file stem
    files: tuple[Path, ...]  # shard order; the first is what llama-server loads
    total_bytes: int
    complete: bool  # every shard there, no download still under way

    @property
    def path(self) -> Path:
        return self.files[0]

    @property
    def spec(self) -> str:
        return f"{self.model}:{self.quant}"


def local_models(download_dir: Path, catalog: Catalog | None = None) -> list[LocalModel]:
    root = Path(download_dir).expanduser().absolute()
    packaged = [e.id for e in (catalog or load_catalog()).entries if e.package is not None]
    found: list[LocalModel] = []
    folders = [
        (p, "/".join(p.relative_to(root).parts[:REPO_DEPTH]))
        for p in sorted(root.glob("*/*"))
        if p.is_dir() and not _private(p, root) and p.parent.name not in packaged
    ]
    folders += [(root / entry_id, entry_id) for entry_id in packaged if (root / entry_id).is_dir()]
    for repo_dir, model in folders:
        for group in group_quants(scan_dir(repo_dir)):
            files = tuple(repo_dir / f.path for f in group.files)
            found.append(LocalModel(model, group.label, files, group.total_bytes, group.complete))
        partial = sorted(p for p in repo_dir.rglob(f"*{PARTIAL_SUFFIX}") if p.is_file() and META_DIR not in p.parts)
        for part in partial:
            found.append(LocalModel(model, f"{part.name} (unfinished download)", (part,), part.stat().st_size, False))
    return found


def matching(models: list[LocalModel], spec: str, catalog: Catalog) -> list[LocalModel]:
    """The local models `MODEL[:QUANT]` names: a repo id or a catalog id, every quant when none is given."""
    name, _, quant = spec.partition(":")
    entry = catalog.get(name)
    repo = (entry.repo if entry is not None and entry.repo else name).lower()
    wanted = normalize_quant(quant) if quant else None
    return [
        m for m in models
        if m.model.lower() == repo and (wanted is None or normalize_quant(m.quant) == wanted or m.quant.lower() == quant.lower())
    ]  # fmt: skip


def _private(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


__all__ = ["LocalModel", "local_models", "matching"]
