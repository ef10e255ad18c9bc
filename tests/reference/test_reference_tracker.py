"""The reference tracker over real loopback HTTP in front of nodes built from the real node parts
(proxy, route gate, signed ledger, outbox, presence, control proof) and the fake llama-server.
The real llama-server end to end is in test_e2e_meshnet.py; the attacks on the tracker's trust
rules (docs/protocol.md, "What a tracker must check") are in test_tracker_trust.py."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from meshnet_gguf.common.ports import free_local_port as free_port
from meshnet_gguf.contract.protocol import WELL_KNOWN_PATH, NodeAnnouncement, NodeLoad, UsageRecord
from meshnet_gguf.contract.signing import parse_public_key
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.tracker_client import NodeUnknown, TrackerClient, TrackerRefused
from meshnet_gguf.reference.tracker.metering import COMPLETION_SLACK_TOKENS
from meshnet_gguf.reference.tracker.node_address import NodeTarget
from meshnet_gguf.reference.tracker.registry import NodeRegistry
from meshnet_gguf.reference.relay.server import Relay
from meshnet_gguf.reference.relay.config import RelayConfig
from meshnet_gguf.reference.tracker.relay_dialer import RelayedNodeTarget
from meshnet_gguf.reference.tracker.app import Tracker
from meshnet_gguf.reference.tracker.config import TrackerConfig
from support.loopback import serve_asgi
from support.mesh_node import MODEL, FakeLlama, MeshNode
from support.mesh_tracker import HEALTH_POLL_S, HEARTBEAT_S, SECRET, models, start_tracker, wait_until
from support.relay_harness import running_relay

pytestmark = pytest.mark.anyio


@pytest.fixture
def llama(tmp_path: Path) -> Iterator[FakeLlama]:
    fake = FakeLlama(tmp_path, FAKE_LLAMA_TOKENS="8")
    yield fake
    fake.close()


@pytest.fixture
async def tracker(tmp_path: Path) -> AsyncIterator[tuple[Tracker, str]]:
    async with start_tracker(tmp_path) as running:
        yield running


def node(tmp_path: Path, tiny_gguf: Path, llama: FakeLlama, tracker: tuple[Tracker, str], name: str = "n", **kw: Any) -> MeshNode:
    service, url = tracker
    return MeshNode(
        tmp_path / name, tiny_gguf, llama, tracker_url=url, tracker_key=kw.pop("tracker_key", service.public_key_text),
        enrolment_secret=kw.pop("enrolment_secret", SECRET), **kw,
    )  # fmt: skip


def target(url: str = "http://127.0.0.1:1") -> NodeTarget:
    import ipaddress

    return NodeTarget(
        url=url, scheme="http", host="127.0.0.1", port=int(url.rsplit(":", 1)[1]), base_path="", address=ipaddress.ip_address("127.0.0.1")
    )


def test_registry_ttl_selection_and_re_registration() -> None:
    now = [0.0]
    registry = NodeRegistry(ttl_s=3.0, clock=lambda: now[0])

    def announce(node_id: str, **over: Any) -> NodeAnnouncement:
        fields = dict(
            node_id=node_id, public_key="k", advertised_url="http://127.0.0.1:1", model_id=MODEL,
            first_layer=0, last_layer=1, total_layers=2, slots=2, node_version="t", state="online",
        )  # fmt: skip
        return NodeAnnouncement(**{**fields, **over})

    a, _ = registry.register(announce("a", advertised_url="http://127.0.0.1:1"), target("http://127.0.0.1:1"))
    b, _ = registry.register(announce("b", advertised_url="http://127.0.0.1:2"), target("http://127.0.0.1:2"))
    assert registry.pick(MODEL) is None  # not health-checked yet
    a.healthy = b.healthy = True
    a.in_flight = 1
    assert registry.pick(MODEL) is b  # least busy
    # A node restarting re-registers: relays still running keep counting on the same entry.
    again, displaced = registry.register(announce("a", advertised_url="http://127.0.0.1:3"), target("http://127.0.0.1:3"))
    assert again is a and a.in_flight == 1 and displaced == []
    assert not a.healthy  # the new announcement is polled before it gets routes
    now[0] = 2.0
    registry.heartbeat("b", "online", NodeLoad(slots_total=2))
    now[0] = 4.0
    # Online and healthy, but silent past the TTL: not routable, and `/v1/nodes` says so before the sweep drops it.
    a.healthy = True
    assert a.state == "online" and registry.is_routable(b) and not registry.is_routable(a)
    assert (registry.silent_s(a), registry.silent_s(b)) == (4.0, 2.0)
    assert registry.expire() == ["a"] and registry.pick(MODEL) is b
    assert registry.pick(MODEL, exclude={"b"}) is None


async def test_well_known_key_is_persisted_and_pinnable(tmp_path: Path) -> None:
    with closing(Tracker(TrackerConfig(state_dir=tmp_path, open_enrolment=True))) as first:
        with closing(Tracker(TrackerConfig(state_dir=tmp_path, open_enrolment=True))) as again:
            assert first.public_key_text == again.public_key_text and first.issuer == again.issuer
        port = free_port()
        async with serve_asgi(first.app(), port, lifespan="on"), httpx.AsyncClient() as http:
            info = (await http.get(f"http://127.0.0.1:{port}{WELL_KNOWN_PATH}")).json()
    assert info["public_key"] == first.public_key_text and info["issuer"] == first.issuer
    parse_public_key(info["public_key"])


async def test_the_tracker_fixture_closes_its_ledger(tmp_path: Path) -> None:
    async with start_tracker(tmp_path) as (service, _url):
        assert await service.ledger.usage("none") is None
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        await service.ledger.usage("none")


async def test_registration_is_authenticated(tracker, tmp_path: Path, tiny_gguf: Path, llama: FakeLlama) -> None:
    service, url = tracker
    mesh = node(tmp_path, tiny_gguf, llama, tracker)
    announcement = mesh.link._announcement()
    async with mesh.running(), httpx.AsyncClient() as http:
        await wait_until(lambda: _true(service.registry.get(mesh.node_id) is not None))
        wrong_secret = TrackerClient(url, mesh.link.identity, enrolment_secret="guess", audience=service.issuer, http=http)
        with pytest.raises(TrackerRefused) as info:
            await wrong_secret.register(announcement)
        assert (info.value.status, info.value.code) == (401, "bad_enrolment_secret")

        # Someone else's key claiming this node's id: the id must derive from the key it signs with.
        impostor = NodeIdentity.load_or_create(tmp_path / "impostor")
        forged = TrackerClient(url, impostor, enrolment_secret=SECRET, audience=service.issuer, http=http)
        with pytest.raises(TrackerRefused) as info:
            await forged.register(announcement)
        assert info.value.code == "bad_node_auth"
        with pytest.raises(TrackerRefused) as info:
            await forged.register(announcement.model_copy(update={"public_key": impostor.public_key_text}))
        assert info.value.code == "node_id_mismatch"

        partial = announcement.model_copy(update={"last_layer": 0})
        with pytest.raises(TrackerRefused) as info:
            await mesh.link.client.register(partial)
        assert info.value.code == "partial_coverage_unsupported"

        ack = await mesh.link.client.register(announcement)
        assert ack.node_id == mesh.node_id and ack.issuer == service.issuer
        assert ack.ttl_s == pytest.approx(3 * HEARTBEAT_S)

        # Heartbeats are signed too: another key cannot speak for this node.
        stranger = TrackerClient(url, impostor, audience=service.issuer, http=http)
        stranger.identity = NodeIdentity(impostor.private_key, mesh.node_id, impostor.public_key_text)
        with pytest.raises(TrackerRefused) as info:
            await stranger.heartbeat("online", NodeLoad(slots_total=1))
        assert info.value.code == "bad_node_auth"


async def test_routable_only_when_online_and_healthy_and_dropped_after_ttl(
    tracker, tmp_path: Path, tiny_gguf: Path, llama: FakeLlama
) -> None:
    service, url = tracker
    mesh = node(tmp_path, tiny_gguf, llama, tracker)
    mesh.state = "loading"
    async with mesh.running(), httpx.AsyncClient() as http:
        await wait_until(lambda: _true(service.registry.get(mesh.node_id) is not None))
        await anyio.sleep(0.5)
        assert await models(http, url) == []  # registered while loading: not routable
        mesh.state = "ready"
        await wait_until(lambda: _eq(models(http, url), [MODEL]))
        mesh.state = "draining"
        await wait_until(lambda: _eq(models(http, url), []))
        mesh.state = "ready"
        await wait_until(lambda: _eq(models(http, url), [MODEL]))
        # The node goes silent (heartbeats stop): dropped after ~3 periods.
        mesh.link.presence._client = TrackerClient("http://127.0.0.1:9", mesh.link.identity)  # port 9: nothing listens
        await wait_until(lambda: _true(service.registry.get(mesh.node_id) is None), timeout=5)


async def test_node_re_registers_after_the_tracker_forgets_it(tracker, tmp_path: Path, tiny_gguf: Path, llama: FakeLlama) -> None:
    service, url = tracker
    mesh = node(tmp_path, tiny_gguf, llama, tracker)
    async with mesh.running(), httpx.AsyncClient() as http:
        await wait_until(lambda: _eq(models(http, url), [MODEL]))
        service.registry.remove(mesh.node_id)  # as after a tracker restart
        with pytest.raises(NodeUnknown):
            await mesh.link.client.heartbeat("online", NodeLoad(slots_total=1))
        await wait_until(lambda: _eq(models(http, url), [MODEL]))


async def test_a_relayed_node_stays_reachable_when_its_registration_outlasts_a_node_watch(
    tracker, tmp_path: Path, tiny_gguf: Path, llama: FakeLlama, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The node watch (every HEALTH_POLL_S) closes each relayed way in that is not registered. A
    # registration whose ledger write takes longer than that (a slow disk) must not have its new
    # node's tunnels closed under it: that left the node registered, healthy and unreachable.
    service, url = tracker
    remember_node = service.ledger.remember_node

    async def slow_remember_node(node_id: str, public_key: str) -> None:
        await anyio.sleep(HEALTH_POLL_S * 3)
        await remember_node(node_id, public_key)

    monkeypatch.setattr(service.ledger, "remember_node", slow_remember_node)
    relay = Relay(RelayConfig(port=0, trusted_tracker_keys=(service.public_key_text,)))
    async with running_relay(relay) as relay_url:
        mesh = node(tmp_path, tiny_gguf, llama, tracker, relay_url=relay_url)
        async with mesh.running(), httpx.AsyncClient(timeout=10) as http:
            await wait_until(lambda: _eq(models(http, url), [MODEL]))
            await anyio.sleep(HEALTH_POLL_S * 2)  # more node watches, now with the node registered
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            for _ in range(3):
                answer = await http.post(url + "/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
            held = service.registry.get(mesh.node_id)
            assert held is not None and isinstance(held.target, RelayedNodeTarget) and held.target.relay.url == relay_url


async def test_relay_streams_unbuffered_through_the_real_proxy_and_both_ledgers_agree(tracker, tmp_path: Path, tiny_gguf: Path) -> None:
    service, url = tracker
    slow = FakeLlama(tmp_path, FAKE_LLAMA_TOKENS="5", FAKE_LLAMA_TOKEN_DELAY_S="0.3")
    mesh = node(tmp_path, tiny_gguf, slow, tracker)
    try:
        async with mesh.running(), httpx.AsyncClient(timeout=10) as http:
            await wait_until(lambda: _eq(models(http, url), [MODEL]))
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                started = anyio.current_time()
                chunks = response.aiter_raw()
                first = await chunks.__anext__()
                first_at = anyio.current_time() - started
                rest = b"".join([c async for c in chunks])
                total = anyio.current_time() - started
            # The first token reached the client while the fake llama-server was still generating.
            assert b'"content":"x"' in first and first_at < total - 0.6, (first_at, total)
            assert rest.endswith(b"data: [DONE]\n\n") and b": meshnet-usage " in rest
            rid = response.headers["x-meshnet-request-id"]
            plain = await http.post(url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3})
            assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 3

            for request_id in (rid, plain.headers["x-meshnet-request-id"]):
                await wait_until(lambda: _agreement(http, url, request_id, "agree"))
            usage = (await http.get(f"{url}/v1/usage/{rid}")).json()
            assert usage["node"] == usage["billed"] == {"prompt_tokens": 7, "completion_tokens": 5}
            # The tracker's own count: the five content events it forwarded (the route capped it at 5 too); no prompt tokens.
            assert usage["tracker"] == {"prompt_tokens": None, "completion_tokens": 5}
            assert usage["ceiling"]["completion_tokens"] == min(5, 5 + COMPLETION_SLACK_TOKENS) and usage["ceiling"]["prompt_tokens"] >= 7
            assert usage["outcome"] == "complete" and usage["node_id"] == mesh.node_id and not usage["flagged"]
            assert (await http.get(f"{url}/v1/usage/req-nope")).status_code == 404
    finally:
        slow.close()


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n_predict"])
async def test_the_node_proxy_caps_each_token_limit_to_the_route(field: str, tmp_path: Path, tiny_gguf: Path, llama: FakeLlama) -> None:
    # The tracker's cap (3) is below what the client asks (50), so only the node's own cap on the
    # body it forwards keeps llama-server to the route's limit.
    async with start_tracker(tmp_path, max_tokens_cap=3) as tracker:
        service, url = tracker
        mesh = node(tmp_path, tiny_gguf, llama, tracker)
        async with mesh.running(), httpx.AsyncClient(timeout=10) as http:
            await wait_until(lambda: _eq(models(http, url), [MODEL]))
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: 50}
            answer = await http.post(url + "/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            [forwarded] = llama.forwarded()
            assert forwarded[field] == 3 and forwarded["max_tokens"] == 3
            assert answer.json()["usage"]["completion_tokens"] == 3


async def test_receipts_must_match_a_route_this_tracker_issued_to_that_node(
    tracker, tmp_path: Path, tiny_gguf: Path, llama: FakeLlama
) -> None:
    service, url = tracker
    a, b = node(tmp_path, tiny_gguf, llama, tracker, "a"), node(tmp_path, tiny_gguf, llama, tracker, "b")
    async with a.running(), b.running(), httpx.AsyncClient(timeout=10) as http:
        await wait_until(lambda: _true(len(service.registry.routable(MODEL)) == 2))
        answer = await http.post(
            url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        )
        rid = answer.headers["x-meshnet-request-id"]
        served_by, other = (a, b) if service.registry.get(a.node_id).routed else (b, a)

        def receipt(mesh: MeshNode, request_id: str):  # type: ignore[no-untyped-def]
            rec = UsageRecord(request_id=request_id, route="/v1/chat/completions", model=MODEL, status=200, stream=False, started_at=0)
            return mesh.link.identity.sign_receipt(rec)

        ack = await other.link.client.send_receipts([receipt(other, rid), receipt(other, "req-invented")])
        assert {r.request_id: r.code for r in ack.rejected} == {rid: "wrong_node", "req-invented": "unknown_request"}
        forged = receipt(other, rid).model_copy(update={"token": receipt(other, rid).token[:-4] + "AAAA"})
        ack = await served_by.link.client.send_receipts([forged])
        assert [r.code for r in ack.rejected] == ["bad_signature"]


async def test_least_busy_node_gets_the_next_request(tracker, tmp_path: Path, tiny_gguf: Path) -> None:
    service, url = tracker
    # The held stream lasts 40 x 0.25 s, far longer than the two requests after it take on a loaded box (with 8
    # tokens it could end meanwhile, and the busy node be idle again by the second).
    slow = FakeLlama(tmp_path, FAKE_LLAMA_TOKENS="40", FAKE_LLAMA_TOKEN_DELAY_S="0.25")
    a, b = node(tmp_path, tiny_gguf, slow, tracker, "a"), node(tmp_path, tiny_gguf, slow, tracker, "b")
    try:
        async with a.running(), b.running(), httpx.AsyncClient(timeout=10) as http:
            await wait_until(lambda: _true(len(service.registry.routable(MODEL)) == 2))
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as held:
                held_chunks = held.aiter_raw()  # keep a reference: a dropped iterator closes the stream
                await held_chunks.__anext__()
                busy = a if a.slots.in_flight else b
                idle = b if busy is a else a
                for _ in range(2):
                    answer = await http.post(url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1})
                    assert answer.status_code == 200
                assert service.registry.get(idle.node_id).routed == 2 and service.registry.get(busy.node_id).routed == 1
    finally:
        slow.close()


async def test_client_disconnect_closes_the_node_stream(tracker, tmp_path: Path, tiny_gguf: Path) -> None:
    service, url = tracker
    slow = FakeLlama(tmp_path, FAKE_LLAMA_TOKENS="50", FAKE_LLAMA_TOKEN_DELAY_S="0.1")
    mesh = node(tmp_path, tiny_gguf, slow, tracker)
    try:
        async with mesh.running(), httpx.AsyncClient(timeout=10) as http:
            await wait_until(lambda: _eq(models(http, url), [MODEL]))
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                await response.aiter_raw().__anext__()
                rid = response.headers["x-meshnet-request-id"]
            await wait_until(lambda: _outcome(http, url, rid, "cancelled"))
            # The node saw its client (the tracker) go: its own record says cancelled, well short of 50.
            await wait_until(lambda: _true(mesh.slots.in_flight == 0), timeout=5)
            await wait_until(lambda: _has_receipt(http, url, rid))
            usage = (await http.get(f"{url}/v1/usage/{rid}")).json()
            assert usage["node_finish_reason"] == "cancelled" and usage["node"]["completion_tokens"] < 50
    finally:
        slow.close()


async def test_no_ready_node_gets_503_with_retry_after(tracker, tmp_path: Path, tiny_gguf: Path, llama: FakeLlama) -> None:
    service, url = tracker
    mesh = node(tmp_path, tiny_gguf, llama, tracker)
    mesh.state = "loading"  # registered and known, but not routable
    async with mesh.running(), httpx.AsyncClient(timeout=10) as http:
        await wait_until(lambda: _true(service.registry.get(mesh.node_id) is not None))
        answer = await http.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_node_available"
        assert answer.headers["retry-after"] == str(max(1, int(HEARTBEAT_S)))


async def test_unknown_model_or_bad_body_are_refused_plainly(tracker) -> None:
    service, url = tracker
    async with httpx.AsyncClient(timeout=10) as http:
        missing = await http.post(url + "/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        bad = await http.post(url + "/v1/chat/completions", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        nomodel = await http.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert nomodel.status_code == 400


async def test_node_without_its_trackers_key_refuses_with_503_route_key_unavailable(
    tmp_path: Path, tiny_gguf: Path, llama: FakeLlama
) -> None:
    # No key pinned and the tracker (a loopback port nothing listens on) cannot be asked for it.
    dead = f"http://127.0.0.1:{free_port()}"
    mesh = MeshNode(tmp_path / "n", tiny_gguf, llama, tracker_url=dead, tracker_key=None, enrolment_secret=None)
    async with mesh.running(), httpx.AsyncClient(timeout=10) as http:
        answer = await http.post(mesh.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "route_key_unavailable"
        assert int(answer.headers["retry-after"]) >= 1
        assert llama.forwarded() == []


async def _true(value: bool) -> bool:
    return value


async def _eq(awaitable, expected) -> bool:  # type: ignore[no-untyped-def]
    return await awaitable == expected


async def _agreement(http: httpx.AsyncClient, url: str, rid: str, expected: str) -> bool:
    response = await http.get(f"{url}/v1/usage/{rid}")
    return response.status_code == 200 and response.json()["agreement"] == expected


async def _outcome(http: httpx.AsyncClient, url: str, rid: str, expected: str) -> bool:
    response = await http.get(f"{url}/v1/usage/{rid}")
    return response.status_code == 200 and response.json()["outcome"] == expected


async def _has_receipt(http: httpx.AsyncClient, url: str, rid: str) -> bool:
    response = await http.get(f"{url}/v1/usage/{rid}")
    return response.status_code == 200 and response.json()["node"] is not None


async def test_a_node_that_refuses_the_connection_is_marked_down_and_the_request_goes_elsewhere(
    tracker, tmp_path: Path, tiny_gguf: Path, llama: FakeLlama, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's listener gone while the tracker still routes to it (a crash between two health
    polls): the connection is refused, the node never saw the request, so the tracker marks it down
    and tries another; with none left the client gets 503, not the tracker's own error."""
    import dataclasses

    service, url = tracker
    mesh = node(tmp_path, tiny_gguf, llama, tracker)
    async with mesh.running(), httpx.AsyncClient(timeout=10) as http:
        await wait_until(lambda: _eq(models(http, url), [MODEL]))
        entry = service.registry.get(mesh.node_id)
        assert entry is not None and entry.target.scheme == "http"  # forwarded with the lean client
        monkeypatch.setattr(service, "_poll_health", _no_poll)  # the refusal, not a health poll, marks it down
        entry.target = dataclasses.replace(entry.target, port=free_port())  # nothing listens there
        answer = await http.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_node_available"
        assert entry.healthy is False
        [tried] = await service.ledger.usage_list(limit=1)
        assert (tried.node_id, tried.outcome) == (mesh.node_id, "refused")  # recorded as never seen by the node


async def _no_poll(entry: Any) -> None:
    return None
