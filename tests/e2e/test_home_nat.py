"""The relay on a volunteer's real links: a node behind a home router's NAT that forgets mappings, and a
slow, lossy link (tests/support/home_network.py: namespaces, MASQUERADE with strict conntrack, user-space
netem wires). Tracker and relay are real processes on the router's far side, each node a real
`meshnet-gguf serve --relay` in the home namespace in front of the fake llama-server, the client in a
namespace of its own.

What a real NAT does that a veth does not: it forgets (a router reboot, a carrier NAT's sweep: `conntrack
-F`), and then drops that connection's packets in both directions without a reset, so neither end hears
that its tunnel is gone. Before TCP keep-alive and a user timeout on the tunnel's sockets
(`contract/relay_keepalive`), an idle node came back 15-23 s after such a drop and a stream cut by it left
its client without a byte or an error for minutes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.home_mesh import HomeMesh, MeshOptions, StreamResult, print_logs, start_home_mesh
from support.home_network import HomeNetwork
from support.relay_processes import wait_for

from meshnet_gguf.contract.relay_keepalive import NOTICED_WITHIN_S
from meshnet_gguf.mesh.relay_link import RECONNECT_MAX_S

pytestmark = [pytest.mark.slow]

# After the node noticed: a reconnect's backoff starts at 0.25 s, then the dial and attach (a few round trips),
# and a loaded 2-core machine's scheduling. The first reconnect is never RECONNECT_MAX_S away.
RECONNECT_SLACK_S = 3.0
assert RECONNECT_SLACK_S < RECONNECT_MAX_S  # the bound below means "the first try", not "some try"
# The tracker polls a node's health every 0.5 s in these tests (support.relay_processes): it routes to a
# reconnected node after its next poll, and a couple of polls more on a loaded machine.
ROUTABLE_AGAIN_S = 5.0
# A home router that forgets an established TCP mapping idle this long (some carrier NATs). The keep-alive
# (KEEPALIVE_IDLE_S on the control connection, IDLE_WORK_KEEPALIVE_S on idle work connections) keeps them.
NAT_IDLE_TIMEOUT_S = 30
# The slow fake llama-server of the mid-stream test: the flush lands at the fifth event, long before the end.
SLOW_STREAM = {"FAKE_LLAMA_TOKEN_DELAY_S": "0.2", "FAKE_LLAMA_TOKENS": "200"}
FAST_STREAM = {"FAKE_LLAMA_TOKENS": "400"}
# The netem of issue 43: 40 ms each way, 1 % loss, some reordering, on the node's link and the client's.
HOME_LINK = {"delay_ms": 40, "jitter_ms": 5, "loss": 0.01, "reorder": 0.02}


@pytest.fixture
def home_mesh(tmp_path: Path, tiny_gguf: Path) -> Iterator[HomeMesh]:
    why = HomeNetwork.missing()
    if why:
        pytest.skip(why)
    # The relay pings at its default interval, as a real one does: the keep-alive, not a short test ping, must
    # notice the drop.
    mesh_gen = start_home_mesh(tmp_path, tiny_gguf.stem, MeshOptions(nat_idle_timeout_s=NAT_IDLE_TIMEOUT_S, relay_ping_interval_s=10.0))
    mesh = next(mesh_gen)
    try:
        yield mesh
    finally:
        print_logs(mesh)
        for _ in mesh_gen:  # the generator's cleanup: processes by PID, then the namespaces by name
            pass


def _node(mesh: HomeMesh, tiny_gguf: Path, fake_llama_path: Path, env: dict[str, str]):  # type: ignore[no-untyped-def]
    node = mesh.add_node(tiny_gguf, fake_llama_path, env)
    node.wait_ready()
    mesh.wait_routable(1)
    return node


def _connects(node) -> int:  # type: ignore[no-untyped-def]
    link = node.relay_link()
    return -1 if link is None else int(link["connects"])


def test_a_node_whose_nat_forgets_it_while_idle_is_back_within_its_keepalive_bound_and_serves_the_next_request(
    home_mesh: HomeMesh, tiny_gguf: Path, fake_llama_path: Path
) -> None:
    mesh = home_mesh
    node = _node(mesh, tiny_gguf, fake_llama_path, {"FAKE_LLAMA_TOKENS": "4"})
    assert mesh.stream(4).ok

    # Idle past the router's timeout for an idle mapping: the keep-alive keeps the tunnel's mapping alive, so the
    # tunnel is the same one and serves at once.
    before = _connects(node)
    time.sleep(NAT_IDLE_TIMEOUT_S + 5)
    assert _connects(node) == before, node.relay_link()
    assert mesh.stream(4).ok

    # The router forgets everything at once (a reboot): nobody is told. The node notices within its bound,
    # reconnects, and the next request goes through.
    assert mesh.net.nat_mappings() > 0
    mesh.net.flush_nat()
    dropped = time.monotonic()
    wait_for(lambda: _connects(node) > before and node.relay_link()["state"] == "attached",
             "the node to notice the dead tunnel and attach again", mesh.logs(), NOTICED_WITHIN_S + RECONNECT_SLACK_S)  # fmt: skip
    back_after = time.monotonic() - dropped
    print(f"reconnected {back_after:.1f} s after the NAT forgot the tunnel (bound {NOTICED_WITHIN_S} + {RECONNECT_SLACK_S} s)")
    # Routable on a heartbeat sent since the flush: one from before it lapses within the TTL.
    mesh.wait_routable(1, timeout=ROUTABLE_AGAIN_S, heard_since=dropped)
    result = mesh.stream(4)
    assert result.ok, result


def test_a_stream_whose_nat_mapping_is_dropped_ends_with_an_error_event_in_seconds_and_both_ledgers_agree(
    home_mesh: HomeMesh, tiny_gguf: Path, fake_llama_path: Path
) -> None:
    mesh = home_mesh
    node = _node(mesh, tiny_gguf, fake_llama_path, SLOW_STREAM)
    flushed: list[float] = []

    def drop_mid_stream(event: int) -> None:
        if event == 5 and not flushed:
            mesh.net.flush_nat()
            flushed.append(time.monotonic())

    result = mesh.stream(200, on_event=drop_mid_stream)
    assert flushed, result
    heard_after = time.monotonic() - flushed[0]
    print(f"the client's stream ended {heard_after:.1f} s after the drop: {result.error_event}")
    # An OpenAI-style error event, not a hang and not a bare EOF: SDK clients raise on it.
    assert result.status == 200 and result.transport_error is None, result
    assert result.error_event is not None and result.error_event["code"] == "upstream_broken", result
    assert not result.done
    assert heard_after < NOTICED_WITHIN_S + RECONNECT_SLACK_S
    assert result.request_id is not None
    _assert_ledgers_agree(mesh, node, {result.request_id})


def _assert_ledgers_agree(mesh: HomeMesh, node, must_hold: set[str]) -> None:  # type: ignore[no-untyped-def]
    """Every request the node's ledger holds, the tracker holds with the node's receipt, figure for figure, and
    bills within its own ceiling; nothing is billed that the node did not run."""

    def settled() -> bool:
        ledger = node.ledger()
        return must_hold <= set(ledger) and all(row["reported"] for row in ledger.values())

    wait_for(settled, "the node's receipts to be acknowledged", mesh.logs(), timeout=60)
    ledger = node.ledger()
    usage = {u["request_id"]: u for u in mesh.usage()}
    receipted = {rid for rid, u in usage.items() if u["node"] is not None}
    assert receipted == set(ledger), (receipted ^ set(ledger), usage, ledger)
    for rid, row in ledger.items():
        u = usage[rid]
        assert (u["node"]["prompt_tokens"], u["node"]["completion_tokens"]) == (row["prompt"], row["completion"]), (u, row)
        # Billed: the receipt, capped by what the tracker saw go by (protocol section 11, T8).
        assert u["billed"] == {k: min(u["node"][k], u["ceiling"][k]) for k in ("prompt_tokens", "completion_tokens")}, u


def test_on_a_slow_lossy_link_streams_arrive_byte_identical_the_relay_adds_one_round_trip_and_nothing_flaps(
    home_mesh: HomeMesh, tiny_gguf: Path, fake_llama_path: Path
) -> None:
    mesh = home_mesh
    node = _node(mesh, tiny_gguf, fake_llama_path, FAST_STREAM)

    # On clean links first: the reference bytes, and the first-token times to compare with.
    reference = mesh.stream(400)
    assert reference.ok, reference
    clean_kept = _first_token_times(mesh, kept=True)
    clean_fresh = _first_token_times(mesh, kept=False)

    # The node's link only: what the relay path adds per round trip of the node's latency.
    delay_s = 0.1
    mesh.net.node_link.set(delay_ms=delay_s * 1000)
    rtt = 2 * delay_s
    slow_kept = _first_token_times(mesh, kept=True)
    slow_fresh = _first_token_times(mesh, kept=False)
    added_kept = (_median(slow_kept) - _median(clean_kept)) / rtt
    added_fresh = (_median(slow_fresh) - _median(clean_fresh)) / rtt
    print(f"round trips of the node's link before the first token: {added_kept:.2f} on a kept tunnel, {added_fresh:.2f} on a new one")
    # A kept tunnel: the request and its first bytes, one round trip, the least any path to the node can take.
    assert 0.7 < added_kept < 1.5, (clean_kept, slow_kept)
    # A new tunnel: the node's TLS handshake, one more (the work connection waits at the relay already, so no
    # TCP handshake to the node and no attach is on this path).
    assert 1.6 < added_fresh < 2.5, (clean_fresh, slow_fresh)

    # Both links as a home user's: slow, lossy, reordered. Streams come through whole, byte for byte.
    mesh.net.node_link.set(**HOME_LINK)
    mesh.net.client_link.set(**HOME_LINK)
    connects = _connects(node)
    state_changes = _tracker_node_log_lines(mesh)
    started = time.monotonic()
    for _ in range(6):
        result = mesh.stream(400)
        assert result.ok, result
        assert _without_request_id(result.body) == _without_request_id(reference.body)
    # Heartbeats (1 s here) and health polls (0.5 s) went on through it all: no flap, no reconnect.
    while time.monotonic() - started < 10:
        time.sleep(1)
    assert _connects(node) == connects, node.relay_link()
    assert _tracker_node_log_lines(mesh) == state_changes, _tracker_node_log_lines(mesh)[len(state_changes) :]
    assert mesh.routable_nodes() == 1


def _first_token_times(mesh: HomeMesh, *, kept: bool, count: int = 5) -> list[float]:
    """First-token times of streamed requests: back to back (the tracker's tunnel to the node is kept), or each
    after the tracker let its idle tunnel go (RELAYED_IDLE_TTL_S, 2 s): a new CONNECT and TLS handshake each."""
    times = []
    mesh.stream(4)  # warms (or opens) the path under the link's new settings
    for _ in range(count):
        if not kept:
            time.sleep(2.6)
        result: StreamResult = mesh.stream(4)
        assert result.ok and result.first_token_s is not None, result
        times.append(result.first_token_s)
    return times


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _without_request_id(body: bytes) -> bytes:
    return re.sub(rb'"request_id":"[^"]+"', b'"request_id":"-"', body)


def _tracker_node_log_lines(mesh: HomeMesh) -> list[str]:
    """The tracker's log lines that say a node changed: dropped, registered, healthy or not, state moves."""
    pattern = re.compile(r"missed its heartbeats|registered|is (not )?healthy|-> (online|joining|draining)|forgot")
    lines = mesh.tracker.log_path.read_text(errors="replace").splitlines()
    return [line for line in lines if pattern.search(line)]
