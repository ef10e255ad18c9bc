"""The HTTP client for the proxy -> llama-server hop, behind one small interface.

Two implementations exist because the choice is made by measurement
(`bench/RESULTS.md`): httpx is the design card's client, but its connection
pool serialises on one lock under concurrency (encode/httpx#3215); aiohttp's
connector does not. Both stream the body in the chunks the socket delivers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal, Protocol

import aiohttp
import httpx

# Connecting to 127.0.0.1 is instant unless the child is wedged.
CONNECT_TIMEOUT_S = 5.0
# Longest silence tolerated between two bytes of an upstream answer: a long
# prompt's prefill on a big model sends nothing for minutes, so this is generous;
# a dead child closes its sockets and is noticed at once regardless.
READ_IDLE_TIMEOUT_S = 900.0
# Connections kept to llama-server: one per slot suffices; extra covers health probes.
POOL_HEADROOM = 8
# Fresh-connection retries after a pooled connection turned out closed before any answer.
STALE_CONNECTION_RETRIES = 1
# Per-connection read buffer of the aiohttp hop (its StreamReader stops reading from the
# socket at twice this). aiohttp's 64 KiB default lets 256 streams whose clients read
# slower than llama-server writes hold 30-110 MB more in the node (bench/RESULTS.md);
# 16 KiB (still ~60 SSE events) bounds that at no measurable cost in events/s.
READ_BUFFER_BYTES = 16 * 1024
# llama-server (cpp-httplib) closes a connection idle for 5 s. A pooled one kept
# longer can be reused just as the server closes it, and the request fails with
# "Can not write request body"; dropping idle ones first avoids that race.
IDLE_CONNECTION_TTL_S = 4.0


class UpstreamError(Exception):
    """llama-server could not be reached, or the connection broke mid-answer."""


class UpstreamResponse(Protocol):
    status: int
    headers: list[tuple[str, str]]

    def iter_chunks(self) -> AsyncIterator[bytes]: ...
    async def read(self) -> bytes: ...
    async def aclose(self) -> None: ...


class UpstreamClient(Protocol):
    async def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> UpstreamResponse:
        """Send a request; the response's body is not read yet. Raises UpstreamError."""
        ...

    async def aclose(self) -> None: ...


class _AiohttpResponse:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers = [(k, v) for k, v in response.headers.items()]

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            # readany() returns whatever arrived (b"" at the end): no re-chunking to a fixed
            # size. Called directly, not through iter_any(), to save a wrapper per chunk.
            while chunk := await content.readany():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(f"llama-server connection broke: {exc!r}") from exc

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(f"llama-server connection broke: {exc!r}") from exc

    async def aclose(self) -> None:
        # close(), not release(): an unfinished answer must drop the connection so
        # llama-server sees the client gone and frees the slot.
        self._response.close()


class AiohttpUpstream:
    def __init__(self, max_connections: int) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._max_connections = max_connections + POOL_HEADROOM

    def _client(self) -> aiohttp.ClientSession:
        # Created lazily: an aiohttp session binds to the running event loop.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections, force_close=False, keepalive_timeout=IDLE_CONNECTION_TTL_S
                ),
                timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=READ_IDLE_TIMEOUT_S),
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
                read_bufsize=READ_BUFFER_BYTES,
            )
        return self._session

    async def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> UpstreamResponse:
        for attempt in range(STALE_CONNECTION_RETRIES + 1):
            try:
                response = await self._client().request(method, url, headers=headers, data=body, allow_redirects=False)
                return _AiohttpResponse(response)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if attempt == STALE_CONNECTION_RETRIES:
                    raise UpstreamError(f"llama-server unreachable: {exc!r}") from exc
                # A pooled connection llama-server had already closed: no answer came, so the
                # request never ran; a fresh connection is safe to try.
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                raise UpstreamError(f"llama-server unreachable: {exc!r}") from exc
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class _HttpxResponse:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.headers = list(response.headers.items())

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise UpstreamError(f"llama-server connection broke: {exc!r}") from exc

    async def read(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.HTTPError as exc:
            raise UpstreamError(f"llama-server connection broke: {exc!r}") from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstream:
    def __init__(self, max_connections: int) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=READ_IDLE_TIMEOUT_S, write=60.0, pool=None),
            limits=httpx.Limits(max_connections=max_connections + POOL_HEADROOM, keepalive_expiry=IDLE_CONNECTION_TTL_S),
        )

    async def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> UpstreamResponse:
        try:
            request = self._client.build_request(method, url, headers=headers, content=body)
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"llama-server unreachable: {exc!r}") from exc
        return _HttpxResponse(response)

    async def aclose(self) -> None:
        await self._client.aclose()


def make_upstream_client(kind: Literal["aiohttp", "httpx"], max_connections: int) -> UpstreamClient:
    return AiohttpUpstream(max_connections) if kind == "aiohttp" else HttpxUpstream(max_connections)
