"""The pool behind one node: worker specs, the check before launch, and the pooled plan for a recorded
pair of boxes (a 128 GB and an 80 GB Strix Halo), with the figures worked out by hand."""

from __future__ import annotations

from typing import Any

import pytest

from meshnet_gguf.models.catalog import load_catalog
from meshnet_gguf.prepare.plan import plan_launch
from meshnet_gguf.prepare.pool import (
    PoolError,
    PoolMember,
    PoolWorkerSpec,
    check_pool,
    parse_pool_worker,
    pool_shares,
    pooled_plan,
)
from support.hardware_fixtures import choices, deepseek_facts, fixture_binary, load_box

GIB = 2**30
# The recorded boxes' honest GPU budgets (tests/hardware: carve-out + shared, capped by RAM or by GTT).
NODE_BUDGET = 129_065_631_744  # strix-halo-128: capped by RAM available less the reserve
WORKER_BUDGET = 41_987_080_192  # strix-halo-80: capped by its GTT size


def _argv_value(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_worker_specs_read_host_port_and_an_optional_budget() -> None:
    assert parse_pool_worker("10.0.0.2:50052") == PoolWorkerSpec("10.0.0.2", 50052, None)
    assert parse_pool_worker("10.0.0.2:50052=60G") == PoolWorkerSpec("10.0.0.2", 50052, 60 * 10**9)
    spec = parse_pool_worker("[fd00::2]:50052=58GiB")
    assert (spec.host, spec.budget_bytes, spec.endpoint) == ("fd00::2", 58 * GIB, "[fd00::2]:50052")
    assert spec.status_url == "http://[fd00::2]:50053/status"
    for bad in ("10.0.0.2", "10.0.0.2:port", ":50052", "10.0.0.2:50052=lots"):
        with pytest.raises(ValueError):
            parse_pool_worker(bad)


def _status(**over: Any) -> dict[str, Any]:
    return {"state": "running", "protocol": "5.0.0", "free_bytes": 50 * 10**9, **over}


def test_the_check_refuses_naming_the_worker_that_is_away_on_another_protocol_or_short_of_memory() -> None:
    good, other = PoolWorkerSpec("10.0.0.2", 50052), PoolWorkerSpec("10.0.0.3", 50052, 60 * 10**9)

    def away(spec: PoolWorkerSpec) -> dict[str, Any]:
        if spec is other:
            raise ConnectionRefusedError("connection refused")
        return _status()

    with pytest.raises(PoolError, match=r"10\.0\.0\.3:50052 is not reachable"):
        check_pool([good, other], away, "5.0.0")
    with pytest.raises(PoolError, match=r"10\.0\.0\.2:50052 speaks RPC protocol 4\.0\.0, this node 5\.0\.0"):
        check_pool([good], lambda spec: _status(protocol="4.0.0"), "5.0.0")
    with pytest.raises(PoolError, match=r"10\.0\.0\.3:50052 has 50\.0 GB free, less than its budget 60\.0 GB"):
        check_pool([other], lambda spec: _status(), "5.0.0")
    members = check_pool([good, PoolWorkerSpec("10.0.0.3", 50052, 40 * 10**9)], lambda spec: _status(protocol="5.1.0"), "5.0.0")
    assert [m.budget_bytes for m in members] == [50 * 10**9, 40 * 10**9]  # the reported free memory, or the budget given


def test_which_deepseek_v4_flash_quants_the_128_and_80_gb_pair_can_hold_and_the_split() -> None:
    assert load_box("strix-halo-128").capacity().gpu_bytes == NODE_BUDGET
    assert load_box("strix-halo-80").capacity().gpu_bytes == WORKER_BUDGET
    worker = PoolMember(PoolWorkerSpec("10.0.0.2", 50052), WORKER_BUDGET)
    # By hand: KV cache at the least context (4 slots x 4,096 tokens = 16,384 tokens) is
    # 43 layers x 1 head x (512 + 512) x 2 B = 88,064 B per token -> 1,442,840,576 B.
    kv = 88_064 * 16_384
    assert kv == 1_442_840_576
    pool = NODE_BUDGET + WORKER_BUDGET
    assert pool == 171_052_711_936
    # Each member takes weights + KV in proportion to its budget, plus 2 GiB of its own compute buffers:
    # the worker's part is 41,987,080,192 / 171,052,711,936 = 24.55 %.
    expected = {
        # quant: (worker's bytes, node's bytes, fits the node alone: weights + KV + 2 GiB <= 129,065,631,744)
        "UD-IQ2_XXS": (21_745_932_057, 62_391_875_815, True),  # 79,842,840,576 B to place
        "UD-IQ3_XXS": (28_078_872_685, 81_858_935_187, True),  # 105,642,840,576 B
        "IQ4_XS": (35_884_590_203, 105_853_217_669, False),  # 137,442,840,576 B; alone 139,590,324,224 B
        "UD-Q4_K_XL": (41_358_410_978, 122_679_396_894, False),  # 159,742,840,576 B; alone 161,890,324,224 B
    }
    entry = load_catalog().get("deepseek-v4-flash")
    assert entry is not None and [q.name for q in entry.quants] == list(expected)
    for quant in entry.quants:
        to_place = quant.total_bytes + kv
        worker_share, node_share = pool_shares([worker], "Vulkan0", NODE_BUDGET, to_place)
        assert (worker_share.device, node_share.device) == ("RPC0", "Vulkan0")  # RPC devices come first
        assert (worker_share.bytes, node_share.bytes) == expected[quant.name][:2], quant.name
        assert worker_share.fits and node_share.fits, quant.name  # every featured quant fits the pair
        assert (to_place + 2 * GIB <= NODE_BUDGET) == expected[quant.name][2], quant.name


def test_the_pooled_plan_for_ud_q4_k_xl_on_the_pair() -> None:
    plan = plan_launch(deepseek_facts("UD-Q4_K_XL"), load_box("strix-halo-128"), choices(), fixture_binary())
    assert not plan.fits  # alone, the 128 GB box cannot hold it
    worker = PoolMember(PoolWorkerSpec("10.0.0.2", 50052), WORKER_BUDGET)
    pooled = pooled_plan(plan, [worker], NODE_BUDGET, 158_300_000_000 + 88_064 * plan.ctx_size)
    assert pooled.fits, pooled.describe()
    argv = pooled.argv
    assert _argv_value(argv, "--rpc") == "10.0.0.2:50052"
    assert _argv_value(argv, "--device") == "RPC0,Vulkan0"
    # Budgets in whole megabytes: 41,987,080,192 B -> 41987, 129,065,631,744 B -> 129065.
    assert _argv_value(argv, "--tensor-split") == "41987,129065"
    assert _argv_value(argv, "--cache-ram") == "0" and _argv_value(argv, "--n-gpu-layers") == "999"
    # The local plan's own device, layers and prompt cache are replaced, not repeated.
    assert argv.count("--device") == 1 and argv.count("--n-gpu-layers") == 1 and argv.count("--cache-ram") == 1
    assert "RPC0 (10.0.0.2:50052)" in pooled.describe()


def test_a_pool_too_small_says_which_member_is_short() -> None:
    plan = plan_launch(deepseek_facts("UD-Q4_K_XL"), load_box("strix-halo-80"), choices(), fixture_binary())
    small = PoolMember(PoolWorkerSpec("10.0.0.9", 50052), 20 * 10**9)
    pooled = pooled_plan(plan, [small], WORKER_BUDGET, 158_300_000_000 + 88_064 * plan.ctx_size)
    assert not pooled.fits
    assert any("10.0.0.9:50052" in w and "the pool does not hold the model" in w for w in pooled.warnings)


def test_a_pool_on_a_build_without_rpc_is_refused_before_launch_with_the_fix(tmp_path: Path) -> None:
    from meshnet_gguf.common.settings import NodeSettings
    from meshnet_gguf.llama.binary import BinaryInfo
    from meshnet_gguf.prepare.pipeline import NodeSetupError, check_pool_workers

    no_rpc = BinaryInfo(path=tmp_path / "llama-server", source="test", version="1", build=None, help_text="--port PORT   port\n")
    settings = NodeSettings(gguf="model.gguf", pool_workers=["127.0.0.1:50052=1G"], state_dir=tmp_path / "state")
    with pytest.raises(NodeSetupError, match=r"--pool-worker: .*built without RPC.*meshnet-gguf build-llama-server --force"):
        check_pool_workers(settings, no_rpc, lambda: "token")
