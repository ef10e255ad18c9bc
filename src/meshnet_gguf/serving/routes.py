"""A listener's HTTP surface as one table: (method, path) -> (guard, handler), and the one body reader.

`RouteTable` is the only ASGI app a listener serves. For each request it finds the row, runs the
row's guard (the rules of `serving/access`), and hands the handler a `Request`; whatever it refuses
is answered in OpenAI's error JSON (`contract/errors`): a path no row takes is a 404, a method no
row of that path takes a 405 (after that path's guard, so a hidden row stays a 404), a declared
body over the row's limit a 413, and a handler's own `ApiError` (raised before it sends anything). `Request.body()` is the one body reader: bounded by the row's
limit, with a deadline.

A row's path is exact, or with `prefix` every path under it (an exact row wins over a prefix).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

import anyio

from meshnet_gguf.common.asgi import Receive, Scope, Send, request_headers
from meshnet_gguf.contract.error_answer import send_error
from meshnet_gguf.contract.errors import ApiError

# A client that trickles its body this slowly is holding a slot's worth of memory for nothing.
BODY_READ_TIMEOUT_S = 30.0


class Request:
    """One request as a row's guard and handler see it: its scope, headers, client, and its body once."""

    # Slots and a plain lazy attribute, not `cached_property` (which takes a lock per read on Python 3.11):
    # every request of the node is one of these.
    __slots__ = ("_headers", "receive", "route", "scope", "send")

    def __init__(self, scope: Scope, receive: Receive, send: Send, route: Route | None) -> None:
        self.scope, self.receive, self.send, self.route = scope, receive, send, route
        self._headers: dict[str, str] | None = None

    @property
    def method(self) -> str:
        return str(self.scope["method"])

    @property
    def path(self) -> str:
        return str(self.scope["path"])

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            self._headers = request_headers(self.scope)
        return self._headers

    @property
    def client(self) -> tuple[str, int] | None:
        client = self.scope.get("client")
        return (str(client[0]), int(client[1])) if client else None

    @property
    def query(self) -> dict[str, str]:
        return dict(parse_qsl(self.scope.get("query_string", b"").decode("latin-1")))

    async def body(self) -> bytes:
        """The whole body, at most the row's `max_body_bytes`."""
        limit = self.route.max_body_bytes if self.route is not None else 0
        return await read_body(self.receive, self.headers, limit)


# Refuses a request by raising `ApiError`; returns when it may go on.
Guard = Callable[[Request], None]
Handler = Callable[[Request], Awaitable[None]]


def open_to_all(request: Request) -> None:
    """The guard of a row anyone may call (its handler may still apply its own admission)."""


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    guard: Guard
    handler: Handler
    # The most body the handler reads; a row that reads none refuses a declared one.
    max_body_bytes: int = 0
    # True: the row takes every path that starts with `path` (which ends in "/").
    prefix: bool = False


def no_route(method: str, path: str) -> ApiError:
    """The answer to a path no row takes; a guard that hides its row from a caller answers the same."""
    return ApiError(404, "not_found", f"No route {method} {path} on this node")


@dataclass
class RouteTable:
    """The ASGI app of a listener: its rows, looked up by (method, path)."""

    rows: tuple[Route, ...]
    _exact: dict[tuple[str, str], Route] = field(init=False, repr=False)
    _prefixed: tuple[Route, ...] = field(init=False, repr=False)

    def __init__(self, rows: Iterable[Route]) -> None:
        self.rows = tuple(rows)
        self._exact = {}
        for row in self.rows:
            if row.prefix:
                continue
            if (row.method, row.path) in self._exact:
                raise ValueError(f"two rows for {row.method} {row.path}")
            self._exact[(row.method, row.path)] = row
        # Longest prefix first: the most specific row takes the path.
        self._prefixed = tuple(sorted((r for r in self.rows if r.prefix), key=lambda r: -len(r.path)))

    def find(self, method: str, path: str) -> tuple[Route | None, Route | None]:
        """The row for (method, path), else None and a row of that path under another method (for 405)."""
        row = self._exact.get((method, path))
        if row is not None:
            return row, None
        other = next((r for (m, p), r in self._exact.items() if p == path), None)
        if other is not None:
            return None, other
        for row in self._prefixed:
            if path.startswith(row.path):
                if row.method == method:
                    return row, None
                other = other or row
        return None, other

    def allowed(self, path: str) -> list[str]:
        exact = [m for (m, p) in self._exact if p == path]
        return exact or [r.method for r in self._prefixed if path.startswith(r.path)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _refuse_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        row, other = self.find(method, path)
        request = Request(scope, receive, send, row)
        try:
            if row is None:
                if other is None:
                    raise no_route(method, path)
                other.guard(request)  # a row hidden from this caller is no row at all
                allow = ", ".join(sorted(set(self.allowed(path))))
                raise ApiError(405, "method_not_allowed", f"{method} is not allowed on {path}", headers={"allow": allow})
            row.guard(request)
            if row.max_body_bytes == 0 and _declared_length(request.headers) > 0:
                raise ApiError(413, "body_too_large", f"{method} {path} takes no request body")
            # A handler may refuse by raising `ApiError` too, before it has sent anything.
            await row.handler(request)
        except ApiError as exc:
            await send_error(send, exc)


async def read_body(receive: Receive, headers: Mapping[str, str], limit: int, timeout_s: float | None = None) -> bytes:
    """A request's whole body: refused (413) once it is declared or grows over `limit`, (408) when it
    is not in within `timeout_s` (`BODY_READ_TIMEOUT_S` unless given), and (499, never sent) when the client leaves."""
    deadline_s = BODY_READ_TIMEOUT_S if timeout_s is None else timeout_s
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "body_too_large", f"Request body of {declared} bytes exceeds this node's limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    with anyio.move_on_after(deadline_s):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ApiError(499, "client_closed", "Client closed the connection")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ApiError(413, "body_too_large", f"Request body exceeds this node's limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
    raise ApiError(408, "body_timeout", f"Request body not received within {deadline_s:.0f} s")


def _declared_length(headers: Mapping[str, str]) -> int:
    declared = headers.get("content-length", "")
    return int(declared) if declared.isdigit() else 0


async def _refuse_lifespan(receive: Receive, send: Send) -> None:
    # Listeners run uvicorn with lifespan off; answer politely if someone turns it on.
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


__all__ = ["BODY_READ_TIMEOUT_S", "Guard", "Handler", "Request", "Route", "RouteTable", "no_route", "open_to_all", "read_body"]
