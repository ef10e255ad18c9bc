"""httpx's streamed answer as an `HttpAnswer`, its errors as the lean client's: the one adapter the
node's `--upstream-client httpx` and the reference tracker's https (and TLS-in-TLS relayed) nodes share.

`send_through_httpx` raises HttpConnectError when no connection was made (the server never saw the
request, so another may be tried) and HttpClientError for any other failure; reading the body raises
HttpClientError when the connection breaks. Messages name the peer as `Http1Client`'s do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from meshnet_gguf.common.http1_client import HttpAnswer, HttpClientError, HttpConnectError

# httpx's errors that mean no connection was made: the server never saw the request (ProxyError: a
# relay that holds no tunnel for it right now).
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError)


async def send_through_httpx(client: httpx.AsyncClient, request: httpx.Request, *, peer: str) -> HttpAnswer:
    """Send `request` with `client`; the answer's body is not read yet. `peer` names the server in errors."""
    try:
        return HttpxAnswer(await client.send(request, stream=True), peer)
    except _NEVER_SENT as exc:
        raise HttpConnectError(f"{peer} unreachable: {exc!r}") from exc
    except httpx.HTTPError as exc:
        raise HttpClientError(f"{peer} unreachable: {exc!r}") from exc


class HttpxAnswer:
    """An `HttpAnswer` over an httpx response opened with `stream=True`."""

    __slots__ = ("_peer", "_response", "headers", "status")

    def __init__(self, response: httpx.Response, peer: str) -> None:
        self._response = response
        self._peer = peer
        self.status = response.status_code
        self.headers = list(response.headers.items())

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise HttpClientError(f"{self._peer} connection broke: {exc!r}") from exc

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_chunks()])

    async def aclose(self) -> None:
        await self._response.aclose()


__all__ = ["HttpxAnswer", "send_through_httpx"]
