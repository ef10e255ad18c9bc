"""The node's pages in process: who may read /status.json, what / carries, and the chat's routes.

Each access rule is played from the attacker's side: a remote client of a meshed node,
a stream that arrives through the relay tunnel (on loopback), a page on another site
through a rebound DNS name, a browser without the key.
"""

from __future__ import annotations

import httpx
import pytest

from meshnet_gguf.contract.protocol import HealthReport, UsageRecord
from meshnet_gguf.serving.access import PageAccess
from meshnet_gguf.serving.node_surface import NodeDoors, node_table
from meshnet_gguf.serving.routes import RouteTable
from meshnet_gguf.serving.status_page import (
    STATIC_FILES,
    ChatUi,
    NodePages,
    RecentRequests,
    StatusSource,
    plan_line,
)
from support.fake_upstream import ALIAS
from support.proxy_harness import CHAT, NODE_HOST, ProxyUnderTest, build_proxy

pytestmark = pytest.mark.anyio

KEY = "operator-key"
LOOPBACK_CLIENT = ("127.0.0.1", 40000)
REMOTE_CLIENT = ("192.0.2.7", 40000)
# A relayed stream reaches the listener from loopback too; the relay link knows its port.
RELAYED_CLIENT = ("127.0.0.1", 45555)


def _pages(proxy: ProxyUnderTest, access: PageAccess, *, chat: bool = True) -> RouteTable:
    recent = RecentRequests()
    status = StatusSource(
        health=lambda: HealthReport(state="ready", model=ALIAS, slots_total=2),
        recent=recent,
        plan="CPU only; context 1024 tokens over 2 slots",
        chat=chat,
    )
    target = proxy.proxy_app._upstream  # the same "where is llama-server" the proxy is given
    pages = NodePages(status=status, access=access, chat=ChatUi(target, proxy.upstream) if chat else None)
    return node_table(NodeDoors(proxy.proxy_app, status.health, pages))


def _client(app: RouteTable, client: tuple[str, int] = LOOPBACK_CLIENT) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=client), base_url=f"http://{NODE_HOST}")


def _relayed(address: tuple[str, int]) -> bool:
    return address == RELAYED_CLIENT


async def test_the_page_itself_carries_no_data_and_loads_only_its_own_files() -> None:
    proxy = build_proxy(api_key=KEY)
    async with _client(_pages(proxy, PageAccess(api_key=KEY, meshed=False))) as client:
        for path in STATIC_FILES:
            answer = await client.get(path)  # no key: a browser cannot send one on a page load
            assert answer.status_code == 200, path
            assert "'self'" in answer.headers["content-security-policy"]
            assert ALIAS not in answer.text  # the model name (any data) comes only with the key
        assert (await client.get("/")).headers["content-type"].startswith("text/html")


async def test_standalone_status_needs_the_api_key_when_one_is_set() -> None:
    proxy = build_proxy(api_key=KEY)
    async with _client(_pages(proxy, PageAccess(api_key=KEY, meshed=False))) as client:
        assert (await client.get("/status.json")).status_code == 401
        assert (await client.get("/status.json", headers={"authorization": "Bearer wrong"})).status_code == 401
        answer = await client.get("/status.json", headers={"authorization": f"Bearer {KEY}"})
    assert answer.status_code == 200
    document = answer.json()
    assert document["health"]["model"] == ALIAS and document["health"]["state"] == "ready"
    assert document["plan"].startswith("CPU only") and document["chat"] is True


async def test_a_meshed_node_shows_its_status_to_loopback_only_unless_the_operator_opts_in() -> None:
    proxy = build_proxy()
    meshed = PageAccess(api_key=None, meshed=True)
    async with _client(_pages(proxy, meshed, chat=False), REMOTE_CLIENT) as remote:
        refused = await remote.get("/status.json")
    assert refused.status_code == 403 and "this machine only" in refused.json()["error"]["message"]
    async with _client(_pages(proxy, meshed, chat=False)) as local:
        assert (await local.get("/status.json")).status_code == 200
    opted_in = PageAccess(api_key=None, meshed=True, remote=True)
    async with _client(_pages(proxy, opted_in, chat=False), REMOTE_CLIENT) as remote:
        assert (await remote.get("/status.json")).status_code == 200


@pytest.mark.parametrize("remote", [False, True])
async def test_never_through_the_relay_tunnel_even_though_it_arrives_on_loopback(remote: bool) -> None:
    proxy = build_proxy()
    access = PageAccess(api_key=None, meshed=True, remote=remote, relayed=_relayed)
    async with _client(_pages(proxy, access, chat=False), RELAYED_CLIENT) as through_relay:
        assert (await through_relay.get("/status.json")).status_code == 404
    async with _client(_pages(proxy, access, chat=False)) as local:  # another loopback port: a local client
        assert (await local.get("/status.json")).status_code == 200


async def test_a_page_on_another_site_cannot_read_the_status_through_a_rebound_name() -> None:
    proxy = build_proxy()
    async with _client(_pages(proxy, PageAccess(api_key=None, meshed=False))) as client:
        answer = await client.get("/status.json", headers={"host": "attacker.example:8080"})
    assert answer.status_code == 403


async def test_the_chat_goes_through_the_proxy_key_admission_and_metering() -> None:
    proxy = build_proxy(api_key=KEY)
    async with _client(_pages(proxy, PageAccess(api_key=KEY, meshed=False))) as client:
        refused = await client.post("/chat/v1/chat/completions", json=CHAT)
        assert refused.status_code == 401
        assert (await client.get("/chat/props")).status_code == 401  # the server's facts, behind the key
        answer = await client.post("/chat/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {KEY}"})
        assert answer.status_code == 200
        # llama-server's other endpoints are not reachable through /chat/, key or not.
        for path in ("/chat/slots", "/chat/metrics", "/chat/v1/completions", "/chat/../slots"):
            assert (await client.get(path, headers={"authorization": f"Bearer {KEY}"})).status_code == 404, path
    assert [r.route for r in proxy.sink.records] == ["/v1/chat/completions"]  # metered once, as any client
    assert [r.path for r in proxy.upstream.forwarded()] == ["/v1/chat/completions"]


async def test_the_chat_is_not_served_by_a_meshed_node() -> None:
    proxy = build_proxy()
    async with _client(_pages(proxy, PageAccess(api_key=None, meshed=True), chat=False)) as client:
        assert (await client.get("/chat/")).status_code == 404
        assert (await client.post("/chat/v1/chat/completions", json=CHAT)).status_code == 404
    assert proxy.upstream.forwarded() == []


async def test_everything_else_reaches_the_proxy_unchanged() -> None:
    proxy = build_proxy()
    async with _client(_pages(proxy, PageAccess(api_key=None, meshed=False))) as client:
        assert (await client.get("/health")).json()["model"] == ALIAS
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await client.get("/nothing-here")).status_code == 404


async def test_recent_requests_are_kept_newest_first_and_bounded() -> None:
    recent = RecentRequests(kept=3)
    for i in range(5):
        await recent.record(
            UsageRecord(request_id=f"r{i}", route="/v1/chat/completions", model=ALIAS, status=200, stream=False, started_at=i)
        )
    assert [r["request_id"] for r in recent.latest_first()] == ["r4", "r3", "r2"]


def test_the_plan_in_one_line() -> None:
    text = "plan: CPU only; context 4096 tokens over 4 slots; mmap\nmemory: ~0 B on the GPU\n  = weights"
    assert plan_line(text, 4) == "CPU only; context 4096 tokens over 4 slots; mmap"
    assert plan_line(None, 2) == "2 slots (llama-server decides the rest)"
