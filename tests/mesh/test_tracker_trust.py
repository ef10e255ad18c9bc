"""The tracker's trust rules (docs/protocol.md, "What a tracker must check"), each played as an
attacker would: a hostile volunteer node, a hostile advertised URL, a lying receipt, a
replayed token, oversized input. Every test here fails on a tracker that skips its rule."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from meshnet_gguf.common.ports import free_local_port as free_port
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import (
    NODE_CONTROL_PATH,
    HealthReport,
    NodeAnnouncement,
    NodeControlProof,
    NodeLoad,
    ReceiptClaims,
    UsageReceipt,
    UsageRecord,
)
from meshnet_gguf.contract.signing import encode_token
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.tracker_link import MeshSetupError, TrackerLink
from meshnet_gguf.mesh.tracker_client import NodePresence, TrackerClient, TrackerRefused
from meshnet_gguf.reference.tracker.metering import COMPLETION_SLACK_TOKENS, MAX_METERED_EVENT_BYTES, BoundedEventSplitter
from meshnet_gguf.reference.tracker.node_address import AddressPolicy, UnsafeNodeURL, pin_node_url
from meshnet_gguf.reference.tracker.app import Tracker
from meshnet_gguf.reference.tracker.config import TrackerConfig
from meshnet_gguf.reference.tracker.enrolment import load_or_create_enrolment_secret
from support.loopback import serve_asgi
from support.mesh_node import MODEL, FakeLlama, MeshNode, tracker_link
from support.mesh_tracker import SECRET, models, start_tracker, tracker_key, wait_until

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"


class HostileNode:
    """A volunteer that holds a real node key and registers properly, then misbehaves as told."""

    def __init__(self, state_dir: Path, tracker: Tracker, tracker_url: str, *, advertised_url: str | None = None) -> None:
        self.identity = NodeIdentity.load_or_create(state_dir)
        self.tracker = tracker
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.advertised_url = advertised_url or self.url
        self.client = TrackerClient(tracker_url, self.identity, enrolment_secret=SECRET, audience=tracker.issuer)
        self.presence = NodePresence(self.client, self.announcement, lambda: ("online", NodeLoad(slots_total=2)))
        self.answer: Callable[[Request], Any] = self.honest_answer
        self.usage = {"prompt_tokens": 7, "completion_tokens": 3}
        self.challenges = 0

    def announcement(self, **over: Any) -> NodeAnnouncement:
        fields = dict(
            node_id=self.identity.node_id, public_key=self.identity.public_key_text, advertised_url=self.advertised_url,
            model_id=MODEL, first_layer=0, last_layer=1, total_layers=2, slots=2, node_version="hostile", state="online",
        )  # fmt: skip
        return NodeAnnouncement(**{**fields, **over})

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route(NODE_CONTROL_PATH, self.prove, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route(CHAT, self.chat, methods=["POST"]),
            ]
        )

    async def prove(self, request: Request) -> Response:
        self.challenges += 1
        token = self.identity.sign_control_proof(request.query_params["nonce"], self.tracker.issuer)
        return Response(NodeControlProof(token=token).model_dump_json(), media_type="application/json")

    async def health(self, request: Request) -> Response:
        return Response(HealthReport(state="ready", model=MODEL, slots_total=2).model_dump_json(), media_type="application/json")

    async def chat(self, request: Request) -> Response:
        return await self.answer(request)

    async def honest_answer(self, request: Request) -> Response:
        answer = {"choices": [{"message": {"content": "xyz"}, "finish_reason": "length"}], "usage": self.usage}
        return JSONResponse(answer)

    def receipt(self, request_id: str, *, iat: float | None = None, **usage: int) -> UsageReceipt:
        record = UsageRecord(request_id=request_id, route=CHAT, model=MODEL, status=200, stream=False, started_at=0, finish_reason="length")
        claims = ReceiptClaims(iss=self.identity.node_id, jti=request_id, iat=int(iat or time.time()), usage=record).model_dump()
        claims["usage"].update(usage)  # figures as the attacker wants them, past the model's own checks
        return UsageReceipt(request_id=request_id, token=encode_token(claims, self.identity.private_key))

    @asynccontextmanager
    async def running(self) -> AsyncIterator[HostileNode]:
        async with serve_asgi(self.app(), self.port), anyio.create_task_group() as tg:
            tg.start_soon(self.presence.run)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()
        await self.client.aclose()


@pytest.fixture
def llama(tmp_path: Path) -> Iterator[FakeLlama]:
    fake = FakeLlama(tmp_path)
    yield fake
    fake.close()


@pytest.fixture
async def tracker(tmp_path: Path) -> AsyncIterator[tuple[Tracker, str]]:
    async with start_tracker(tmp_path) as running:
        yield running


async def routable(http: httpx.AsyncClient, url: str) -> bool:
    return await models(http, url) == [MODEL]


# --- registration proves reachability and control --------------------------------------------


async def test_registering_another_nodes_url_is_refused_and_its_traffic_stays_put(tracker, tmp_path: Path, tiny_gguf: Path, llama) -> None:  # type: ignore[no-untyped-def]
    service, url = tracker
    victim = MeshNode(tmp_path / "victim", tiny_gguf, llama, tracker_url=url, tracker_key=service.public_key_text, enrolment_secret=SECRET)
    async with victim.running(), httpx.AsyncClient(timeout=10) as http:
        await wait_until(lambda: routable(http, url))
        impostor = HostileNode(tmp_path / "impostor", service, url, advertised_url=victim.url)
        # A huge slot count would put the impostor first in line: refused as malformed.
        with pytest.raises(TrackerRefused) as info:
            await impostor.client.register(impostor.announcement().model_copy(update={"slots": 10**9}))
        assert (info.value.status, info.value.code) == (400, "malformed")
        # The victim answers the challenge with its own key, not the impostor's.
        with pytest.raises(TrackerRefused) as info:
            await impostor.client.register(impostor.announcement())
        assert (info.value.status, info.value.code) == (422, "control_unproven")
        assert service.registry.get(impostor.identity.node_id) is None

        # An impostor that answers the challenge by asking the victim gets the victim's signature: refused too.
        async def forward_challenge(request: Request) -> Response:
            relayed = await http.get(victim.url + NODE_CONTROL_PATH, params=dict(request.query_params))
            return Response(relayed.content, relayed.status_code, media_type="application/json")

        mirror = HostileNode(tmp_path / "mirror", service, url)
        mirror.prove = forward_challenge  # type: ignore[method-assign]
        async with mirror.running():
            with pytest.raises(TrackerRefused) as info:
                await mirror.client.register(mirror.announcement())
            assert info.value.code == "control_unproven"

        for _ in range(10):
            answer = await http.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert answer.status_code == 200, answer.text
        assert service.registry.get(victim.node_id).routed == 10


async def test_one_routable_node_per_url(tracker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    service, url = tracker
    first = HostileNode(tmp_path / "first", service, url)
    async with first.running(), httpx.AsyncClient(timeout=10) as http:
        await wait_until(lambda: routable(http, url))
        # The machine at that URL now holds another key (a reinstall) and proves it: it takes the URL over.
        second = HostileNode(tmp_path / "second", service, url, advertised_url=first.url)
        first.identity = second.identity  # the server at the URL now answers challenges with the new key
        await second.client.register(second.announcement())
        assert service.registry.get(second.identity.node_id) is not None
        assert [e.node_id for e in service.registry.all()] == [second.identity.node_id]


# --- enrolment -------------------------------------------------------------------------------


async def test_enrolment_secret_is_required_by_default(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="enrolment secret"):
        TrackerConfig(state_dir=tmp_path)
    secret = load_or_create_enrolment_secret(tmp_path)
    assert len(secret) >= 32 and load_or_create_enrolment_secret(tmp_path) == secret  # kept across restarts
    assert (tmp_path / "enrolment_secret").stat().st_mode & 0o077 == 0
    async with start_tracker(tmp_path) as (service, url):
        anonymous = HostileNode(tmp_path / "anon", service, url)
        anonymous.client = TrackerClient(url, anonymous.identity, audience=service.issuer)
        async with anonymous.running():
            with pytest.raises(TrackerRefused) as info:
                await anonymous.client.register(anonymous.announcement())
            assert (info.value.status, info.value.code) == (401, "bad_enrolment_secret")
            assert anonymous.challenges == 0  # an unenrolled caller makes the tracker send nothing


# --- SSRF ------------------------------------------------------------------------------------


@pytest.fixture
def listener() -> Iterator[tuple[int, list[bytes]]]:
    """A loopback TCP listener that records whatever connects to it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.settimeout(0.05)
    seen: list[bytes] = []
    stop = False

    def accept() -> None:
        while not stop:
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            conn.settimeout(0.5)
            try:
                seen.append(conn.recv(4096))
            except OSError:
                seen.append(b"")
            conn.close()

    import threading

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield sock.getsockname()[1], seen
    stop = True
    thread.join(2)
    sock.close()


