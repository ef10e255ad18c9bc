"""The announcement's model list (docs/protocol.md, section 3.3): backward compatible both ways, bounded, and
refusing a bad name with a clear error."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from meshnet_gguf.contract.protocol import (
    MAX_ANNOUNCED_MODELS,
    MAX_MODEL_ALIASES,
    MAX_MODEL_NAME_CHARS,
    NodeAnnouncement,
    NodeLoad,
    model_name_problem,
)

BASE: dict[str, Any] = {
    "node_id": "n", "public_key": "k", "advertised_url": "http://127.0.0.1:1", "model_id": "demo:Q4_K_M",
    "model_aliases": ["demo"], "quant": "Q4_K_M", "first_layer": 0, "last_layer": 1, "total_layers": 2, "slots": 2,
    "ctx_size": 4096, "node_version": "t",
}  # fmt: skip


def test_an_announcement_without_a_list_serves_its_one_model_loaded() -> None:
    old = NodeAnnouncement.model_validate_json(json.dumps(BASE))
    (only,) = old.served_models()
    assert (only.model_id, only.aliases, only.quant, only.state, only.ctx_size) == ("demo:Q4_K_M", ["demo"], "Q4_K_M", "loaded", 4096)
    assert old.answers_to("DEMO") and not old.answers_to("other")


def test_a_tracker_that_predates_the_list_reads_the_first_model_as_before() -> None:
    class OldAnnouncement(BaseModel):  # the fields an old tracker reads, ignoring the rest as every wire model does
        model_config = ConfigDict(extra="ignore")
        model_id: str
        model_aliases: list[str]

    new = NodeAnnouncement(**BASE, models=[{"model_id": "demo:Q4_K_M", "aliases": ["demo"]}, {"model_id": "tiny", "state": "loadable"}])
    old = OldAnnouncement.model_validate_json(new.model_dump_json())
    assert (old.model_id, old.model_aliases) == ("demo:Q4_K_M", ["demo"])


def test_the_limits_are_named_and_enforced() -> None:
    at_limit = [{"model_id": "demo:Q4_K_M"}, *({"model_id": f"m{i}"} for i in range(MAX_ANNOUNCED_MODELS - 1))]
    assert len(NodeAnnouncement(**BASE, models=at_limit).served_models()) == MAX_ANNOUNCED_MODELS
    with pytest.raises(ValidationError, match="at most"):
        NodeAnnouncement(**BASE, models=[*at_limit, {"model_id": "one-more"}])
    with pytest.raises(ValidationError, match="at most"):
        NodeAnnouncement(**{**BASE, "model_aliases": [f"a{i}" for i in range(MAX_MODEL_ALIASES + 1)]})
    with pytest.raises(ValidationError, match="at most"):
        NodeLoad(slots_total=1, models=[{"model_id": f"m{i}", "state": "loaded"} for i in range(MAX_ANNOUNCED_MODELS + 1)])


@pytest.mark.parametrize(
    ("name", "problem"),
    [("", "1 to"), ("x" * (MAX_MODEL_NAME_CHARS + 1), "1 to"), ("a\x00b", "printable"), (" demo", "no space"), ("a\u202eb", "printable")],
)
def test_a_bad_model_name_is_refused_saying_why(name: str, problem: str) -> None:
    assert problem in (model_name_problem(name) or "")
    with pytest.raises(ValidationError, match=problem):
        NodeAnnouncement(**BASE, models=[{"model_id": "demo:Q4_K_M", "aliases": [name]}])


def test_names_as_nodes_name_models_are_accepted() -> None:
    for name in ("demo:Q4_K_M", "unsloth/DeepSeek-V4-Flash-GGUF:UD-IQ3_XXS", "My Model-Q4_K_M.gguf", "x" * MAX_MODEL_NAME_CHARS):
        assert model_name_problem(name) is None
