"""The reference tracker over real loopback HTTP, with node-side pieces that are the real ones
(identity, registration, route verification, ledger, outbox) around a canned answerer standing
in for llama-server. The real llama-server end to end is in test_e2e_meshnet.py."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from meshnet_gguf.billing import LedgerUsageSink, OutboxReporter
from meshnet_gguf.identity import NodeIdentity
from meshnet_gguf.ledger import UsageLedger
from meshnet_gguf.reference.registry import NodeRegistry
from meshnet_gguf.reference.tracker import Tracker, TrackerConfig
from meshnet_gguf.protocol import (
    WELL_KNOWN_PATH,
    HealthReport,
    NodeAnnouncement,
    NodeLoad,
    UsageReceipt,
    UsageRecord,
)
from meshnet_gguf.retry import Backoff
from meshnet_gguf.route_auth import RouteRejected, RouteVerifier
from meshnet_gguf.signing import parse_public_key
from meshnet_gguf.tracker_client import NodePresence, NodeUnknown, TrackerClient, TrackerRefused

sys.path.insert(0, str(Path(__file__).parent))
from loopback import serve_asgi  # noqa: E402
from node_process import free_port  # noqa: E402

pytestmark = pytest.mark.anyio
MODEL = "tiny"
SECRET = "enrol-me"
HEARTBEAT_S = 0.3


class FakeNode:
    """A node whose answers are canned but whose mesh side is the real code."""

    def __init__(self, state_dir: Path, tracker_url: str, tracker_key: str, *, slots: int = 2, lie_by: int = 0) -> None:
        self.identity = NodeIdentity.load_or_create(state_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.verifier = RouteVerifier(parse_public_key(tracker_key), node_id=self.identity.node_id, model_id=MODEL, total_layers=2)
        self.ledger = UsageLedger.in_state_dir(state_dir)
        self.client = TrackerClient(tracker_url, self.identity, enrolment_secret=SECRET)
        self.reporter = OutboxReporter(self.ledger, self.client, backoff=Backoff(0.05, 0.2))
        self.sink = LedgerUsageSink(self.ledger, self.identity, self.reporter)
        self.presence = NodePresence(self.client, self.announcement, lambda: (self.state, NodeLoad(slots_total=slots, slots_busy=self.busy)))
        self.slots = slots
        self.state = "online"
        self.busy = 0
        self.served: list[str] = []
        self.cancelled: list[str] = []
        self.gate: anyio.Event | None = None  # when set, streams pause after their first token until it fires
        self.lie_by = lie_by  # added to the completion tokens in the signed receipt

    def announcement(self) -> NodeAnnouncement:
        return NodeAnnouncement(
            node_id=self.identity.node_id, public_key=self.identity.public_key_text, advertised_url=self.url,
            model_id=MODEL, quant="F32", first_layer=0, last_layer=1, total_layers=2, slots=self.slots, node_version="test",
        )  # fmt: skip

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ]
        )

    async def health(self, request: Request) -> Response:
        report = HealthReport(state="ready", model=MODEL, slots_total=self.slots)
        return Response(report.model_dump_json(), media_type="application/json")

    async def chat(self, request: Request) -> Response:
        body = await request.body()
        try:
            claims = self.verifier.verify(request.headers, body, "/v1/chat/completions")
        except RouteRejected as exc:
            return JSONResponse({"error": {"message": exc.message, "code": exc.code}}, exc.status)
        rid = claims.jti
        self.served.append(rid)
        payload = json.loads(body)
        n = min(payload.get("max_tokens") or 4, claims.max_tokens or 4)
        prompt = len(json.dumps(payload["messages"]))
        if not payload.get("stream"):
            await self.record(rid, prompt, n, stream=False)
            answer = {"choices": [{"message": {"content": "x" * n}, "finish_reason": "length"}], "usage": {"prompt_tokens": prompt, "completion_tokens": n}}
            return JSONResponse(answer, headers={"x-meshnet-request-id": rid})
        return StreamingResponse(self.stream(rid, prompt, n), media_type="text/event-stream")

    async def stream(self, rid: str, prompt: int, n: int) -> AsyncIterator[bytes]:
        sent = 0
        try:
            for i in range(n):
                yield b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
                sent += 1
                if i == 0 and self.gate is not None:
                    await self.gate.wait()
                await anyio.sleep(0.01)
            usage = {"prompt_tokens": prompt, "completion_tokens": n}
            yield b': meshnet-usage ' + json.dumps(usage).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        except BaseException:
            self.cancelled.append(rid)
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self.record(rid, prompt, sent, stream=True)

    async def record(self, rid: str, prompt: int, completion: int, stream: bool) -> None:
        await self.sink.record(
            UsageRecord(
                request_id=rid, route="/v1/chat/completions", model=MODEL, status=200, stream=stream,
                prompt_tokens=prompt, completion_tokens=completion + self.lie_by, finish_reason="stop", started_at=0.0,
            )  # fmt: skip
        )

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self.presence.run)
        tg.start_soon(self.reporter.run)


async def wait_until(condition, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not await condition():
            await anyio.sleep(0.03)


@pytest.fixture
async def tracker(tmp_path: Path) -> AsyncIterator[tuple[Tracker, str]]:
    config = TrackerConfig(state_dir=tmp_path / "tracker", enrolment_secret=SECRET, heartbeat_interval_s=HEARTBEAT_S, health_poll_interval_s=0.2)
    service = Tracker(config)
    port = free_port()
    async with serve_asgi(service.app(), port, lifespan="on"):
        yield service, f"http://127.0.0.1:{port}"


async def start_node(tg: anyio.abc.TaskGroup, tmp_path: Path, name: str, tracker_url: str, key: str, **kw: Any) -> FakeNode:
    node = FakeNode(tmp_path / name, tracker_url, key, **kw)
    server_ready = anyio.Event()

    async def serve() -> None:
        async with serve_asgi(node.app(), node.port):
            server_ready.set()
            await anyio.sleep_forever()

    tg.start_soon(serve)
    await server_ready.wait()
    await node.run(tg)
    return node


async def models(http: httpx.AsyncClient, url: str) -> list[str]:
    return [m["id"] for m in (await http.get(url + "/v1/models")).json()["data"]]


def test_registry_ttl_selection_and_re_registration() -> None:
    now = [0.0]
    registry = NodeRegistry(ttl_s=3.0, clock=lambda: now[0])

    def announce(node_id: str, **over: Any) -> NodeAnnouncement:
        fields = dict(
            node_id=node_id, public_key="k", advertised_url="http://127.0.0.1:1", model_id=MODEL,
            first_layer=0, last_layer=1, total_layers=2, slots=2, node_version="t", state="online",
        )  # fmt: skip
        return NodeAnnouncement(**{**fields, **over})

    a, b = registry.register(announce("a")), registry.register(announce("b"))
    assert registry.pick(MODEL) is None  # not health-checked yet
    a.healthy = b.healthy = True
    a.in_flight = 1
    assert registry.pick(MODEL) is b  # least busy
    # A node restarting re-registers: relays still running keep counting on the same entry.
    assert registry.register(announce("a", advertised_url="http://127.0.0.1:2")) is a and a.in_flight == 1
    assert not a.healthy  # the new announcement is polled before it gets routes
    now[0] = 2.0
    registry.heartbeat("b", "online", NodeLoad(slots_total=2))
    now[0] = 4.0
    assert registry.expire() == ["a"] and registry.pick(MODEL) is b
    assert registry.pick(MODEL, exclude={"b"}) is None


async def test_well_known_key_is_persisted_and_pinnable(tmp_path: Path) -> None:
    first = Tracker(TrackerConfig(state_dir=tmp_path))
    again = Tracker(TrackerConfig(state_dir=tmp_path))
    assert first.public_key_text == again.public_key_text and first.issuer == again.issuer
    port = free_port()
    async with serve_asgi(first.app(), port, lifespan="on"), httpx.AsyncClient() as http:
        info = (await http.get(f"http://127.0.0.1:{port}{WELL_KNOWN_PATH}")).json()
    assert info["public_key"] == first.public_key_text and info["issuer"] == first.issuer
    parse_public_key(info["public_key"])


async def test_registration_is_authenticated(tracker, tmp_path: Path) -> None:
    service, url = tracker
    node = FakeNode(tmp_path / "n", url, service.public_key_text)
    async with httpx.AsyncClient() as http:
        wrong_secret = TrackerClient(url, node.identity, enrolment_secret="guess", http=http)
        with pytest.raises(TrackerRefused) as info:
            await wrong_secret.register(node.announcement())
        assert (info.value.status, info.value.code) == (401, "bad_enrolment_secret")

        # Someone else's key claiming this node's id: the id must derive from the key it signs with.
        impostor = NodeIdentity.load_or_create(tmp_path / "impostor")
        forged = TrackerClient(url, impostor, enrolment_secret=SECRET, http=http)
        with pytest.raises(TrackerRefused) as info:
            await forged.register(node.announcement())
        assert info.value.code == "bad_node_auth"
        with pytest.raises(TrackerRefused) as info:
            await forged.register(node.announcement().model_copy(update={"public_key": impostor.public_key_text}))
        assert info.value.code == "node_id_mismatch"

        partial = node.announcement().model_copy(update={"last_layer": 0})
        with pytest.raises(TrackerRefused) as info:
            await node.client.register(partial)
        assert info.value.code == "partial_coverage_unsupported"

        ack = await node.client.register(node.announcement())
        assert ack.node_id == node.identity.node_id and ack.issuer == service.issuer
        assert ack.ttl_s == pytest.approx(3 * HEARTBEAT_S)

        # Heartbeats are signed too: another key cannot speak for this node.
        stranger = TrackerClient(url, impostor, http=http)
        stranger.identity = NodeIdentity(impostor.private_key, node.identity.node_id, impostor.public_key_text)
        with pytest.raises(TrackerRefused) as info:
            await stranger.heartbeat("online", NodeLoad(slots_total=1))
        assert info.value.code == "bad_node_auth"
    await node.client.aclose()
    node.ledger.close()


async def test_routable_only_when_online_and_healthy_and_dropped_after_ttl(tracker, tmp_path: Path) -> None:
    service, url = tracker
    async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:
        node = await start_node(tg, tmp_path, "n", url, service.public_key_text)
        node.state = "joining"
        await wait_until(lambda: _true(service.registry.get(node.identity.node_id) is not None))
        await anyio.sleep(0.5)
        assert await models(http, url) == []  # registered while loading: not routable
        node.state = "online"
        await wait_until(lambda: _eq(models(http, url), [MODEL]))
        node.state = "draining"
        await wait_until(lambda: _eq(models(http, url), []))
        node.state = "online"
        await wait_until(lambda: _eq(models(http, url), [MODEL]))
        # The node goes silent (heartbeats stop): dropped after ~3 periods.
        node.presence._client = TrackerClient("http://127.0.0.1:9", node.identity)  # port 9: nothing listens
        await wait_until(lambda: _true(service.registry.get(node.identity.node_id) is None), timeout=5)
        tg.cancel_scope.cancel()


async def test_node_re_registers_after_the_tracker_forgets_it(tracker, tmp_path: Path) -> None:
    service, url = tracker
    async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:
        node = await start_node(tg, tmp_path, "n", url, service.public_key_text)
        await wait_until(lambda: _eq(models(http, url), [MODEL]))
        service.registry.remove(node.identity.node_id)  # as after a tracker restart
        with pytest.raises(NodeUnknown):
            await node.client.heartbeat("online", NodeLoad(slots_total=1))
        await wait_until(lambda: _eq(models(http, url), [MODEL]))
        tg.cancel_scope.cancel()


async def test_relay_signs_routes_streams_unbuffered_and_both_ledgers_agree(tracker, tmp_path: Path) -> None:
    service, url = tracker
    async with httpx.AsyncClient(timeout=10) as http, anyio.create_task_group() as tg:
        node = await start_node(tg, tmp_path, "n", url, service.public_key_text)
        await wait_until(lambda: _eq(models(http, url), [MODEL]))
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}

        node.gate = anyio.Event()
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            chunks = response.aiter_raw()
            first = await chunks.__anext__()
            # The first token reached us while the node is still holding the rest: nothing buffered.
            assert b'"content":"x"' in first and not node.gate.is_set()
            node.gate.set()
            rest = b"".join([c async for c in chunks])
        assert rest.endswith(b"data: [DONE]\n\n") and b"meshnet-usage" in rest
        [rid] = node.served
        plain = await http.post(url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3})
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 3

        for request_id in node.served:
            await wait_until(lambda: _agreement(http, url, request_id, "agree"))
        usage = (await http.get(f"{url}/v1/usage/{rid}")).json()
        assert usage["tracker"] == usage["node"] and usage["tracker"]["completion_tokens"] == 5
        assert usage["outcome"] == "complete" and usage["node_id"] == node.identity.node_id
        assert (await http.get(f"{url}/v1/usage/req-nope")).status_code == 404
        tg.cancel_scope.cancel()


async def test_route_max_tokens_caps_what_the_node_may_generate(tracker, tmp_path: Path) -> None:
    service, url = tracker
    async with httpx.AsyncClient(timeout=10) as http, anyio.create_task_group() as tg:
        node = await start_node(tg, tmp_path, "n", url, service.public_key_text)
        await wait_until(lambda: _eq(models(http, url), [MODEL]))
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}
        answer = await http.post(url + "/v1/chat/completions", json=body)
        # The fake node generates min(body max_tokens (absent: 4), route max_tokens): the route said 2.
        assert answer.json()["usage"]["completion_tokens"] == 2
        tg.cancel_scope.cancel()


async def test_lying_receipt_is_flagged(tracker, tmp_path: Path) -> None:
    service, url = tracker
    async with httpx.AsyncClient(timeout=10) as http, anyio.create_task_group() as tg:
        node = await start_node(tg, tmp_path, "n", url, service.public_key_text, lie_by=7)
        await wait_until(lambda: _eq(models(http, url), [MODEL]))
        await http.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [], "max_tokens": 2})
        [rid] = node.served
        await wait_until(lambda: _agreement(http, url, rid, "mismatch"))
        usage = (await http.get(f"{url}/v1/usage/{rid}")).json()
        assert usage["node"]["completion_tokens"] == usage["tracker"]["completion_tokens"] + 7
        tg.cancel_scope.cancel()


async def test_receipts_must_match_a_route_this_tracker_issued_to_that_node(tracker, tmp_path: Path) -> None:
    service, url = tracker
    async with httpx.AsyncClient(timeout=10) as http, anyio.create_task_group() as tg:
        a = await start_node(tg, tmp_path, "a", url, service.public_key_text)
        b = await start_node(tg, tmp_path, "b", url, service.public_key_text)
        await wait_until(lambda: _true(len(service.registry.routable(MODEL)) == 2))
        await http.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [], "max_tokens": 1})
        served_by, other = (a, b) if a.served else (b, a)
        [rid] = served_by.served

        def receipt(node: FakeNode, request_id: str) -> UsageReceipt:
            rec = UsageRecord(request_id=request_id, route="/v1/chat/completions", model=MODEL, status=200, stream=False, started_at=0)
            return node.identity.sign_receipt(rec)

        ack = await other.client.send_receipts([receipt(other, rid), receipt(other, "req-invented")])
        assert {r.request_id: r.code for r in ack.rejected} == {rid: "wrong_node", "req-invented": "unknown_request"}
        forged = receipt(other, rid).model_copy(update={"token": receipt(other, rid).token[:-4] + "AAAA"})
        ack = await served_by.client.send_receipts([forged])
        assert [r.code for r in ack.rejected] == ["bad_signature"]
        tg.cancel_scope.cancel()


async def test_least_busy_node_gets_the_next_request(tracker, tmp_path: Path) -> None:
    service, url = tracker
    async with httpx.AsyncClient(timeout=10) as http, anyio.create_task_group() as tg:
        a = await start_node(tg, tmp_path, "a", url, service.public_key_text)
        b = await start_node(tg, tmp_path, "b", url, service.public_key_text)
        await wait_until(lambda: _true(len(service.registry.routable(MODEL)) == 2))
        a.gate = b.gate = anyio.Event()
        body = {"model": MODEL, "messages": [], "max_tokens": 3, "stream": True}
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as held:
            held_chunks = held.aiter_raw()  # keep a reference: a dropped iterator closes the stream
            await held_chunks.__anext__()
            busy, idle = (a, b) if a.served else (b, a)
            for _ in range(2):
                gate_free = await http.post(url + "/v1/chat/completions", json={**body, "stream": False})
                assert gate_free.status_code == 200
            assert len(idle.served) == 2 and len(busy.served) == 1
            a.gate.set()
        tg.cancel_scope.cancel()


async def test_client_disconnect_closes_the_node_stream(tracker, tmp_path: Path) -> None:
    service, url = tracker
    async with httpx.AsyncClient(timeout=10) as http, anyio.create_task_group() as tg:
        node = await start_node(tg, tmp_path, "n", url, service.public_key_text)
        await wait_until(lambda: _eq(models(http, url), [MODEL]))
        node.gate = anyio.Event()
        body = {"model": MODEL, "messages": [], "max_tokens": 50, "stream": True}
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
            await response.aiter_raw().__anext__()
        [rid] = node.served
        node.gate.set()  # the node tries to go on; its client (the tracker) is gone
        await wait_until(lambda: _true(rid in node.cancelled), timeout=5)
        await wait_until(lambda: _outcome(http, url, rid, "cancelled"))
        tg.cancel_scope.cancel()


async def test_no_node_or_unknown_model_or_bad_body_are_refused_plainly(tracker) -> None:
    service, url = tracker
    async with httpx.AsyncClient(timeout=10) as http:
        missing = await http.post(url + "/v1/chat/completions", json={"model": "nope", "messages": []})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        bad = await http.post(url + "/v1/chat/completions", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        nomodel = await http.post(url + "/v1/chat/completions", json={"messages": []})
        assert nomodel.status_code == 400


async def _true(value: bool) -> bool:
    return value


async def _eq(awaitable, expected) -> bool:
    return await awaitable == expected


async def _agreement(http: httpx.AsyncClient, url: str, rid: str, expected: str) -> bool:
    response = await http.get(f"{url}/v1/usage/{rid}")
    return response.status_code == 200 and response.json()["agreement"] == expected


async def _outcome(http: httpx.AsyncClient, url: str, rid: str, expected: str) -> bool:
    response = await http.get(f"{url}/v1/usage/{rid}")
    return response.status_code == 200 and response.json()["outcome"] == expected