@pytest.mark.parametrize(
    "advertised",
    [
        "http://127.0.0.1:{port}/x?",  # a query swallowing the paths the tracker appends
        "http://127.0.0.1:{port}/#",
        "http://user:pw@127.0.0.1:{port}",
        "ftp://127.0.0.1:{port}",
        "http://169.254.169.254",  # cloud metadata
        "http://[::ffff:169.254.169.254]",
        "http://[fe80::1]:{port}",
        "http://0.0.0.0:{port}",
        "http://10.1.2.3:{port}",  # private, not allowed by this tracker
        "http://224.0.0.1:{port}",
    ],
)
async def test_unsafe_advertised_urls_are_refused_and_never_contacted(advertised: str, tracker, tmp_path: Path, listener) -> None:  # type: ignore[no-untyped-def]
    service, url = tracker
    port, seen = listener
    hostile = HostileNode(tmp_path / "h", service, url, advertised_url=advertised.format(port=port))
    with pytest.raises(TrackerRefused) as info:
        await hostile.client.register(hostile.announcement())
    assert (info.value.status, info.value.code) == (422, "unsafe_advertised_url")
    await anyio.sleep(0.3)
    assert seen == [] and len(service.registry) == 0
    await hostile.client.aclose()


async def test_loopback_nodes_only_where_the_operator_allows_them(tmp_path: Path) -> None:
    async with start_tracker(tmp_path, addresses=AddressPolicy()) as (service, url):
        node = HostileNode(tmp_path / "h", service, url)
        async with node.running():
            with pytest.raises(TrackerRefused) as info:
                await node.client.register(node.announcement())
            assert info.value.code == "unsafe_advertised_url" and node.challenges == 0
    with pytest.raises(UnsafeNodeURL):
        await pin_node_url("http://localhost:1", AddressPolicy())
    permissive = AddressPolicy(allow_loopback=True, allow_private=True)
    pinned = await pin_node_url("http://10.1.2.3:1", permissive)
    assert pinned.address == ipaddress.ip_address("10.1.2.3")
    # Whatever the operator allows, metadata, link-local and non-unicast addresses stay out.
    for never in (
        "http://169.254.169.254",
        "http://[fd00:ec2::254]",
        "http://[fe80::1]:1",
        "http://0.0.0.0:1",
        "http://[::]:1",
        "http://240.0.0.1",
    ):
        with pytest.raises(UnsafeNodeURL):
            await pin_node_url(never, permissive)


