from __future__ import annotations

from dataclasses import dataclass

import pytest

from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.models.gguf_names import ShardPosition, shard_file_name, shard_position, split_base
from meshnet_gguf.models.quants import AmbiguousQuant, QuantNotFound, QuantRequired, group_quants, quant_of, select_quant


@dataclass(frozen=True)
class F:
    path: str
    size: int = 100


def test_shard_names_round_trip() -> None:
    name = shard_file_name("Model-Q8_0", 2, 3)
    assert name == "Model-Q8_0-00002-of-00003.gguf"
    assert shard_position(name) == ShardPosition(2, 3)
    assert shard_position("UD-Q4_K_XL/Model-UD-Q4_K_XL-00005-of-00005.gguf") == ShardPosition(5, 5)
    assert shard_position("Model-Q4_K_M.gguf") is None
    assert split_base(name) == "Model-Q8_0"
    assert split_base("dir/Model-Q4_K_M.gguf") == "Model-Q4_K_M"


@pytest.mark.parametrize(
    ("path", "quant"),
    [
        ("Model-Q4_K_M.gguf", "Q4_K_M"),
        ("Model-Q8_0-00001-of-00003.gguf", "Q8_0"),
        ("UD-Q4_K_XL/Model-UD-Q4_K_XL-00001-of-00005.gguf", "UD-Q4_K_XL"),
        ("DeepSeek-V4-Flash-UD-IQ3_XXS-00002-of-00004.gguf", "UD-IQ3_XXS"),
        ("Q4_K_M/model-00001-of-00002.gguf", "Q4_K_M"),  # quant only in the folder name
        ("gemma-3-270m-q4_k_m.gguf", "Q4_K_M"),  # lower case
        ("Qwen3-30B-A3B-BF16.gguf", "BF16"),
        ("Llama-3.1-8B-Instruct.IQ4_XS.gguf", "IQ4_XS"),
        ("model-ud_q2_k_xl.gguf", "UD-Q2_K_XL"),
        ("Qwen2.5-7B-Instruct.gguf", None),  # "Qwen2" and "7B" are not quants
    ],
)
def test_quant_of(path: str, quant: str | None) -> None:
    assert quant_of(path) == quant


def test_group_quants_reads_all_three_layouts_and_skips_projectors() -> None:
    files = [
        F("Model-Q4_K_M.gguf", 40),
        F("Model-Q8_0-00003-of-00003.gguf", 30),
        F("Model-Q8_0-00001-of-00003.gguf", 30),
        F("Model-Q8_0-00002-of-00003.gguf", 30),
        F("UD-Q4_K_XL/Model-UD-Q4_K_XL-00001-of-00002.gguf", 60),
        F("UD-Q4_K_XL/Model-UD-Q4_K_XL-00002-of-00002.gguf", 60),
        F("mmproj-F16.gguf", 5),
        F("README.md", 1),
    ]
    groups = {g.quant: g for g in group_quants(files)}
    assert set(groups) == {"Q4_K_M", "Q8_0", "UD-Q4_K_XL"}
    q8 = groups["Q8_0"]
    assert [f.path for f in q8.files] == [f"Model-Q8_0-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    assert (q8.total_bytes, q8.shard_count, q8.complete) == (90, 3, True)
    assert groups["UD-Q4_K_XL"].first.path.startswith("UD-Q4_K_XL/")
    assert groups["Q4_K_M"].shard_count == 1


def test_missing_shard_is_reported() -> None:
    (group,) = group_quants([F("M-Q8_0-00001-of-00003.gguf"), F("M-Q8_0-00003-of-00003.gguf")])
    assert not group.complete
    assert group.missing_shards == (2,)
    assert "MISSING" in group.describe()


ALL_LAYOUTS = group_quants(
    [
        F("Model-Q4_K_M.gguf"),
        F("Model-Q8_0-00001-of-00002.gguf"),
        F("Model-Q8_0-00002-of-00002.gguf"),
        F("UD-Q4_K_XL/Model-UD-Q4_K_XL-00001-of-00002.gguf"),
        F("UD-Q4_K_XL/Model-UD-Q4_K_XL-00002-of-00002.gguf"),
        F("IQ3_XXS/Model-IQ3_XXS.gguf"),
        F("UD-IQ3_XXS/Model-UD-IQ3_XXS.gguf"),
    ]
)


@pytest.mark.parametrize(
    ("requested", "chosen"),
    [
        ("Q4_K_M", "Q4_K_M"),
        ("q8_0", "Q8_0"),  # case-insensitive
        ("UD-Q4_K_XL", "UD-Q4_K_XL"),
        ("Q4_K_XL", "UD-Q4_K_XL"),  # UD- optional when only the UD variant exists
        ("ud-q4_k_xl", "UD-Q4_K_XL"),
        ("IQ3_XXS", "IQ3_XXS"),  # exact beats the UD- variant
        ("UD-IQ3_XXS", "UD-IQ3_XXS"),
    ],
)
def test_select_quant(requested: str, chosen: str) -> None:
    assert select_quant(ALL_LAYOUTS, requested).quant == chosen


def test_select_quant_without_request() -> None:
    with pytest.raises(QuantRequired) as info:
        select_quant(ALL_LAYOUTS, None)
    assert len(info.value.candidates) == len(ALL_LAYOUTS)
    single = group_quants([F("Only-Q4_K_M.gguf")])
    assert select_quant(single, None).quant == "Q4_K_M"


def test_select_quant_not_offered_lists_candidates() -> None:
    with pytest.raises(QuantNotFound) as info:
        select_quant(ALL_LAYOUTS, "Q2_K")
    assert {g.quant for g in info.value.candidates} >= {"Q4_K_M", "Q8_0"}


def test_same_quant_as_root_file_and_folder_is_ambiguous() -> None:
    groups = group_quants([F("M-Q4_K_M.gguf"), F("Q4_K_M/M-Q4_K_M-00001-of-00002.gguf"), F("Q4_K_M/M-Q4_K_M-00002-of-00002.gguf")])
    with pytest.raises(AmbiguousQuant) as info:
        select_quant(groups, "q4_k_m")
    assert sorted(g.first.path for g in info.value.candidates) == ["M-Q4_K_M.gguf", "Q4_K_M/M-Q4_K_M-00001-of-00002.gguf"]


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(104_200_000_000) == "104.2 GB"
    assert format_bytes(253_113_024) == "253.1 MB"
