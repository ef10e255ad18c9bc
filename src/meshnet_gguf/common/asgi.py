"""The ASGI plumbing every web app of the package shares (the node's listener, the reference
tracker): the types, request headers, the upstream headers never passed on, and the one way an
answer is sent: `respond` whole, or `start_answer` then `send_body` as it streams, so the ASGI
messages are spelt once.

An OpenAI error answer is `contract/error_answer.send_error`: it renders `contract/errors.ApiError`,
and `common` imports nothing else of the package.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

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
# An upstream's response headers that are never passed on: they describe its hop, not ours
# (connection, framing, its server and date), or grant what we never grant (CORS).
NOT_FORWARDED = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date", "access-control-allow-origin"}
)
# Recorded (never sent) as the status of a request whose client left before its answer.
CLIENT_CLOSED_STATUS = 499


def request_headers(scope: Scope) -> dict[str, str]:
    """A request's headers by lower-case name (the last of a repeated one wins)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def forwardable(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """An upstream's response headers that may reach our client, as ASGI header pairs."""
    return [(k.lower().encode(), v.encode()) for k, v in headers if k.lower() not in NOT_FORWARDED]


async def respond(send: Send, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]]) -> None:
    """A whole answer, with its content-length."""
    await start_answer(send, status, [*headers, (b"content-length", str(len(body)).encode())])
    await send_body(send, body, more=False)


async def start_answer(send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
    """An answer's head; its body follows in `send_body` calls, the last with `more=False`."""
    await send({"type": "http.response.start", "status": status, "headers": headers})


async def send_body(send: Send, body: bytes, *, more: bool) -> None:
    """A part of an answer's body; `more=False` ends the answer."""
    await send({"type": "http.response.body", "body": body, "more_body": more})


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
    "send_body",
    "start_answer",
]
