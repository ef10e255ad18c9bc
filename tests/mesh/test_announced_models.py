"""What a node tells its tracker of each model it serves: the states of `llama.model_children` on the wire, the
first model first, and what a heartbeat carries."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from support.supervisor_policies import FAST

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.protocol import (
    MAX_MODEL_ALIASES,
    MAX_MODEL_NAME_CHARS,
    ROUTE_HEADER,
    AnnouncedModel,
    HealthReport,
    ModelLoadState,
    NodeAnnouncement,
    RouteClaims,
    RouteHop,
)
from meshnet_gguf.contract.signing import body_sha256, encode_token, public_key_text, tracker_issuer_for
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.child import ChildSpec
from meshnet_gguf.llama.model_children import ModelChildren, ModelState, ModelStatus
from meshnet_gguf.llama.model_set import ModelSet, ModelToServe
from meshnet_gguf.mesh.announced_models import (
    CHILD_STATE_ON_WIRE,
    announced_from_children,
    first_model_first,
    state_reports,
    wire_aliases,
)
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.tracker_link import ServedModel, TrackerLink
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
from meshnet_gguf.node import NodeKeys, build_tracker_link, trust_tracker
from meshnet_gguf.node.mesh import announce_other_models
from meshnet_gguf.prepare.pipeline import NodeSetupError


def status(alias: str, state: ModelState, expected_load_s: float | None = None) -> ModelStatus:
    return ModelStatus(
        alias=alias, state=state, pinned=False, pid=None, requests=0, in_flight=0, idle_s=None,
        expected_load_s=expected_load_s, last_load_s=expected_load_s, loads=0, error=None, memory_bytes=None,
    )  # fmt: skip


def test_every_state_of_a_child_has_a_word_on_the_wire() -> None:
    assert set(CHILD_STATE_ON_WIRE) == set(get_args(ModelState))
    assert set(CHILD_STATE_ON_WIRE.values()) <= set(get_args(ModelLoadState))


def test_children_are_announced_loaded_loadable_with_their_load_time_or_unavailable() -> None:
    described = {"big:Q4_K_M": AnnouncedModel(model_id="big:Q4_K_M", aliases=["big"], quant="Q4_K_M", slots=2)}
    children = [
        status("big:Q4_K_M", "loaded", 12.5), status("small", "unloaded", 0.4), status("mid", "loading"),
        status("gone", "unloading", 1.0), status("broken", "failed"),
    ]  # fmt: skip
    announced = announced_from_children(children, described)
    assert [(m.model_id, m.state, m.expected_load_s) for m in announced] == [
        ("big:Q4_K_M", "loaded", 12.5), ("small", "loadable", 0.4), ("mid", "loadable", None),
        ("gone", "loadable", 1.0), ("broken", "unavailable", None),
    ]  # fmt: skip
    assert announced[0].aliases == ["big"] and announced[0].quant == "Q4_K_M" and announced[0].slots == 2
    assert [(r.model_id, r.state) for r in state_reports(announced)] == [(m.model_id, m.state) for m in announced]


def test_a_failed_model_is_unavailable_until_its_retry_is_due_then_loadable_so_a_request_can_try_it(tmp_path: Path) -> None:
    now = [1000.0]
    model = ModelToServe(path=write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(seed=1, name="m")), alias="m", context=512)
    children = ModelChildren(
        ModelSet.checked([model]), lambda m: ChildSpec(BinaryInfo(tmp_path / "llama-server"), m.llama_args()), FAST, tmp_path,
        failed_retry_s=600.0, clock=lambda: now[0],
    )  # fmt: skip
    assert children.status()[0].retry_in_s is None  # never failed
    entry = children._entries["m"]  # a load that failed, as `load` records one (the real failure is llama/'s tests)
    entry.error, entry.failed_at = "unknown model architecture", now[0]
    now[0] += 60
    (failed,) = children.status()
    assert failed.state == "failed" and failed.retry_in_s == pytest.approx(540.0)
    assert announced_from_children([failed])[0].state == "unavailable"
    now[0] += 540
    (due,) = children.status()
    assert due.retry_in_s == 0 and announced_from_children([due])[0].state == "loadable"


def test_a_state_the_wire_has_no_word_for_is_never_routed_on_a_guess() -> None:
    odd = SimpleNamespace(alias="odd", state="hibernating", expected_load_s=None, retry_in_s=None)
    assert announced_from_children([odd])[0].state == "unavailable"


def test_the_announced_list_puts_the_nodes_first_model_first_and_never_loses_it() -> None:
    served = ServedModel(model_id="big", total_layers=2, model_aliases=("big-q4",), quant="Q4_K_M")
    assert [(m.model_id, m.state, m.aliases) for m in served.announced()] == [("big", "loaded", ["big-q4"])]
    more = ServedModel(
        model_id="big", total_layers=2,
        models=lambda: [AnnouncedModel(model_id="small", state="loadable"), AnnouncedModel(model_id="big")],
    )  # fmt: skip
    assert [m.model_id for m in more.announced()] == ["big", "small"]
    assert [m.model_id for m in first_model_first([AnnouncedModel(model_id="small")], AnnouncedModel(model_id="big"))] == ["big", "small"]
    announcement = NodeAnnouncement(
        node_id="n", public_key="k", advertised_url="http://127.0.0.1:1", model_id="big", first_layer=0, last_layer=1,
        total_layers=2, slots=1, node_version="t", models=more.announced(),
    )  # fmt: skip
    assert announcement.served_as("small") is not None


def test_an_alias_the_contract_would_refuse_is_left_out_and_the_node_still_announces() -> None:
    served = ServedModel(model_id="big", total_layers=2, model_aliases=("big-q4", "odd\x07name.gguf", "x" * (MAX_MODEL_NAME_CHARS + 1)))
    (only,) = served.announced()
    assert only.aliases == ["big-q4"]
    assert wire_aliases([f"a{i}" for i in range(MAX_MODEL_ALIASES + 5)]) == [f"a{i}" for i in range(MAX_MODEL_ALIASES)]


def tracker_link_for(state_dir: Path, served: ServedModel) -> tuple[TrackerLink, Callable[[str], dict[str, str]]]:
    """A tracker link as the node builds it (its route gate trusting a tracker key made here), and a maker of that
    tracker's routes to it, one per model."""
    tracker = Ed25519PrivateKey.generate()
    settings = NodeSettings(
        state_dir=state_dir, tracker="http://127.0.0.1:9", tracker_public_key=public_key_text(tracker.public_key()),
        advertised_url="http://127.0.0.1:1",
    )  # fmt: skip
    identity = NodeIdentity.load_or_create(state_dir)
    link = build_tracker_link(
        settings, NodeKeys(identity, trust_tracker(settings)), served, lambda: HealthReport(state="ready"), lambda: ([], None)
    )

    def route_for(model: str) -> dict[str, str]:
        now = int(time.time())
        claims = RouteClaims(
            iss=tracker_issuer_for(tracker.public_key()), sub=identity.node_id, jti=f"req-{model}", iat=now, exp=now + 30,
            path="/v1/chat/completions", model=model, hops=[RouteHop(node_id=identity.node_id, first_layer=0, last_layer=1)],
            body_sha256=body_sha256(b"{}"),
        )  # fmt: skip
        return {ROUTE_HEADER: encode_token(claims.model_dump(), tracker)}

    return link, route_for