async def test_the_resolved_address_is_pinned_so_dns_cannot_rebind(tracker, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    service, url = tracker
    answers = iter(["127.0.0.1"] + ["169.254.169.254"] * 1000)  # the name rebinds after the first lookup
    lookups: list[str] = []
    real_getaddrinfo = anyio.getaddrinfo

    async def rebinding(host: str, port: int, **kw: Any) -> Any:
        if host != "node.rebind.test":
            return await real_getaddrinfo(host, port, **kw)
        lookups.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]

    monkeypatch.setattr(anyio, "getaddrinfo", rebinding)
    node = HostileNode(tmp_path / "h", service, url)
    node.advertised_url = f"http://node.rebind.test:{node.port}"
    async with node.running(), httpx.AsyncClient(timeout=10) as http:
        await wait_until(lambda: routable(http, url))
        for _ in range(3):
            assert (
                await http.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            ).status_code == 200
        await anyio.sleep(0.5)  # health polls too
        assert (
            await http.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        ).status_code == 200
    # One lookup, at registration; the control proof, health polls and relays went to the address checked then.
    assert lookups == ["node.rebind.test"]


# --- billing ---------------------------------------------------------------------------------


async def test_receipts_are_validated_and_billed_as_the_smaller_count(tracker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    service, url = tracker
    node = HostileNode(tmp_path / "h", service, url)
    async with node.running(), httpx.AsyncClient(timeout=10) as http:
        await wait_until(lambda: routable(http, url))

        async def relay(**body: Any) -> str:
            answer = await http.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body})
            rids = [u["request_id"] for u in (await http.get(url + "/v1/usage?limit=1")).json()]
            assert answer.status_code in (200, 500)
            return rids[0]

        inflated, negative, bloated, cached, honest_more, honest = [await relay(max_tokens=8) for _ in range(6)]
        ack = await node.client.send_receipts(
            [
                node.receipt(inflated, prompt_tokens=7, completion_tokens=10**9),
                node.receipt(negative, prompt_tokens=-5, completion_tokens=3),
                node.receipt(bloated, prompt_tokens=10**7, completion_tokens=3),
                node.receipt(cached, prompt_tokens=7, cached_tokens=8, completion_tokens=3),
                node.receipt(honest_more, prompt_tokens=7, completion_tokens=8),  # within the route's cap, above our count
                node.receipt(honest, prompt_tokens=7, completion_tokens=3),
            ]
        )
        assert {r.request_id: r.code for r in ack.rejected} == {
            inflated: "implausible", negative: "malformed", bloated: "implausible", cached: "implausible",
        }  # fmt: skip
        assert sorted(ack.accepted) == sorted([honest_more, honest])
        more = (await http.get(f"{url}/v1/usage/{honest_more}")).json()
        # The answer carried 3 bytes of text ("xyz"): the receipt's 8 are billed as at most 3 + the slack, and flagged.
        assert more["billed"] == {"prompt_tokens": 7, "completion_tokens": 3 + COMPLETION_SLACK_TOKENS} and more["flagged"]
        same = (await http.get(f"{url}/v1/usage/{honest}")).json()
        assert same["billed"] == {"prompt_tokens": 7, "completion_tokens": 3} and not same["flagged"]
        [listed] = (await http.get(url + "/v1/nodes")).json()
        assert listed["receipt_flags"] == 1

        # A relay the node failed bills nothing, whatever the receipt says.
        async def fail(request: Request) -> Response:
            return JSONResponse({"error": {"message": "boom", "code": 500}}, 500)

        node.answer = fail
        failed = await relay(max_tokens=8)
        assert (await node.client.send_receipts([node.receipt(failed, prompt_tokens=7, completion_tokens=8)])).accepted == [failed]
        assert (await http.get(f"{url}/v1/usage/{failed}")).json()["billed"] == {"prompt_tokens": 0, "completion_tokens": 0}


