"""The four model sources one by one: what each offers, what is on disk, and fetch.

Real tiny GGUF files; the hub ones against the loopback hub (`devtools.hf_server`) over real HTTP.
Each question is one call that returns a value (`Offer`, `OnDisk`, `ResolvedModel`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from meshnet_gguf.devtools.hf_server import LocalHub
from meshnet_gguf.models.catalog import CatalogEntry, parse_catalog
from meshnet_gguf.models.download import HubAccess, default_free_bytes, repo_local_dir
from meshnet_gguf.models.quants import QuantRequired
from meshnet_gguf.models.source import (
    CatalogSource,
    FileSource,
    FolderSource,
    HubFetch,
    HubRepoSource,
    ModelResolutionError,
    Offer,
)
from support.local_hub_fixtures import FOLDERS, ROOT_FILE, ROOT_SPLIT, TINY_CATALOG, access, hub, hub_root  # noqa: F401

# A budget nobody reads unless a refusal lists what fits: large enough that everything would.
ANY_BUDGET_BYTES = 1 << 40
# Nothing listens here: a source that asked the hub would fail rather than answer.
CLOSED_HUB = HubAccess(endpoint="http://127.0.0.1:9", token=None, offline=False)


def _hub_fetch(download_dir: Path, access: HubAccess) -> HubFetch:  # noqa: F811
    return HubFetch(download_dir, access, False, default_free_bytes, lambda: ANY_BUDGET_BYTES)


def _tiny_entry() -> CatalogEntry:
    entry = parse_catalog(TINY_CATALOG).get("tiny")
    assert entry is not None
    return entry


# ---- a file ---------------------------------------------------------------------------------
def test_a_file_offers_itself_chosen_and_is_on_disk_as_it_is(hub_root: Path, tmp_path: Path) -> None:
    path = hub_root / ROOT_FILE / "Tiny-Q4_K_M.gguf"
    source = FileSource(str(path), None, path)

    offer = source.offered(tmp_path / "models", CLOSED_HUB, may_write=False)
    assert isinstance(offer, Offer) and offer.source == "file" and offer.title == str(path)
    (row,) = offer.quants
    assert offer.chosen == row and offer.refusal is None
    assert (row.name, row.quant, row.shards, row.first_file) == ("Q4_K_M", "Q4_K_M", 1, path.name)
    assert row.total_bytes == path.stat().st_size

    found = source.on_disk(offer.chosen, tmp_path / "models")
    model = found.model
    assert model is not None and model.shards == (path,) and model.source == "file" and not model.verified
    assert model.quant == "Q4_K_M" and model.header is not None and model.label == str(path)
    # Fetching a file is taking it as it is: the same model, nothing asked of the hub.
    assert source.fetch(offer, offer.chosen, _hub_fetch(tmp_path / "models", CLOSED_HUB)) == model
    assert not (tmp_path / "models").exists()


def test_any_shard_of_a_split_file_offers_the_whole_split(hub_root: Path, tmp_path: Path) -> None:
    second = hub_root / ROOT_SPLIT / "Tiny-Q8_0-00002-of-00003.gguf"
    source = FileSource(str(second), None, second)
    offer = source.offered(tmp_path, CLOSED_HUB, may_write=False)
    assert offer.chosen is not None and offer.chosen.shards == 3 and offer.chosen.first_file == "Tiny-Q8_0-00001-of-00003.gguf"
    model = source.on_disk(offer.chosen, tmp_path).model
    assert model is not None and [p.name for p in model.shards] == [f"Tiny-Q8_0-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    assert model.name == "Tiny-Q8_0" and model.header is not None and model.header.split_count == 3


def test_a_file_that_is_not_gguf_or_misses_a_shard_is_refused(hub_root: Path, tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    with pytest.raises(ModelResolutionError, match="not a .gguf file"):
        FileSource(str(text), None, text).offered(tmp_path, CLOSED_HUB, may_write=False)
    copy = tmp_path / "split"
    shutil.copytree(hub_root / ROOT_SPLIT, copy)
    (copy / "Tiny-Q8_0-00003-of-00003.gguf").unlink()
    first = copy / "Tiny-Q8_0-00001-of-00003.gguf"
    with pytest.raises(ModelResolutionError, match="00003-of-00003.gguf is missing"):
        FileSource(str(first), None, first).offered(tmp_path, CLOSED_HUB, may_write=False)


# ---- a folder -------------------------------------------------------------------------------
def test_a_folder_offers_its_quants_and_the_one_asked_for(hub_root: Path, tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    shutil.copytree(hub_root / ROOT_SPLIT, folder)

    unasked = FolderSource(str(folder), None, folder).offered(tmp_path, CLOSED_HUB, may_write=False)
    assert unasked.source == "directory" and {r.name for r in unasked.quants} == {"Q8_0", "Q4_K_M"}
    assert all(r.shards == 3 and r.complete for r in unasked.quants)
    assert unasked.chosen is None and unasked.refusal is not None
    assert isinstance(unasked.refusal.__cause__, QuantRequired) and "offers several quants" in str(unasked.refusal)

    source = FolderSource(str(folder), "q8_0", folder)
    offer = source.offered(tmp_path, CLOSED_HUB, may_write=False)
    assert offer.chosen is not None and offer.chosen.name == "Q8_0" and offer.chosen.first_file == "Tiny-Q8_0-00001-of-00003.gguf"
    model = source.on_disk(offer.chosen, tmp_path).model
    assert model is not None and model.source == "directory" and model.quant == "Q8_0" and len(model.shards) == 3
    assert model.header is not None and not model.verified
    # Not a folder we downloaded into: no listing to verify against, so fetch takes the files as they are.
    fetched = source.fetch(offer, offer.chosen, _hub_fetch(tmp_path / "models", CLOSED_HUB))
    assert fetched.shards == model.shards and not fetched.verified and fetched.header is not None


def test_a_folder_missing_a_shard_refuses_that_quant_by_name(hub_root: Path, tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    shutil.copytree(hub_root / ROOT_SPLIT, folder)
    (folder / "Tiny-Q8_0-00002-of-00003.gguf").unlink()
    offer = FolderSource(str(folder), "Q8_0", folder).offered(tmp_path, CLOSED_HUB, may_write=False)
    assert offer.chosen is None and offer.refusal is not None and "00002-of-00003.gguf is missing" in str(offer.refusal)
    assert not next(r for r in offer.quants if r.name == "Q8_0").complete


# ---- a hub repo -----------------------------------------------------------------------------
def test_a_hub_repo_offers_its_listing_and_saves_it_only_when_it_may_write(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:  # noqa: F811
    models = tmp_path / "models"
    source = HubRepoSource(ROOT_SPLIT, "Q4_K_M", ROOT_SPLIT)

    offer = source.offered(models, access, may_write=False)
    assert offer.source == "hub" and offer.listing is not None and offer.title.startswith(f"{ROOT_SPLIT} @ ")
    assert {r.name for r in offer.quants} == {"Q8_0", "Q4_K_M"} and offer.chosen is not None and offer.chosen.name == "Q4_K_M"
    assert not models.exists(), "without may_write the listing is not saved"
    assert hub.bytes_served(ROOT_SPLIT) == 0

    # Not downloaded: nothing on disk, and no catalog entry curates it to plan from instead.
    found = source.on_disk(offer.chosen, models)
    assert found.model is None and found.quant == "Q4_K_M" and found.catalog_quant is None and found.first_shard is None

    saved = source.offered(models, access, may_write=True)
    assert saved.chosen == offer.chosen and (repo_local_dir(models, ROOT_SPLIT) / ".meshnet").is_dir()
    assert hub.bytes_served(ROOT_SPLIT) == 0


def test_a_hub_repo_fetches_the_chosen_quant_verified_and_then_finds_it_on_disk(
    hub: LocalHub,
    access: HubAccess,
    tmp_path: Path,  # noqa: F811
) -> None:
    models = tmp_path / "models"
    source = HubRepoSource(ROOT_SPLIT, "Q8_0", ROOT_SPLIT)
    offer = source.offered(models, access, may_write=True)
    assert offer.chosen is not None

    fetched = source.fetch(offer, offer.chosen, _hub_fetch(models, access))
    assert fetched.source == "hub" and fetched.verified and all(fetched.sha256s) and fetched.repo_id == ROOT_SPLIT
    assert fetched.quant == "Q8_0" and fetched.label == f"{ROOT_SPLIT}:Q8_0" and fetched.header is not None
    assert fetched.fetched_bytes == fetched.total_bytes == hub.bytes_served(ROOT_SPLIT)

    hub.reset_counters()
    found = source.on_disk(offer.chosen, models).model
    assert found is not None and found.shards == fetched.shards and found.quant == "Q8_0" and not found.verified
    assert found.header is not None and hub.requests() == []


def test_a_hub_repo_never_listed_offline_says_to_download_it(tmp_path: Path) -> None:
    offline = HubAccess(endpoint="", token=None, offline=True)
    with pytest.raises(ModelResolutionError, match=f"meshnet-gguf download {ROOT_SPLIT} --quant Q8_0"):
        HubRepoSource(ROOT_SPLIT, "Q8_0", ROOT_SPLIT).offered(tmp_path / "models", offline, may_write=False)


# ---- a catalog entry ------------------------------------------------------------------------
def test_a_catalog_entry_offers_its_own_rows_and_plans_from_them_before_a_download(tmp_path: Path) -> None:
    entry = _tiny_entry()
    source = CatalogSource("tiny:iq4_xs", "iq4_xs", entry)
    assert source.curated is entry and source.repo_id == FOLDERS and source.entry is entry

    offer = source.offered(tmp_path / "models", CLOSED_HUB, may_write=False)  # the catalog answers: no hub asked
    assert offer.source == "catalog" and [r.name for r in offer.quants] == ["UD-Q4_K_XL", "IQ4_XS"]
    assert offer.chosen is not None and offer.chosen.name == "IQ4_XS" and offer.chosen.catalog_quant is not None

    found = source.on_disk(offer.chosen, tmp_path / "models")
    assert found.model is None and found.catalog_quant == offer.chosen.catalog_quant
    assert found.first_shard == (tmp_path / "models" / FOLDERS / "IQ4_XS" / "Tiny-IQ4_XS-00001-of-00002.gguf").absolute()
    assert not (tmp_path / "models").exists()

    several = CatalogSource("tiny", None, entry).offered(tmp_path / "models", CLOSED_HUB, may_write=False)
    assert several.chosen is None and several.refusal is not None and isinstance(several.refusal.__cause__, QuantRequired)


def test_a_catalog_entry_fetches_through_its_repo_and_is_then_on_disk(hub: LocalHub, access: HubAccess, tmp_path: Path) -> None:  # noqa: F811
    models = tmp_path / "models"
    source = CatalogSource("tiny", "IQ4_XS", _tiny_entry())
    offer = source.offered(models, access, may_write=True)
    assert offer.chosen is not None

    fetched = source.fetch(offer, offer.chosen, _hub_fetch(models, access))
    assert fetched.catalog_id == "tiny" and fetched.repo_id == FOLDERS and fetched.quant == "IQ4_XS" and fetched.verified
    assert fetched.context_length == 2048 and fetched.label == "tiny:IQ4_XS" and len(fetched.shards) == 2
    assert fetched.header is not None and fetched.first_shard.name == "Tiny-IQ4_XS-00001-of-00002.gguf"

    found = source.on_disk(offer.chosen, models).model
    assert found is not None and found.shards == fetched.shards and found.catalog_id == "tiny" and found.label == "tiny:IQ4_XS"
