"""The ASGI plumbing every app of the node's listener shares: the types, request headers, the
headers never passed on from llama-server, and the one way an answer or an OpenAI error is sent.

The proxy, the node's pages and the `/metrics` guard (`serving/access`) all answer through
`respond` and `send_error`, so an answer's framing (content-length, content-type) and an
error's JSON (`contract/errors`) are spelt once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from meshnet_gguf.contract.errors import ApiError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# A GET route answered whole, as (status, body, content type); one that reads its query
# string (the tracker link's control challenge) is given it.
ExtraRoute = Callable[[], Awaitable[tuple[int, bytes, str]]]
QueryRoute = Callable[[Mapping[str, str]], Awaitable[tuple[int, bytes, str]]]

JSON_HEADER = (b"content-type", b"application/json")
# llama-server's response headers that are never passed on: they describe its hop, not ours
# (connection, framing, its server and date), or grant what the node never grants (CORS).
NOT_FORWARDED = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date", "access-control-allow-origin"}
)
# Recorded (never sent) as the status of a request whose client left before its answer.
CLIENT_CLOSED_STATUS = 499


def request_headers(scope: Scope) -> dict[str, str]:
    """A request's headers by lower-case name (the last of a repeated one wins)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def forwardable(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """llama-server's response headers that may reach our client, as ASGI header pairs."""
    return [(k.lower().encode(), v.encode()) for k, v in headers if k.lower() not in NOT_FORWARDED]


async def respond(send: Send, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]]) -> None:
    """A whole answer, with its content-length."""
    all_headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error: ApiError, extra_headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """`error` as OpenAI's error JSON, with its own headers (Retry-After) and `extra_headers`."""
    headers = [JSON_HEADER, *[(k.lower().encode(), v.encode()) for k, v in error.headers.items()], *extra_headers]
    # 499 is log-only (the client is gone anyway); anything sent says 400.
    status = 400 if error.status == CLIENT_CLOSED_STATUS else error.status
    await respond(send, status, error.body(), headers)


__all__ = [
    "CLIENT_CLOSED_STATUS",
    "JSON_HEADER",
    "NOT_FORWARDED",
    "AsgiApp",
    "ExtraRoute",
    "Message",
    "QueryRoute",
    "Receive",
    "Scope",
    "Send",
    "forwardable",
    "request_headers",
    "respond",
    "send_error",
]
