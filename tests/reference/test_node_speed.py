"""The tracker's speed estimate and its pick rule, with plain numbers (no node, no clock)."""

from __future__ import annotations

from ipaddress import ip_address

import pytest

from meshnet_gguf.contract.protocol import NodeAnnouncement, NodeCapability, NodeLoad, RatePoint
from meshnet_gguf.reference.tracker.node_address import NodeTarget
from meshnet_gguf.reference.tracker.node_speed import (
    BUSY_SLOT_PENALTY,
    CLAIM_FLAG_FACTOR,
    TRUST_AFTER_SAMPLES,
    NodeSpeed,
    StreamSample,
    expected_ttft_s,
    rate_at,
)
from meshnet_gguf.reference.tracker.registry import NodeEntry, NodeRegistry

MODEL = "tiny"


def claim(prefill: float, decode: float) -> NodeCapability:
    return NodeCapability(
        prefill_tokens_per_s=[RatePoint(ctx_tokens=100, tokens_per_s=prefill), RatePoint(ctx_tokens=1000, tokens_per_s=prefill / 2)],
        decode_tokens_per_s=[RatePoint(ctx_tokens=100, tokens_per_s=decode), RatePoint(ctx_tokens=1000, tokens_per_s=decode / 2)],
    )


def stream(
    prompt: int = 100, ttft: float = 0.1, busy: int = 0, tokens: int = 20, decode_s: float = 0.2, concurrency: float = 1.0
) -> StreamSample:
    return StreamSample(
        prompt_tokens=prompt, ttft_s=ttft, busy_before=busy, decode_tokens=tokens, decode_s=decode_s, concurrency=concurrency
    )


def test_a_claimed_rate_is_interpolated_between_its_points_and_held_beyond_them() -> None:
    points = claim(1000, 100).prefill_tokens_per_s
    assert rate_at(points, 10) == 1000 and rate_at(points, 5000) == 500
    assert rate_at(points, 550) == pytest.approx(750)
    assert rate_at([], 10) is None


def test_the_claim_is_used_until_enough_streams_are_measured_then_the_measurement() -> None:
    speed = NodeSpeed(claim(prefill=1000, decode=100))
    assert speed.ttft_s(100) == pytest.approx(0.1)  # 100 tokens at the claimed 1,000 tokens/s
    assert speed.ttft_s(100, overhead_floor_s=0.05) == pytest.approx(0.15)  # plus what other nodes cost besides
    for _ in range(TRUST_AFTER_SAMPLES - 1):
        speed.record(stream(prompt=100, ttft=0.5))
        # The claim, read with the 0.4 s this node's streams took beyond it (the way there, its checks).
        assert speed.ttft_s(200) == pytest.approx(200 / rate_at(claim(1000, 100).prefill_tokens_per_s, 200) + 0.4)
    speed.record(stream(prompt=100, ttft=0.5))
    assert speed.trusted and speed.ttft_s(100) == pytest.approx(0.5)
    assert speed.ttft_s(200) == pytest.approx(1.0)  # per prompt token, as measured


def test_a_sample_taken_under_load_is_read_as_the_idle_time_it_implies() -> None:
    speed = NodeSpeed()
    speed.record(stream(prompt=100, ttft=0.1 * (1 + 2 * BUSY_SLOT_PENALTY), busy=2))
    assert speed.ttft_s(100) == pytest.approx(0.1)  # a node without a claim uses what it has
    assert expected_ttft_s(speed, 100, busy=1) == pytest.approx(0.1 * (1 + BUSY_SLOT_PENALTY))
    assert expected_ttft_s(NodeSpeed(), 100, busy=0) is None