def test_the_nodes_route_gate_passes_a_route_for_each_announced_model_and_no_other(tmp_path: Path) -> None:
    served = ServedModel(
        model_id="big", total_layers=2, models=lambda: [AnnouncedModel(model_id="small", state="loadable", expected_load_s=1.0)]
    )
    link, route_for = tracker_link_for(tmp_path, served)
    try:
        for model in ("big", "small"):
            assert link.route_gate.check_token(route_for(model), "/v1/chat/completions").request_id == f"req-{model}"
        with pytest.raises(ApiError) as refused:
            link.route_gate.check_token(route_for("third"), "/v1/chat/completions")
        assert refused.value.code == "route_wrong_model"
    finally:
        link.ledger.close()


def test_a_node_of_several_models_announces_its_children_beside_its_first_and_its_gate_passes_their_routes(tmp_path: Path) -> None:
    models = ModelSet.checked(
        [
            ModelToServe(path=write_tiny_model(tmp_path / f"{name}.gguf", TinyModelSpec(seed=seed, name=name)), alias=name,
                         context=512, slots=slots)
            for name, seed, slots in (("small", 1, 1), ("mid", 2, 3))
        ]
    )  # fmt: skip
    children = ModelChildren(models, lambda m: ChildSpec(BinaryInfo(tmp_path / "llama-server"), m.llama_args()), FAST, tmp_path)
    launch: Any = SimpleNamespace(others=SimpleNamespace(models=models), settings=SimpleNamespace(parallel=2))
    link, route_for = tracker_link_for(tmp_path / "node", ServedModel(model_id="big", total_layers=2, slots=2))
    try:
        announce_other_models(link, launch, children)
        announced = link.model.announced()
        assert [(m.model_id, m.state, m.slots, m.ctx_size) for m in announced] == [
            ("big", "loaded", 2, None), ("small", "loadable", 1, 512), ("mid", "loadable", 3, 512),
        ]  # fmt: skip
        assert link.model.slots == 2 + 1 + 3  # the node's slots: every model's
        for model in ("big", "small", "mid"):
            assert link.route_gate.check_token(route_for(model), "/v1/chat/completions").request_id == f"req-{model}"
        announce_other_models(link, SimpleNamespace(others=None, settings=launch.settings), None)  # one model: nothing changes
        assert [m.model_id for m in link.model.announced()] == ["big", "small", "mid"]
        clash: Any = SimpleNamespace(others=SimpleNamespace(models=[SimpleNamespace(alias="BIG", quant_label=None, context=512, slots=1)]),
                                     settings=launch.settings)  # fmt: skip
        with pytest.raises(NodeSetupError, match="answer to 'BIG'"):  # two models one name: refused at start, not at registration
            announce_other_models(link, clash, SimpleNamespace(status=lambda: [status("BIG", "unloaded")]))  # type: ignore[arg-type]
        assert [m.model_id for m in link.model.announced()] == ["big", "small", "mid"]
    finally:
        link.ledger.close()
