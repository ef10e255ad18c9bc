"""Registration describes a LAN pool behind the node (workers, memory, plan) and never where its workers are."""

from __future__ import annotations

from pathlib import Path

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import HealthReport, NodeAnnouncement, PoolDescription, PoolHealth, PoolWorkerHealth
from meshnet_gguf.mesh.tracker_link import ServedModel
from meshnet_gguf.node import build_tracker_link, node_keys
from meshnet_gguf.prepare.pool import PoolMember, PoolShare, parse_pool_worker, shares_line


def test_the_announcement_carries_the_pools_size_and_plan_without_addresses(tmp_path: Path) -> None:
    members = [
        PoolMember(parse_pool_worker(text), budget, "5.0.0")
        for text, budget in (("10.0.0.2:50052=80G", 80 * 10**9), ("10.0.0.3:50052=60G", 60 * 10**9))
    ]
    shares = [
        PoolShare("RPC0", members[0].spec.endpoint, 80 * 10**9, 70 * 10**9),
        PoolShare("RPC1", members[1].spec.endpoint, 60 * 10**9, 52 * 10**9),
        PoolShare("Vulkan0", "this node", 100 * 10**9, 88 * 10**9),
    ]
    plan = shares_line(shares)
    assert plan.startswith("RPC0 (worker 1) ~70") and "RPC1 (worker 2)" in plan and "Vulkan0 (this node)" in plan
    described = PoolDescription(workers=2, total_bytes=240 * 10**9, plan=plan)
    settings = NodeSettings(tracker="http://127.0.0.1:9", state_dir=tmp_path / "state", tracker_public_key=None)
    keys = node_keys(settings)
    assert keys is not None
    served = ServedModel(model_id="big", total_layers=43, pool=described)
    link = build_tracker_link(settings, keys, served, lambda: HealthReport(state="ready"), lambda: ([], None))
    wire = link._announcement().model_dump_json()
    heard = NodeAnnouncement.model_validate_json(wire)
    assert heard.pool is not None and (heard.pool.workers, heard.pool.total_bytes) == (2, 240 * 10**9)
    assert "10.0.0.2" not in wire and "10.0.0.3" not in wire and "50052" not in wire


def test_a_node_waiting_for_its_pool_heartbeats_not_ready(tmp_path: Path) -> None:
    """While a worker is away the supervisor says `restarting` (503): the tracker hears `joining` and routes elsewhere."""
    settings = NodeSettings(tracker="http://127.0.0.1:9", state_dir=tmp_path / "state")
    keys = node_keys(settings)
    assert keys is not None
    away = PoolHealth(workers=[PoolWorkerHealth(name="worker 1", state="away", problem="status unreachable: ConnectError")])
    health = HealthReport(state="restarting", detail="waiting for the pool: worker 1 is away", pool=away)
    link = build_tracker_link(settings, keys, ServedModel(model_id="big", total_layers=43), lambda: health, lambda: ([], None))
    state, _load = link._status()
    assert state == "joining"