async def test_a_receipt_from_a_clock_running_ahead_is_retried_not_dropped(tracker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    service, url = tracker
    node = HostileNode(tmp_path / "h", service, url)
    async with node.running(), httpx.AsyncClient(timeout=10) as http:
        await wait_until(lambda: routable(http, url))
        rids = []
        for _ in range(2):
            await http.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            rids.append((await http.get(url + "/v1/usage?limit=1")).json()[0]["request_id"])
        ahead, absurd = rids
        ack = await node.client.send_receipts(
            [
                node.receipt(ahead, iat=time.time() + 30, completion_tokens=3),
                node.receipt(absurd, iat=time.time() + 10**6, completion_tokens=3),
            ]
        )
        assert ahead not in ack.accepted and ahead not in [r.request_id for r in ack.rejected]  # unsettled: sent again later
        assert [(r.request_id, r.code) for r in ack.rejected] == [(absurd, "from_the_future")]
        ack = await node.client.send_receipts([node.receipt(ahead, completion_tokens=3)])
        assert ack.accepted == [ahead]


# --- node-auth tokens are for one tracker --------------------------------------------------------


async def test_a_node_token_captured_on_the_way_to_one_tracker_is_refused_by_another(tmp_path: Path) -> None:
    async with start_tracker(tmp_path, "a") as (tracker_a, url_a), start_tracker(tmp_path, "b") as (tracker_b, url_b):
        node = HostileNode(tmp_path / "h", tracker_b, url_b)
        async with node.running(), httpx.AsyncClient(timeout=10) as http:
            await wait_until(lambda: routable(http, url_b))
            beat = json.dumps({"node_id": node.identity.node_id, "state": "online", "load": {"slots_total": 2}}).encode()
            path = f"/v1/nodes/{node.identity.node_id}/heartbeat"
            captured = node.identity.request_auth("POST", path, beat, tracker_a.issuer)
            replayed = await http.post(
                url_b + path, content=beat, headers={"authorization": f"Bearer {captured}", "content-type": "application/json"}
            )
            assert (replayed.status_code, replayed.json()["error"]["code"]) == (401, "bad_node_auth")
            own = node.identity.request_auth("POST", path, beat, tracker_b.issuer)
            assert (await http.post(url_b + path, content=beat, headers={"authorization": f"Bearer {own}"})).status_code == 200


# --- bounded parsing and forwarding ---------------------------------------------------------------


async def test_hostile_bodies_headers_and_queries_get_4xx_not_500(tracker) -> None:  # type: ignore[no-untyped-def]
    service, url = tracker
    async with httpx.AsyncClient(timeout=30) as http:
        nested = await http.post(url + CHAT, content=b"[" * 100_000)
        # The node's own parser and code (contract/strict_json): what the node would refuse never leaves the tracker.
        assert (nested.status_code, nested.json()["error"]["code"]) == (400, "json_too_deep")
        nested_control = await http.post(url + "/v1/nodes/register", content=b"[" * 100_000)
        assert nested_control.status_code == 400
        huge_header = await http.get(url + "/v1/models", headers={"x-filler": "a" * (1024 * 1024)})
        assert huge_header.status_code == 431
        for limit in ("-1", "0", "abc", "10001", "1e3"):
            answer = await http.get(url + "/v1/usage", params={"limit": limit})
            assert (answer.status_code, answer.json()["error"]["code"]) == (400, "bad_limit"), limit
        assert (await http.get(url + "/v1/usage", params={"limit": "5"})).status_code == 200


@pytest.mark.parametrize("number", ["NaN", "1e999"])
async def test_a_non_finite_figure_from_a_node_is_refused_and_the_pages_stay_up(number: str, tmp_path: Path) -> None:
    """JSON has no NaN or infinity, but Python's json writes `NaN` and reads `1e999` as inf: one such
    heartbeat, accepted, made `/dashboard.json` and `/v1/nodes` 500 for everyone (json.dumps refuses it)."""
    # Heartbeats every 5 s: the enrolled node sends none of its own, so only the poisoned one lands.
    async with start_tracker(tmp_path, heartbeat_interval_s=5.0) as (service, url):
        node = HostileNode(tmp_path / "h", service, url)
        poisoned_health = '{"state": "ready", "slots_total": 2, "recent_tokens_per_s": %s, "uptime_s": %s}' % (number, number)

        async def health(request: Request) -> Response:
            return Response(poisoned_health, media_type="application/json")

        node.health = health  # type: ignore[method-assign]
        async with serve_asgi(node.app(), node.port), httpx.AsyncClient(timeout=10) as http:
            await node.client.register(node.announcement())
            path = f"/v1/nodes/{node.identity.node_id}/heartbeat"
            body = ('{"node_id": "%s", "state": "online", "load": {"slots_total": 2, "recent_tokens_per_s": %s}}'
                    % (node.identity.node_id, number)).encode()  # fmt: skip
            signed = {"authorization": "Bearer " + node.identity.request_auth("POST", path, body, service.issuer),
                      "content-type": "application/json"}  # fmt: skip
            beat = await http.post(url + path, content=body, headers=signed)
            assert beat.status_code == 400, beat.text
            assert beat.json()["error"]["code"] == "malformed" and "load.recent_tokens_per_s" in beat.json()["error"]["message"]
            # The node's /health with the same figure is a failed poll, never a report the tracker keeps.
            (entry,) = service.registry.all()
            await wait_until(lambda: _true(entry.health_misses >= 2))
            assert entry.health is None
            for page in ("/", "/dashboard.json", "/v1/nodes", "/v1/models", "/health"):
                answer = await http.get(url + page)
                assert answer.status_code == 200, (page, answer.text)
            assert [n["node_id"] for n in (await http.get(url + "/dashboard.json")).json()["nodes"]] == [node.identity.node_id]
        await node.client.aclose()


async def _true(value: bool) -> bool:
    return value


async def test_only_allow_listed_node_headers_reach_the_client(tracker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    service, url = tracker
    node = HostileNode(tmp_path / "h", service, url)

    async def with_cookies(request: Request) -> Response:
        headers = {"set-cookie": "session=stolen", "x-meshnet-usage-prompt-tokens": "7", "location": "http://evil", "x-powered-by": "node"}
        return JSONResponse({"choices": [], "usage": node.usage}, headers=headers)

    node.answer = with_cookies
    async with node.running(), httpx.AsyncClient(timeout=10) as http:
        await wait_until(lambda: routable(http, url))
        answer = await http.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200
        assert "set-cookie" not in answer.headers and "location" not in answer.headers and "x-powered-by" not in answer.headers
        assert answer.headers["x-meshnet-usage-prompt-tokens"] == "7" and answer.headers["content-type"] == "application/json"


async def test_a_stream_without_line_ends_is_forwarded_but_not_buffered_without_bound(tracker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    service, url = tracker
    node = HostileNode(tmp_path / "h", service, url)
    endless_line = 4 * MAX_METERED_EVENT_BYTES

    async def one_long_line(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            for _ in range(endless_line // 4096):
                yield b"x" * 4096

        return StreamingResponse(body(), media_type="text/event-stream")

    node.answer = one_long_line
    async with node.running(), httpx.AsyncClient(timeout=30) as http:
        await wait_until(lambda: routable(http, url))
        answer = await http.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert len(answer.content) == endless_line  # relayed unchanged

    # The meter's own buffer stops at its limit, and its work stays linear in the bytes fed.
    splitter = BoundedEventSplitter()
    started = time.perf_counter()
    for _ in range(MAX_METERED_EVENT_BYTES + 1):
        splitter.feed(b"x")
    assert splitter.overflowed and time.perf_counter() - started < 5
    tiny = BoundedEventSplitter()
    assert tiny.feed(b"data: 1\n") == [] and tiny.feed(b"\ndata: 2\r\n\r\n") == [b"data: 1\n\n", b"data: 2\r\n\r\n"]


async def test_a_forward_that_never_ends_is_cut_at_the_total_time_limit(tmp_path: Path) -> None:
    async with start_tracker(tmp_path, forward_total_timeout_s=1.0) as (service, url):
        node = HostileNode(tmp_path / "h", service, url)

        async def trickle(request: Request) -> Response:
            async def body() -> AsyncIterator[bytes]:
                while True:
                    yield b": still here\n\n"
                    await anyio.sleep(0.1)

            return StreamingResponse(body(), media_type="text/event-stream")

        node.answer = trickle
        async with node.running(), httpx.AsyncClient(timeout=30) as http:
            await wait_until(lambda: routable(http, url))
            started = time.monotonic()
            with anyio.fail_after(10):
                answer = await http.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
            assert answer.status_code == 200 and time.monotonic() - started < 5
            [usage] = (await http.get(url + "/v1/usage")).json()
            assert usage["outcome"] == "timed_out"


# --- the node's side: key trust --------------------------------------------------------------


def test_no_trust_on_first_use_over_plain_http_to_another_machine(tmp_path: Path, tiny_gguf: Path) -> None:
    def link(tracker: str, key: str | None = None) -> TrackerLink:
        settings = NodeSettings(state_dir=tmp_path / "n", tracker=tracker, tracker_public_key=key, advertised_url="http://127.0.0.1:1")
        made = tracker_link(settings, tiny_gguf, lambda: HealthReport(state="ready"))
        made.ledger.close()
        return made

    with pytest.raises(MeshSetupError, match="MESHNET_TRACKER_PUBLIC_KEY"):
        link("http://192.0.2.10:8000")  # TEST-NET: nothing is sent, the link refuses at setup
    pinned = tracker_key(tmp_path / "t")
    assert link("http://192.0.2.10:8000", pinned).route_gate.issuer is not None
    for fine in ("https://tracker.example", "http://127.0.0.1:8000", "http://localhost:8000"):
        assert link(fine).route_gate.issuer is None  # learnt on first contact, which is safe there


async def test_a_node_whose_pinned_key_is_not_the_trackers_says_so_and_stays_off_line(
    tracker, tmp_path: Path, tiny_gguf: Path, llama
) -> None:  # type: ignore[no-untyped-def]
    service, url = tracker
    other = tracker_key(tmp_path / "other")
    mesh = MeshNode(tmp_path / "n", tiny_gguf, llama, tracker_url=url, tracker_key=other, enrolment_secret=SECRET)
    async with mesh.running(), httpx.AsyncClient(timeout=10) as http:

        async def problem() -> bool:
            return (await http.get(mesh.url + "/health")).json().get("mesh_problem") is not None

        await wait_until(problem)
        report = (await http.get(mesh.url + "/health")).json()
        assert "tracker key mismatch" in report["mesh_problem"] and service.public_key_text in report["mesh_problem"]
        assert mesh.link._status()[0] == "joining"
        assert await models(http, url) == [] and service.registry.get(mesh.node_id) is None


# --- shutdown bounds (docs/protocol.md, "Timings") ----------------------------------------------


async def test_shutdown_with_a_dead_tracker_is_bounded(tmp_path: Path, tiny_gguf: Path) -> None:
    """A tracker that accepts connections and never answers: the final flush gives up within 5 s
    and the deregistration within 3 s, so the node's shutdown cannot hang on it."""
    seen: list[tuple[float, bytes]] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append((time.monotonic(), await reader.read(4096)))
        await asyncio.sleep(60)

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    key = tracker_key(tmp_path / "t")
    settings = NodeSettings(
        state_dir=tmp_path / "n", tracker=f"http://127.0.0.1:{port}", tracker_public_key=key, advertised_url="http://127.0.0.1:1"
    )
    link = tracker_link(settings, tiny_gguf, lambda: HealthReport(state="ready"))
    record = UsageRecord(request_id="req-pending", route=CHAT, model=MODEL, status=200, stream=False, started_at=0)
    await link.usage_sink.record(record)
    link.presence.registered = True  # as a node that registered before the tracker died
    started = time.monotonic()
    with anyio.fail_after(20):
        await link.close()
    ended = time.monotonic()
    server.close()
    [flush_at] = [at for at, data in seen if b"/receipts" in data]
    [deregister_at] = [at for at, data in seen if b"/deregister" in data]
    slack = 1.0  # connection set-up and a loaded test machine
    assert deregister_at - started < 5 + slack, "final flush must give up within 5 s"
    assert ended - deregister_at < 3 + slack, "deregistration must give up within 3 s"
    assert flush_at - started < slack
    # Nothing lost: the receipt waits in the ledger for the next start.
    from meshnet_gguf.mesh.ledger import UsageLedger

    ledger = UsageLedger.in_state_dir(tmp_path / "n")
    assert [r.request_id for r in await ledger.pending(10)] == ["req-pending"]
    await ledger.aclose()


async def test_doctor_names_a_tracker_key_mismatch_and_an_unsafe_first_contact(tracker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from meshnet_gguf.doctor.checks import DoctorEnvironment, check_tracker_key

    service, url = tracker
    other = tracker_key(tmp_path / "other")

    def check(**settings: Any):  # type: ignore[no-untyped-def]
        return check_tracker_key(DoctorEnvironment(NodeSettings(state_dir=tmp_path / "n", **settings)))[0]

    mismatch = await anyio.to_thread.run_sync(lambda: check(tracker=url, tracker_public_key=other))
    assert mismatch.status == "fail" and "tracker key mismatch" in mismatch.summary and service.public_key_text in mismatch.summary
    same = await anyio.to_thread.run_sync(lambda: check(tracker=url, tracker_public_key=service.public_key_text))
    assert same.status == "ok"
    unsafe = check(tracker="http://192.0.2.10:8000")  # nothing is sent: no key to compare
    assert unsafe.status == "fail" and "MESHNET_TRACKER_PUBLIC_KEY" in unsafe.explanation + unsafe.fix


# --- the tracker bills what it saw; no row left behind ---------------------------------------------


async def test_a_lying_node_is_billed_only_what_went_by_and_flagged(tracker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from meshnet_gguf.contract.protocol import USAGE_COMPLETION_TOKENS_HEADER, USAGE_PROMPT_TOKENS_HEADER
    from meshnet_gguf.reference.tracker.metering import prompt_ceiling

    service, url = tracker
    node = HostileNode(tmp_path / "h", service, url)
    lie = {"prompt_tokens": 2000, "completion_tokens": 4096, "total_tokens": 6096}

    async def one_word_with_inflated_usage(request: Request) -> Response:
        # One content event ("hi"), then usage, comment and headers that all claim far more.
        events = [
            {"choices": [{"delta": {"role": "assistant"}, "index": 0}]},
            {"choices": [{"delta": {"content": "hi"}, "index": 0}]},
            {"choices": [{"delta": {}, "finish_reason": "stop", "index": 0}]},
            {"choices": [], "usage": lie},
        ]
        body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        body += b": meshnet-usage " + json.dumps(lie).encode() + b"\n\ndata: [DONE]\n\n"
        headers = {USAGE_PROMPT_TOKENS_HEADER: "2000", USAGE_COMPLETION_TOKENS_HEADER: "4096"}
        return Response(body, media_type="text/event-stream", headers=headers)

    node.answer = one_word_with_inflated_usage
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with node.running(), httpx.AsyncClient(timeout=10) as http:
        await wait_until(lambda: routable(http, url))
        answer = await http.post(url + CHAT, json=request)
        assert answer.status_code == 200
        [usage] = (await http.get(url + "/v1/usage?limit=1")).json()
        rid = usage["request_id"]
        # The receipt is within what T7 lets through (the body's bytes + allowance, the route's 4096 cap)...
        ack = await node.client.send_receipts([node.receipt(rid, **{k: lie[k] for k in ("prompt_tokens", "completion_tokens")})])
        assert ack.accepted == [rid]
        usage = (await http.get(f"{url}/v1/usage/{rid}")).json()
        # ...but billed only what the tracker saw: the 2 bytes of "hi" (+ slack), the prompt the request can hold.
        assert usage["tracker"]["completion_tokens"] == 1
        assert usage["ceiling"]["completion_tokens"] == usage["billed"]["completion_tokens"] == len(b"hi") + COMPLETION_SLACK_TOKENS
        assert usage["billed"]["prompt_tokens"] <= prompt_ceiling(request) < 200
        assert usage["flagged"] and usage["agreement"] == "mismatch"
        [listed] = (await http.get(url + "/v1/nodes")).json()
        assert listed["receipt_flags"] == 1


async def test_a_request_in_flight_when_the_tracker_died_is_settled_at_start_and_billed_within_its_route(tmp_path: Path) -> None:
    import sqlite3

    from meshnet_gguf.reference.tracker.ledger import TRACKER_LEDGER_FILE

    async with start_tracker(tmp_path) as (service, url):
        node = HostileNode(tmp_path / "h", service, url)
        async with node.running(), httpx.AsyncClient(timeout=10) as http:
            await wait_until(lambda: routable(http, url))
            assert (
                await http.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
            ).status_code == 200
            [usage] = (await http.get(url + "/v1/usage?limit=1")).json()
    rid = usage["request_id"]
    # What a kill -9 mid-forward leaves: the row opened, never finished.
    db = sqlite3.connect(tmp_path / "tracker" / TRACKER_LEDGER_FILE)
    with db:
        db.execute("UPDATE forwarded SET outcome = 'in_flight', status = NULL, prompt_tokens = NULL, completion_tokens = NULL,"
                   " completion_ceiling = NULL WHERE request_id = ?", (rid,))  # fmt: skip
    db.close()
    async with start_tracker(tmp_path) as (service, url), httpx.AsyncClient(timeout=10) as http:
        usage = (await http.get(f"{url}/v1/usage/{rid}")).json()
        assert usage["outcome"] == "interrupted" and usage["flagged"]
        node = HostileNode(tmp_path / "h", service, url)
        ack = await node.client.send_receipts([node.receipt(rid, prompt_tokens=7, completion_tokens=8)])
        assert ack.accepted == [rid]
        usage = (await http.get(f"{url}/v1/usage/{rid}")).json()
        # Billed from the receipt, within what the route allowed (8 tokens) and the request could hold.
        assert usage["billed"] == {"prompt_tokens": 7, "completion_tokens": 8} and usage["flagged"]
        await node.client.aclose()


async def test_failed_registrations_relayed_or_not_leave_the_tracker_flat(tracker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import logging
    import tracemalloc

    from meshnet_gguf.contract.node_tls import certificate_text, node_certificate
    from meshnet_gguf.contract.protocol import RelayAttachment
    from meshnet_gguf.reference.relay.server import Relay
    from meshnet_gguf.reference.relay.config import RelayConfig
    from support.relay_harness import running_relay

    service, url = tracker
    async with running_relay(Relay(RelayConfig(port=0))) as relay_url:
        node = HostileNode(tmp_path / "h", service, url)  # never attached to the relay: every control proof fails
        relayed = node.announcement(
            advertised_url=relay_url,
            relay=RelayAttachment(url=relay_url, tls_certificate=certificate_text(node_certificate(node.identity.private_key))),
        )
        direct = node.announcement(advertised_url=f"http://127.0.0.1:{free_port()}")  # nothing listens there

        async def flood(n: int) -> None:
            for i in range(n):
                with pytest.raises(TrackerRefused) as refused:
                    await node.client.register(relayed if i % 2 else direct)
                assert refused.value.code == "control_unproven"

        await flood(20)  # warm-up: caches, lazily imported modules
        quiet = logging.getLogger("meshnet_gguf")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # the test's log capture would keep every refusal's line
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            await flood(200)
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
            quiet.setLevel(level)
        grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        assert service.dialer.held() == (0, 0)  # no transport built for a registration that failed
        assert len(service.registry) == 0
        # Caches that fill once (re, the event loop) stay well under this; a transport per failure was ~17 KiB each.
        assert grown < 2048 * 200, f"{grown} bytes kept by 200 failed registrations"
        await node.client.aclose()


# --- private stays private: modes, and secrets that are never printed ---------------------------------


def test_state_dirs_ledgers_and_keys_are_their_owners_only(tmp_path: Path) -> None:
    import os
    import stat

    from meshnet_gguf.mesh.ledger import LEDGER_FILE, UsageLedger
    from meshnet_gguf.ops.state_lock import StateDirLock
    from meshnet_gguf.reference.tracker.ledger import TRACKER_LEDGER_FILE

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    old_umask = os.umask(0o022)  # the common default: without care, dirs 0755 and files 0644
    try:
        node_dir = tmp_path / "node"
        node_dir.mkdir(mode=0o755)  # one an earlier version left open
        (node_dir / LEDGER_FILE).touch(mode=0o644)
        lock = StateDirLock(node_dir, host="127.0.0.1", port=1)
        ledger = UsageLedger(node_dir / LEDGER_FILE)
        NodeIdentity.load_or_create(node_dir)
        tracker = Tracker(TrackerConfig(state_dir=tmp_path / "tracker", enrolment_secret=SECRET))
        tracker_dir = tmp_path / "tracker"
        assert mode(node_dir) == mode(tracker_dir) == 0o700
        private = [node_dir / LEDGER_FILE, tracker_dir / TRACKER_LEDGER_FILE, tracker_dir / "tracker_key.pem",
                   *node_dir.glob("*.pem"), *node_dir.glob("*-wal"), *tracker_dir.glob("*-wal")]  # fmt: skip
        assert {str(p.relative_to(tmp_path)): oct(mode(p)) for p in private} == {str(p.relative_to(tmp_path)): "0o600" for p in private}
        del tracker, ledger, lock
    finally:
        os.umask(old_umask)


def test_the_tracker_never_prints_an_enrolment_secret_it_was_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn
    from typer.testing import CliRunner

    from meshnet_gguf.cli import app

    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)
    given = "operator-chosen-secret-81f2c"
    result = CliRunner().invoke(
        app, ["dev", "tracker", "--state-dir", str(tmp_path / "t1")], env={"MESHNET_TRACKER_ENROLMENT_SECRET": given}
    )
    assert result.exit_code == 0, result.output
    assert given not in result.output and "MESHNET_ENROLMENT_SECRET=<the secret you set>" in result.output
    # A generated one is kept 0600 and named by where it is: not printed into a log (this output is no terminal).
    result = CliRunner().invoke(app, ["dev", "tracker", "--state-dir", str(tmp_path / "t2")], env={"MESHNET_TRACKER_ENROLMENT_SECRET": ""})
    stored = (tmp_path / "t2" / "enrolment_secret").read_text().strip()
    assert result.exit_code == 0 and stored not in result.output and str(tmp_path / "t2" / "enrolment_secret") in result.output


async def test_a_captured_node_token_is_refused_the_second_time(tracker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from meshnet_gguf.contract.protocol import Heartbeat

    service, url = tracker
    node = HostileNode(tmp_path / "h", service, url)
    async with node.running(), httpx.AsyncClient(timeout=10) as http:
        await wait_until(lambda: routable(http, url))
        path = f"/v1/nodes/{node.identity.node_id}/heartbeat"
        body = Heartbeat(node_id=node.identity.node_id, state="online", load=NodeLoad(slots_total=2)).model_dump_json().encode()
        # One heartbeat as seen on the wire (plain http): the same bytes, sent again by whoever captured them.
        captured = {"authorization": "Bearer " + node.identity.request_auth("POST", path, body, service.issuer),
                    "content-type": "application/json"}  # fmt: skip
        assert (await http.post(url + path, content=body, headers=captured)).status_code == 200
        replayed = await http.post(url + path, content=body, headers=captured)
        assert replayed.status_code == 401 and "already used" in replayed.json()["error"]["message"]
