"""The proxy under test, in process: a `ProxyApp` built as the node builds it, over `FakeLlamaUpstream`,
served by the node's table (`serving/node_surface`) as the listener serves it.

Two ways in, both through the public ASGI interface:
- `ProxyUnderTest.client()`: an `httpx.AsyncClient` whose transport runs each request as an
  `Exchange` and hands back the whole answer (the official SDK takes it as `http_client`);
- `Exchange`: one request driven by hand, for what a whole answer cannot show: reading it
  while it is still being produced, and hanging up part way through.

Unlike `httpx.ASGITransport`, which reports the client gone the moment an answer is
complete, a client here stays connected until it hangs up, as with uvicorn and a
keep-alive client: a proxy that watches for disconnects sees what it would in production.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import httpx

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import HealthReport, NodeState
from meshnet_gguf.llama.upstream import UpstreamClient
from meshnet_gguf.node import build_proxy as build_node_proxy
from meshnet_gguf.common.asgi import ExtraRoute
from meshnet_gguf.serving.node_surface import NodeDoors, node_table
from meshnet_gguf.serving.routes import RouteTable
from meshnet_gguf.serving.slots import Slots
from meshnet_gguf.serving.prompt_count import PromptCounter
from meshnet_gguf.serving.proxy import ProxyApp
from meshnet_gguf.serving.upstream_target import UpstreamTarget
from support.fake_upstream import ALIAS, FakeLlamaUpstream
from support.recording_sink import RecordingSink

# Where clients reach the node: on loopback, as a local client would (and the Host it sends).
NODE_HOST = "127.0.0.1:8080"
BASE_URL = f"http://{NODE_HOST}"
UPSTREAM_URL = "http://127.0.0.1:1"
INTERNAL_KEY = "internal-key-of-llama-server"
MAX_BODY_BYTES = 64 * 1024
RETRY_AFTER_S = 2
# How long a hand-driven exchange may take to reach the point a test waits for.
EXCHANGE_TIMEOUT_S = 5.0
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
# What the fake llama-server counts for CHAT's prompt: its template renders "<user>hi", one token a character.
CHAT_PROMPT_TOKENS = 8


@dataclass
class ProxyUnderTest:
    app: RouteTable  # the listener's table: the health, inference and models rows (and /metrics when given)
    proxy_app: ProxyApp
    upstream: FakeLlamaUpstream
    slots: Slots
    sink: RecordingSink
    rejected: list[tuple[str, int]] = field(default_factory=list)
    state: NodeState = "ready"

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=ExchangeTransport(self.app), base_url=BASE_URL, **kwargs)

    def exchange(self, method: str, path: str, **kwargs: Any) -> Exchange:
        return Exchange(self.app, method, path, **kwargs)


def build_proxy(
    *,
    slots: int = 2,
    api_key: str | None = None,
    upstream: FakeLlamaUpstream | None = None,
    real_client: UpstreamClient | None = None,
    upstream_url: str = UPSTREAM_URL,
    extra_sinks: tuple[Any, ...] = (),
    metrics: ExtraRoute | None = None,
) -> ProxyUnderTest:
    """The proxy as the node builds it. It talks to `upstream` (the in-process fake) unless
    given a `real_client`, which it sends to `upstream_url` with the internal key."""
    fake = upstream or FakeLlamaUpstream()
    node_slots = Slots(total=slots)
    sink = RecordingSink()
    rejected: list[tuple[str, int]] = []
    holder: dict[str, ProxyUnderTest] = {}

    def state() -> NodeState:
        return "draining" if node_slots.draining else holder["proxy"].state

    def health() -> HealthReport:
        return HealthReport(state=state(), model=ALIAS, slots_total=node_slots.total, slots_busy=node_slots.in_flight)

    def target() -> UpstreamTarget | None:
        return UpstreamTarget(upstream_url, INTERNAL_KEY) if holder["proxy"].state == "ready" else None

    app = build_node_proxy(
        NodeSettings(max_body_bytes=MAX_BODY_BYTES, retry_after_s=RETRY_AFTER_S, api_key=api_key),
        upstream=target,
        client=real_client or fake,
        slots=node_slots,
        prompt_counter=PromptCounter(real_client or fake, RETRY_AFTER_S),
        model_name=ALIAS,
        health=health,
        usage_sinks=[*extra_sinks, sink],
        on_rejected=lambda path, status: rejected.append((path, status)),
    )
    holder["proxy"] = ProxyUnderTest(node_table(NodeDoors(app, health, metrics=metrics)), app, fake, node_slots, sink, rejected)
    return holder["proxy"]


class Exchange:
    """One HTTP request to an ASGI app, driven by hand.

    Use as `async with`: the app runs in a task from entry; leaving the block hangs up
    (as a client closing its connection would) and waits for the app to finish.
    """

    def __init__(
        self,
        app: Callable[..., Any],
        method: str,
        path: str,
        *,
        json_body: object | None = None,
        body: bytes = b"",
        body_chunks: list[bytes] | None = None,
        headers: dict[str, str] | None = None,
        client: tuple[str, int] = ("127.0.0.1", 50000),
    ) -> None:
        self._app = app
        # The request body as it arrives: one message, or one per chunk (no content-length then).
        self._body_chunks = body_chunks if body_chunks is not None else [json.dumps(json_body).encode() if json_body is not None else body]
        raw_headers = {"host": NODE_HOST, "content-type": "application/json"}
        if body_chunks is None:
            raw_headers["content-length"] = str(len(self._body_chunks[0]))
        raw_headers.update(headers or {})
        self._scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in raw_headers.items()],
            "client": client,
            "server": ("127.0.0.1", 8080),
        }
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.body = b""
        self.complete = False  # the app sent its last body message
        self.app_done = anyio.Event()
        self._request_messages_sent = 0
        self._hung_up = anyio.Event()
        self._changed = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> Exchange:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._run)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        if not self.complete:
            self.hang_up()  # leaving before the answer ended is hanging up; after, the app just finishes
        with anyio.fail_after(EXCHANGE_TIMEOUT_S):
            await self.app_done.wait()
        self.hang_up()
        assert self._tg is not None
        return await self._tg.__aexit__(exc_type, exc, tb)

    async def _run(self) -> None:
        try:
            await self._app(self._scope, self._receive, self._send)
        finally:
            self.app_done.set()
            self._notify()

    async def _receive(self) -> dict[str, Any]:
        if self._request_messages_sent < len(self._body_chunks):
            self._request_messages_sent += 1
            more = self._request_messages_sent < len(self._body_chunks)
            return {"type": "http.request", "body": self._body_chunks[self._request_messages_sent - 1], "more_body": more}
        await self._hung_up.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if self._hung_up.is_set():
            return  # uvicorn, which the node runs, drops what is sent on a closed connection
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")
            self.complete = not message.get("more_body", False)
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    def hang_up(self) -> None:
        self._hung_up.set()

    async def wait_until(self, condition: Callable[[], bool], timeout: float = EXCHANGE_TIMEOUT_S) -> None:
        with anyio.fail_after(timeout):
            while not condition():
                if self.app_done.is_set():
                    raise AssertionError(f"the app finished first: status {self.status}, body {self.body[-500:]!r}")
                await self._changed.wait()

    async def read_to_end(self, timeout: float = EXCHANGE_TIMEOUT_S) -> bytes:
        await self.wait_until(lambda: self.complete, timeout)
        return self.body


class ExchangeTransport(httpx.AsyncBaseTransport):
    """An httpx transport that runs each request as an `Exchange` with the app and returns the whole answer."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self._app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        chunks = [chunk async for chunk in request.stream]  # type: ignore[union-attr]
        declared = "content-length" in request.headers
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers.raw}
        exchange = Exchange(
            self._app,
            request.method,
            request.url.path,
            body=b"".join(chunks),
            body_chunks=None if declared else chunks,
            headers=headers,
        )
        async with exchange:
            await exchange.read_to_end()
        assert exchange.status is not None
        # A ByteStream, not `content=`: httpx would add a content-length the app never sent.
        return httpx.Response(exchange.status, headers=list(exchange.headers.items()), stream=httpx.ByteStream(exchange.body))