def test_a_node_claiming_ten_times_its_decode_rate_is_flagged_after_n_streams_and_an_honest_one_never() -> None:
    liar, honest = NodeSpeed(claim(prefill=1000, decode=1000)), NodeSpeed(claim(prefill=1000, decode=100))
    for i in range(TRUST_AFTER_SAMPLES):
        assert not liar.flagged
        for speed in (liar, honest):
            speed.record(stream(tokens=20, decode_s=0.2))  # 100 tokens/s delivered
    assert liar.flagged and liar.summary()["claim_flagged"] is True
    assert liar.summary()["decode_delivered_of_claim"] == pytest.approx(0.1)
    assert not honest.flagged
    # Busy with three streams, each at a third of the rate: the node still delivers its claim.
    busy = NodeSpeed(claim(prefill=1000, decode=100))
    for _ in range(TRUST_AFTER_SAMPLES * 2):
        busy.record(stream(tokens=20, decode_s=0.6, concurrency=3))
    assert not busy.flagged
    assert 1 / CLAIM_FLAG_FACTOR < 1  # the factor is a ceiling on the claim, not a floor


def test_too_short_a_stream_times_its_first_token_but_not_its_decode() -> None:
    speed = NodeSpeed(claim(prefill=1000, decode=1000))
    for _ in range(TRUST_AFTER_SAMPLES * 2):
        speed.record(stream(tokens=1, decode_s=0.001))
    assert speed.samples == TRUST_AFTER_SAMPLES * 2 and speed.decode_samples == 0 and not speed.flagged


def test_a_new_claim_from_a_restarted_llama_server_forgets_what_was_measured() -> None:
    speed = NodeSpeed(claim(prefill=1000, decode=100))
    for _ in range(TRUST_AFTER_SAMPLES):
        speed.record(stream(ttft=0.5))
    speed.set_claim(claim(prefill=1000, decode=100))  # the same claim, polled again: nothing changes
    assert speed.trusted
    speed.set_claim(claim(prefill=4000, decode=400))
    assert speed.samples == 0 and speed.ttft_s(100) == pytest.approx(0.025)


# --- the pick rule -------------------------------------------------------------


PORTS = {"fast": 1, "slow": 2, "a": 3, "b": 4, "new": 5, "prefill": 6, "decode": 7}


def target(url: str) -> NodeTarget:
    return NodeTarget(
        url=url, scheme="http", host="127.0.0.1", port=int(url.rsplit(":", 1)[1]), base_path="", address=ip_address("127.0.0.1")
    )


def announce(node_id: str, slots: int = 2, capability: NodeCapability | None = None) -> NodeAnnouncement:
    return NodeAnnouncement(
        node_id=node_id, public_key="k", advertised_url=f"http://127.0.0.1:{PORTS[node_id]}", model_id=MODEL, first_layer=0,
        last_layer=1, total_layers=2, slots=slots, node_version="t", state="online", capability=capability,
    )  # fmt: skip


def registry_of(*announcements: NodeAnnouncement) -> tuple[NodeRegistry, dict[str, NodeEntry]]:
    registry = NodeRegistry(ttl_s=1e9, clock=lambda: 0.0)
    entries = {}
    for ann in announcements:
        entry, _ = registry.register(ann, target(ann.advertised_url))
        entry.healthy = True
        entries[ann.node_id] = entry
    return registry, entries


def test_a_measured_node_is_compared_with_an_unmeasured_claim_like_for_like() -> None:
    # The fast node's streams took 0.1 s beyond its claimed prefill (the way there and back): a slow
    # node not measured yet is assumed to cost that much besides its claim too, not nothing.
    registry, nodes = registry_of(announce("fast", capability=claim(10_000, 500)), announce("slow", capability=claim(1_000, 50)))
    for _ in range(TRUST_AFTER_SAMPLES):
        nodes["fast"].speed.record(stream(prompt=100, ttft=0.11))
    assert nodes["fast"].speed.overhead_s == pytest.approx(0.1)
    assert registry.pick(MODEL, prompt_tokens=100) is nodes["fast"]  # 0.11 s against 0.1 + 0.1 s


