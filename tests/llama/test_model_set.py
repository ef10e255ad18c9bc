"""A node's set of models is checked before anything is launched: every problem named, with its model."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnet_gguf.llama.model_set import MAX_ALIAS_CHARS, MAX_MODELS, MIN_IDLE_UNLOAD_S, ModelSet, ModelSetError, ModelToServe


def _model(tmp_path: Path, alias: str, **kw: object) -> ModelToServe:
    path = tmp_path / f"{alias.replace(':', '_').replace('/', '_')}-Q4_K_M.gguf"
    path.write_bytes(b"GGUF")
    return ModelToServe(path=path, alias=alias, context=kw.pop("context", 2048), **kw)  # type: ignore[arg-type]


def test_a_good_set_is_kept_in_order_and_found_by_alias_without_case(tmp_path: Path) -> None:
    big, small = _model(tmp_path, "big", pinned=True), _model(tmp_path, "small", idle_unload_s=60.0)
    models = ModelSet.checked([big, small])
    assert models.aliases == ["big", "small"]
    assert models.get("SMALL") is small and models.get("other") is None
    assert models.pinned == [big]
    assert big.quant_label == "Q4_K_M"
    assert not big.unloads_when_idle and small.unloads_when_idle
    assert small.llama_args() == ["--model", str(small.path), "--alias", "small", "--ctx-size", "2048", "--parallel", "1"]


def test_every_problem_of_every_model_is_named(tmp_path: Path) -> None:
    missing = ModelToServe(path=tmp_path / "gone.gguf", alias="gone", context=2048)
    bad = [
        missing,
        _model(tmp_path, "a b", context=10, slots=0, idle_unload_s=MIN_IDLE_UNLOAD_S / 2),
        _model(tmp_path, "twin"),
        _model(tmp_path, "TWIN"),
        _model(tmp_path, "planned", memory_bytes=0),
    ]
    with pytest.raises(ModelSetError) as raised:
        ModelSet.checked(bad)
    text = str(raised.value)
    for expected in ("gone: ", "no such file", "alias 'a b'", "context 10", "slots 0", "idle unload after", "TWIN: two models", "memory 0"):
        assert expected in text


def test_an_empty_set_and_too_many_models_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSetError, match="no model"):
        ModelSet.checked([])
    with pytest.raises(ModelSetError, match=f"at most {MAX_MODELS}"):
        ModelSet.checked([_model(tmp_path, f"m{i}") for i in range(MAX_MODELS + 1)])


def test_aliases_are_names_as_the_node_gives_them_never_paths(tmp_path: Path) -> None:
    named = _model(tmp_path, "unsloth/Qwen3-8B-GGUF:Q4_K_M")
    assert ModelSet.checked([named]).get("UNSLOTH/qwen3-8b-gguf:q4_k_m") is named
    for bad in ("../x", "/etc/passwd", "a" * (MAX_ALIAS_CHARS + 1), "two words", ""):
        with pytest.raises(ModelSetError, match="alias"):
            ModelSet.checked([ModelToServe(path=named.path, alias=bad, context=2048)])
