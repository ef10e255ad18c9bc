"""The node's keys, settled once per run in the mesh wing: the node's own key (read in one place) and the
tracker key it trusts (the first-contact check), and the pool's status tokens issued by one function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import HealthReport
from meshnet_gguf.contract.signing import TokenRefused
from meshnet_gguf.llama.rpc_status import check_status_token
from meshnet_gguf.mesh.identity import NODE_KEY_FILE
from meshnet_gguf.mesh.ledger import LEDGER_FILE
from meshnet_gguf.mesh.tracker_link import MeshSetupError, ServedModel
from meshnet_gguf.node import NodeKeys, build_tracker_link, existing_node_key, node_key, node_keys, pool_status_tokens, trust_tracker
from meshnet_gguf.prepare.pipeline import NodeSetupError

PACKAGE = Path(__file__).parents[2] / "src" / "meshnet_gguf"
# (what is called, the module that may call it): the node key file's readers, the status-token recipe.
ONE_PLACE = {
    "NodeIdentity.load_or_create": "node/mesh.py",
    "NodeIdentity.load": "node/mesh.py",
    "status_token": "node/pool.py",
}


def _calls(path: Path) -> set[str]:
    """`Name.attr` and `name` of every call in a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                found.add(f"{func.value.id}.{func.attr}")
            elif isinstance(func, ast.Name):
                found.add(func.id)
    return found


def test_the_key_file_is_read_and_pool_tokens_are_issued_in_one_place_each() -> None:
    callers: dict[str, list[str]] = {name: [] for name in ONE_PLACE}
    for path in PACKAGE.rglob("*.py"):
        relative = str(path.relative_to(PACKAGE))
        for name in _calls(path) & ONE_PLACE.keys():
            callers[name].append(relative)
    assert callers == {name: [place] for name, place in ONE_PLACE.items()}


def test_unsafe_first_contact_is_refused_before_a_key_is_made(tmp_path: Path) -> None:
    # TEST-NET over plain http, no key pinned: a man in the middle would hand the node its own tracker key.
    settings = NodeSettings(state_dir=tmp_path / "state", tracker="http://192.0.2.10:8000", advertised_url="http://127.0.0.1:1")
    with pytest.raises(NodeSetupError, match="MESHNET_TRACKER_PUBLIC_KEY"):
        node_keys(settings)
    assert not (tmp_path / "state" / NODE_KEY_FILE).exists()
    # A dry run starts no link: it checks nothing, and needs no key without a pool.
    assert node_keys(settings, dry_run=True) is None


def test_the_keys_of_a_run_are_one_key_and_the_trust_its_tracker_link_is_built_on(tmp_path: Path) -> None:
    settings = NodeSettings(state_dir=tmp_path / "state", tracker="http://127.0.0.1:9", advertised_url="http://127.0.0.1:1")
    keys = node_keys(settings)
    assert keys is not None and keys.tracker is not None and keys.tracker.pinned is None  # learnt on first contact
    assert existing_node_key(settings).node_id == keys.identity.node_id == node_key(settings).node_id  # type: ignore[union-attr]
    link = build_tracker_link(
        settings, keys, ServedModel(model_id="m", total_layers=2), lambda: HealthReport(state="ready"), lambda: ([], None)
    )
    link.ledger.close()


def test_a_tracker_link_is_never_built_around_the_first_contact_check(tmp_path: Path) -> None:
    """The check lives in `trust_tracker`; the link refuses keys that skipped it or were settled for another tracker."""
    settings = NodeSettings(state_dir=tmp_path / "state", tracker="http://192.0.2.10:8000", advertised_url="http://127.0.0.1:1")
    identity = node_key(NodeSettings(state_dir=tmp_path / "other"))
    loopback = NodeSettings(state_dir=tmp_path / "state", tracker="http://127.0.0.1:9", advertised_url="http://127.0.0.1:1")

    def link(keys: NodeKeys) -> None:
        build_tracker_link(
            settings, keys, ServedModel(model_id="m", total_layers=2), lambda: HealthReport(state="ready"), lambda: ([], None)
        )

    for unchecked in (NodeKeys(identity), NodeKeys(identity, trust_tracker(loopback))):
        with pytest.raises(MeshSetupError):
            link(unchecked)
    assert not (tmp_path / "state" / LEDGER_FILE).exists()


def test_the_pool_status_token_is_the_nodes_and_no_other_keys(tmp_path: Path) -> None:
    node = node_key(NodeSettings(state_dir=tmp_path / "node"))
    stranger = node_key(NodeSettings(state_dir=tmp_path / "stranger"))
    check_status_token(pool_status_tokens(node)(), node.public_key)
    with pytest.raises(TokenRefused):
        check_status_token(pool_status_tokens(stranger)(), node.public_key)