def test_the_fastest_node_with_a_free_slot_is_picked_and_a_full_one_spills_to_the_next() -> None:
    registry, nodes = registry_of(announce("fast", capability=claim(10_000, 500)), announce("slow", capability=claim(1_000, 50)))
    assert registry.pick(MODEL) is nodes["fast"]
    nodes["fast"].in_flight = 1  # busy, but ten times faster: still the sooner first token
    assert registry.pick(MODEL) is nodes["fast"]
    nodes["fast"].in_flight = 2  # full: the next best
    assert registry.pick(MODEL) is nodes["slow"]
    nodes["slow"].in_flight = 2  # all full: the fastest, whose slot frees soonest
    assert registry.pick(MODEL) is nodes["fast"]
    assert registry.pick(MODEL, exclude={"fast"}) is nodes["slow"]  # the retry contract holds
    assert registry.pick(MODEL, exclude={"fast", "slow"}) is None


def test_a_heartbeat_that_reports_the_node_full_counts_as_full() -> None:
    registry, nodes = registry_of(announce("fast", capability=claim(10_000, 500)), announce("slow", capability=claim(1_000, 50)))
    nodes["fast"].load = NodeLoad(slots_total=2, slots_busy=2)  # traffic from elsewhere
    assert registry.pick(MODEL) is nodes["slow"]


def test_equal_nodes_share_the_work_and_unmeasured_ones_take_the_overflow() -> None:
    registry, nodes = registry_of(announce("a", capability=claim(1_000, 50)), announce("b", capability=claim(1_000, 50)), announce("new"))
    first = registry.pick(MODEL)
    assert first is not None
    first.in_flight = 1
    second = registry.pick(MODEL)
    assert second is not None and {first.node_id, second.node_id} == {"a", "b"}  # the idle one of two equals
    nodes["a"].in_flight = nodes["b"].in_flight = 2
    assert registry.pick(MODEL) is nodes["new"]  # unknown speed: the overflow, until measured


def test_nodes_without_any_figure_are_picked_as_before_least_busy_then_least_routed() -> None:
    registry, nodes = registry_of(announce("a"), announce("b"))
    nodes["a"].routed = 3
    assert registry.pick(MODEL) is nodes["b"]
    nodes["b"].in_flight = 1
    assert registry.pick(MODEL) is nodes["a"]


def test_a_prompt_long_enough_makes_the_faster_prefill_win_even_when_it_is_busier() -> None:
    registry, nodes = registry_of(
        announce("prefill", slots=4, capability=claim(20_000, 50)), announce("decode", slots=4, capability=claim(4_000, 500))
    )
    nodes["prefill"].in_flight = 3
    assert registry.pick(MODEL, prompt_tokens=2_000) is nodes["prefill"]


def test_a_restarted_node_keeps_no_stale_estimate() -> None:
    registry, nodes = registry_of(announce("a", capability=claim(1_000, 50)))
    for _ in range(TRUST_AFTER_SAMPLES):
        nodes["a"].speed.record(stream(ttft=5.0))
    assert nodes["a"].speed.trusted
    again, _ = registry.register(announce("a", capability=claim(1_000, 50)), nodes["a"].target)
    assert again is nodes["a"] and again.speed.samples == 0 and not again.speed.trusted


def test_a_heartbeat_counts_this_trackers_own_requests_once_and_only_the_rest_as_traffic_from_elsewhere() -> None:
    registry, nodes = registry_of(announce("a", slots=4), announce("b", slots=4))
    a = nodes["a"]
    nodes["b"].routed = 1  # on equal load a wins: what decides below is load alone
    a.in_flight = 1  # our request to a is running when a's heartbeat is sent: a counts it busy
    registry.heartbeat("a", "online", NodeLoad(slots_total=4, slots_busy=1))
    assert a.busy() == 1 and registry.pick(MODEL) is nodes["b"]  # one request, not two
    a.in_flight = 0  # it ended; the heartbeat that counted it is still the latest
    assert a.busy() == 0 and registry.pick(MODEL) is a
    assert a.slots_busy() == 0  # what the tracker's page shows
    registry.heartbeat("a", "online", NodeLoad(slots_total=4, slots_busy=2))  # two requests from another tracker
    a.in_flight = 1
    assert a.busy() == 3 and registry.pick(MODEL) is nodes["b"]
    assert a.slots_busy() == 3
