"""The chaos soak, short: a minute of random kills (tracker, relay, a node, a llama-server), NAT flushes and
link changes under steady client load, then the ledgers, the client's view and every process's descriptors and
memory checked (tests/support/chaos.py). `bench/soak_chaos.py` runs the same for 30 minutes and more."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.chaos import Chaos, ChaosConfig, chaos_node_env
from support.home_mesh import HomeMesh, MeshOptions, print_logs, start_home_mesh
from support.home_network import HomeNetwork

pytestmark = [pytest.mark.slow]

# The chaos itself; with the set-up, the recovery and the receipts' settling the test takes about two minutes.
CHAOS_S = 60.0
# An action every 2-4 s: about twenty in the minute, so each kind comes up a few times.
ACTION_EVERY_S = (2.0, 4.0)
NODES = 2


@pytest.fixture
def mesh(tmp_path: Path, tiny_gguf: Path, fake_llama_path: Path) -> Iterator[HomeMesh]:
    why = HomeNetwork.missing()
    if why:
        pytest.skip(why)
    mesh_gen = start_home_mesh(tmp_path, tiny_gguf.stem, MeshOptions(nat_idle_timeout_s=30))
    mesh = next(mesh_gen)
    try:
        for _ in range(NODES):
            mesh.add_node(tiny_gguf, fake_llama_path, chaos_node_env())
        for node in mesh.nodes:
            node.wait_ready()
        mesh.wait_routable(NODES)
        yield mesh
    finally:
        print_logs(mesh)
        for _ in mesh_gen:  # the generator's cleanup: processes by PID, then the namespaces by name
            pass


def test_a_minute_of_kills_nat_flushes_and_bad_links_loses_no_billing_and_leaves_no_client_hanging(mesh: HomeMesh, tmp_path: Path) -> None:
    chaos = Chaos(mesh, ChaosConfig(duration_s=CHAOS_S, action_every_s=ACTION_EVERY_S, seed=43), tmp_path / "chaos-events.jsonl")
    try:
        report = chaos.run()
    finally:
        chaos.close()
    print(report.summary())
    assert report.completed > 0 and sum(report.actions.values()) >= 10, report.summary()
    assert report.problems == [], report.summary()
