from __future__ import annotations

import time
from pathlib import Path

import gguf
import pytest

from meshnet_gguf.models.gguf_info import GGUFError, check_shard_set, read_gguf_info, total_bytes
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model


def test_reads_the_facts_the_plan_needs(tiny_gguf: Path) -> None:
    info = read_gguf_info(tiny_gguf)
    assert (info.architecture, info.block_count, info.head_count, info.head_count_kv) == ("llama", 2, 4, 2)
    assert (info.embedding_length, info.context_length, info.head_dim_k, info.head_dim_v) == (64, 2048, 16, 16)
    assert (info.split_index, info.split_count, info.version) == (0, 1, 3)


def test_agrees_with_the_gguf_package_reader(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "q8.gguf", TinyModelSpec(weight_type="Q8_0", n_layers=3))
    ours = read_gguf_info(path)
    reference = gguf.GGUFReader(str(path))
    assert ours.tensor_count == len(reference.tensors)
    for key, field in reference.fields.items():
        if key.startswith("GGUF.") or len(field.types) > 1:
            continue
        assert ours.metadata[key] == pytest.approx(field.contents()), key


def test_split_set_is_checked_as_a_whole(tiny_split_gguf: Path, tmp_path: Path) -> None:
    shards = sorted(tiny_split_gguf.parent.glob("tiny-*.gguf"))
    assert len(shards) == 3
    first = check_shard_set(shards)
    assert first.path == tiny_split_gguf and first.split_count == 3
    assert total_bytes(shards) == sum(p.stat().st_size for p in shards)
    with pytest.raises(GGUFError, match="3 shards but 2 were found"):
        check_shard_set(shards[:2])
    with pytest.raises(GGUFError, match="do not form 1..3"):
        check_shard_set([shards[0], shards[1], shards[1]])


def test_truncated_and_foreign_files_are_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:-100])
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf_info(cut)
    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(tiny_gguf.read_bytes()[:300])
    with pytest.raises(GGUFError, match="cut|truncated"):
        read_gguf_info(header_cut)
    html = tmp_path / "error-page.gguf"
    html.write_text("<html>502 Bad Gateway</html>")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf_info(html)


def test_big_vocabularies_are_skipped_not_decoded(gemma_gguf: Path) -> None:
    started = time.perf_counter()
    info = read_gguf_info(gemma_gguf)
    assert time.perf_counter() - started < 1.0  # gguf.GGUFReader needs 10-15 s for gemma's 262k tokens
    assert info.architecture == "gemma3" and info.block_count == 18
    assert "tokenizer.ggml.tokens" not in info.metadata
