"""The proxy under test, in process: a `ProxyApp` built as the node builds it, over `FakeLlamaUpstream`.

Two ways in, both through the public ASGI interface:
- `ProxyUnderTest.client()`: an `httpx.AsyncClient` on `httpx.ASGITransport`, for whole
  answers (it hands back a response only once the app has finished it);
- `Exchange`: one request driven by hand, for what a transport cannot show: reading an
  answer while it is still being produced, and hanging up part way through.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import httpx

from fake_upstream import ALIAS, FakeLlamaUpstream
from meshnet_gguf.admission import Admission
from meshnet_gguf.protocol import HealthReport, NodeState, UsageRecord
from meshnet_gguf.proxy import ProxyApp, ProxyLimits, RouteCheck, UpstreamTarget
from meshnet_gguf.upstream_http import UpstreamClient

BASE_URL = "http://node.test"
UPSTREAM_URL = "http://127.0.0.1:1"
INTERNAL_KEY = "internal-key-of-llama-server"
MAX_BODY_BYTES = 64 * 1024
RETRY_AFTER_S = 2
# How long a hand-driven exchange may take to reach the point a test waits for.
EXCHANGE_TIMEOUT_S = 5.0
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


class RecordingSink:
    """A usage sink that keeps every record it is given."""

    def __init__(self) -> None:
        self.records: list[UsageRecord] = []

    async def record(self, usage: UsageRecord) -> None:
        self.records.append(usage)


@dataclass
class ProxyUnderTest:
    app: ProxyApp
    upstream: FakeLlamaUpstream
    admission: Admission
    sink: RecordingSink
    rejected: list[tuple[str, int]] = field(default_factory=list)
    state: NodeState = "ready"

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=BASE_URL, **kwargs)

    def exchange(self, method: str, path: str, **kwargs: Any) -> Exchange:
        return Exchange(self.app, method, path, **kwargs)


def build_proxy(
    *,
    slots: int = 2,
    api_key: str | None = None,
    route_check: RouteCheck | None = None,
    upstream: FakeLlamaUpstream | None = None,
    real_client: UpstreamClient | None = None,
    upstream_url: str = UPSTREAM_URL,
    extra_sinks: tuple[Any, ...] = (),
    extra_get_routes: dict[str, Any] | None = None,
) -> ProxyUnderTest:
    """The proxy as the node builds it. It talks to `upstream` (the in-process fake) unless
    given a `real_client`, which it sends to `upstream_url` with the internal key."""
    fake = upstream or FakeLlamaUpstream()
    admission = Admission(slots=slots)
    sink = RecordingSink()
    rejected: list[tuple[str, int]] = []
    holder: dict[str, ProxyUnderTest] = {}

    def state() -> NodeState:
        return "draining" if admission.draining else holder["proxy"].state

    def health() -> HealthReport:
        return HealthReport(state=state(), model=ALIAS, slots_total=admission.slots, slots_busy=admission.in_flight)

    def target() -> UpstreamTarget | None:
        return UpstreamTarget(upstream_url, INTERNAL_KEY) if holder["proxy"].state == "ready" else None

    app = ProxyApp(
        upstream=target,
        client=real_client or fake,
        admission=admission,
        limits=ProxyLimits(max_body_bytes=MAX_BODY_BYTES, retry_after_s=RETRY_AFTER_S),
        model_name=ALIAS,
        health=health,
        usage_sinks=[*extra_sinks, sink],
        route_check=route_check,
        api_key=api_key,
        extra_get_routes=extra_get_routes,
        on_rejected=lambda path, status: rejected.append((path, status)),
    )
    holder["proxy"] = ProxyUnderTest(app, fake, admission, sink, rejected)
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
        headers: dict[str, str] | None = None,
    ) -> None:
        self._app = app
        self._body = json.dumps(json_body).encode() if json_body is not None else body
        raw_headers = {"content-type": "application/json", "content-length": str(len(self._body)), **(headers or {})}
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
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8080),
        }
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.body = b""
        self.complete = False  # the app sent its last body message
        self.app_done = anyio.Event()
        self._request_sent = False
        self._hung_up = anyio.Event()
        self._changed = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> Exchange:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._run)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self.hang_up()
        with anyio.fail_after(EXCHANGE_TIMEOUT_S):
            await self.app_done.wait()
        assert self._tg is not None
        return await self._tg.__aexit__(exc_type, exc, tb)

    async def _run(self) -> None:
        try:
            await self._app(self._scope, self._receive, self._send)
        finally:
            self.app_done.set()
            self._notify()

    async def _receive(self) -> dict[str, Any]:
        if not self._request_sent:
            self._request_sent = True
            return {"type": "http.request", "body": self._body, "more_body": False}
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
