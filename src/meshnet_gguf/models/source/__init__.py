"""Turn `--gguf` / `--quant` / `--demo` into a verified, launchable shard set on local disk.

`--gguf` names one of four kinds of source (`pick_source`), in this order of precedence:

1. an existing local path: a `.gguf` file (any shard of a split finds its
   siblings, `local.FileSource`) or a folder holding one or more quants (`local.FolderSource`);
2. a catalog id (`demo`, `deepseek-v4-flash`), optionally `id:QUANT` (`hub.CatalogSource`);
3. a Hugging Face repo id `owner/name`, optionally `owner/name:QUANT` (`hub.HubRepoSource`).

Each answers the same three questions (`base.ModelSource`: what it offers, what is on disk,
how to fetch), one call each that returns a value (`Offer`, `OnDisk`, `ResolvedModel`); a quant
is chosen in one place (`quants.pick_group`, which `base.choose_quant` and `Offer` go through).
Whatever the source, the result has passed the GGUF header check (magic,
version, split count consistent with the shard set) and, for hub and packaged
models, a sha256 check against the publisher's listing. Nothing that failed a
check is ever returned.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.models.catalog import DEMO_ID, Catalog, load_catalog
from meshnet_gguf.models.download import DownloadError, FreeBytes, HubAccess, default_free_bytes
from meshnet_gguf.models.gguf_names import GGUF_SUFFIX
from meshnet_gguf.models.quants import normalize_quant
from meshnet_gguf.models.source.base import (
    Budget,
    HubFetch,
    ModelResolutionError,
    ModelSource,
    Offer,
    OfferedQuant,
    OnDisk,
    ResolvedModel,
    choose_quant,
    offered_by_catalog,
)
from meshnet_gguf.models.source.hub import CatalogSource, HubRepoSource
from meshnet_gguf.models.source.local import FileSource, FolderSource

__all__ = [
    "Budget", "CatalogSource", "FileSource", "FolderSource", "HubFetch", "HubRepoSource", "ModelResolutionError",
    "ModelSource", "Offer", "OfferedQuant", "OnDisk", "ResolvedModel", "choose_quant", "offered_by_catalog",
    "offered_quants", "pick_source", "resolve_model",
]  # fmt: skip

log = logging.getLogger(__name__)

# owner/name as the hub allows them (letters, digits, '-', '_', '.'), with an optional :QUANT.
REPO_ID_RE = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<quant>[\w.-]+))?$")
CATALOG_SPEC_RE = re.compile(r"^(?P<id>[a-z0-9][a-z0-9._-]*)(?::(?P<quant>[\w.-]+))?$", re.IGNORECASE)


def pick_source(gguf: str | None, *, quant: str | None, demo: bool, catalog: Catalog) -> ModelSource:
    """The kind of source `--gguf` names, in this order: an existing path, a catalog id, a repo id. Fetches nothing.

    Raises ModelResolutionError when nothing or nothing recognisable is asked for,
    or when the spec's quant and `--quant` disagree.
    """
    if demo:
        entry = catalog.get(DEMO_ID)
        assert entry is not None, "the packaged catalog always has the demo entry"
        return CatalogSource(DEMO_ID, quant, entry)
    if not gguf:
        raise ModelResolutionError(
            "nothing to serve: pass --gguf with a .gguf file, a directory, a repo id (owner/name[:QUANT]) "
            f"or a catalog id ({', '.join(catalog.ids)}), or --demo"
        )
    path = Path(gguf).expanduser().absolute()
    if path.is_file():
        return FileSource(gguf, None, path)  # a file is its own quant: --quant has nothing to choose
    if path.is_dir():
        return FolderSource(gguf, quant, path)
    catalog_match = CATALOG_SPEC_RE.match(gguf)
    entry = catalog.get(catalog_match["id"]) if catalog_match else None
    if catalog_match and entry is not None:
        return CatalogSource(entry.id, _merge_quant(catalog_match["quant"], quant, gguf), entry)
    repo_match = REPO_ID_RE.match(gguf)
    if repo_match and not gguf.lower().endswith(GGUF_SUFFIX):
        repo_id = repo_match["repo"]
        return HubRepoSource(repo_id, _merge_quant(repo_match["quant"], quant, gguf), repo_id, curated=catalog.by_repo(repo_id))
    raise ModelResolutionError(
        f"--gguf {gguf}: no such file or directory, and not a catalog id ({', '.join(catalog.ids)}) "
        "or a Hugging Face repo id (owner/name[:QUANT])"
    )


def _merge_quant(spec_quant: str | None, flag_quant: str | None, spec: str) -> str | None:
    if spec_quant and flag_quant and normalize_quant(spec_quant) != normalize_quant(flag_quant):
        raise ModelResolutionError(f"--gguf {spec} names quant {spec_quant} but --quant says {flag_quant}; give one")
    return spec_quant or flag_quant


def resolve_model(
    settings: NodeSettings,
    *,
    progress: bool = True,
    access: HubAccess | None = None,
    free_bytes: FreeBytes = default_free_bytes,
    catalog: Catalog | None = None,
    budget: Budget,
) -> ResolvedModel:
    """What the settings ask to serve, downloaded if needed, verified and header-checked (`meshnet-gguf download`).

    Raises `ModelResolutionError` (with the underlying error as `__cause__`) on anything
    an operator must act on: ambiguous or missing quant, gated repo, no disk space,
    checksum mismatch, offline with files missing, a broken GGUF.
    """
    catalog = catalog or load_catalog()
    source = pick_source(settings.gguf, quant=settings.quant, demo=settings.demo, catalog=catalog)
    access = access or HubAccess.from_environment(offline=settings.offline)
    hub = HubFetch(settings.download_dir, access, progress, free_bytes, budget)
    try:
        # Rows rated against the box only when no quant was asked for (a refusal then lists what fits).
        offer = source.offered(settings.download_dir, access, may_write=True, budget=budget if source.quant is None else None)
        if offer.chosen is None:
            assert offer.refusal is not None, "an offer chooses a row or says why not"
            raise offer.refusal
        resolved = source.fetch(offer, offer.chosen, hub)
    except DownloadError as exc:
        raise ModelResolutionError(str(exc)) from exc
    log.info(
        "model %s: %s in %d file(s)%s, first shard %s",
        resolved.label, format_bytes(resolved.total_bytes), len(resolved.shards),
        ", sha256 verified" if resolved.verified else "", resolved.first_shard,
    )  # fmt: skip
    return resolved


def offered_quants(spec: str, download_dir: Path, *, access: HubAccess, catalog: Catalog, may_write: bool = True) -> Offer:
    """What `spec` (catalog id, repo id or directory) offers, with sizes; fetches no model bytes.

    A repo the catalog curates is listed from the hub when it can be; offline and
    never listed, the catalog's own figures for it answer.
    """
    not_listable = f"{spec}: not a directory, catalog id ({', '.join(catalog.ids)}) or repo id (owner/name)"
    try:
        source = pick_source(spec, quant=None, demo=False, catalog=catalog)
    except ModelResolutionError as exc:
        raise ModelResolutionError(not_listable) from exc
    if isinstance(source, FileSource):
        raise ModelResolutionError(not_listable)
    try:
        return source.offered(download_dir, access, may_write=may_write)
    except DownloadError as exc:
        raise ModelResolutionError(str(exc)) from exc
