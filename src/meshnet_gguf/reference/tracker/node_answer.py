"""A node's answer as the tracker's forwarding reads it, whichever client fetched it.

Plain-http and relayed nodes are reached with the lean client (`common/http1_client`), whose
`Http1Response` is a `NodeAnswer` as it is: the hot path adapts nothing. An https node (and a
relayed one where this Python cannot nest TLS) is reached through httpx, whose answer and
errors `send_through_httpx` turns into the same shape: HttpConnectError when the node never
saw the request, HttpClientError for any other failure, before or during the answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import httpx

from meshnet_gguf.common.http1_client import Http1Client, HttpClientError, HttpConnectError


class NodeAnswer(Protocol):
    """An answer whose head has arrived; its body is read with `iter_chunks`, and it is closed once."""

    status: int
    headers: list[tuple[str, str]]

    def iter_chunks(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class NodeClients:
    """The tracker's clients while its app runs: the lean one for plain-http nodes, httpx (its transport
    the tracker's dialer) for the rest. A relayed node's target brings its own lean client."""

    lean: Http1Client
    http: httpx.AsyncClient


# httpx's errors that mean no connection was made: the node never saw the request (ProxyError: its
# relay holds no tunnel for it right now).
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError)


async def send_through_httpx(http: httpx.AsyncClient, request: httpx.Request) -> NodeAnswer:
    try:
        return _HttpxAnswer(await http.send(request, stream=True))
    except _NEVER_SENT as exc:
        raise HttpConnectError(str(exc)) from exc
    except httpx.HTTPError as exc:
        raise HttpClientError(str(exc)) from exc


class _HttpxAnswer:
    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.headers = list(response.headers.items())

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise HttpClientError(str(exc)) from exc

    async def aclose(self) -> None:
        await self._response.aclose()


__all__ = ["NodeAnswer", "NodeClients", "send_through_httpx"]
