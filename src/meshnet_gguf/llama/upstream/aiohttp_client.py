"""The aiohttp upstream client: a general-purpose fallback behind `--upstream-client aiohttp`
(aiohttp is imported only when this client is used)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from meshnet_gguf.common.http1_client import (
    BUSY_ERRNOS,
    BUSY_SOCKET_FIRST_PAUSE_S,
    BUSY_SOCKET_MAX_PAUSE_S,
    CONNECT_TIMEOUT_S,
    IDLE_CONNECTION_TTL_S,
    POOL_HEADROOM,
    READ_IDLE_TIMEOUT_S,
    STALE_CONNECTION_RETRIES,
    HttpAnswer,
    split_url,
)
from meshnet_gguf.llama.upstream import READ_BUFFER_BYTES, UpstreamError

if TYPE_CHECKING:
    import aiohttp


class _AiohttpResponse:
    """An `HttpAnswer` over an aiohttp response."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers = [(k, v) for k, v in response.headers.items()]

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        import aiohttp

        content = self._response.content
        try:
            # readany() returns whatever arrived (b"" at the end): no re-chunking to a fixed
            # size. Called directly, not through iter_any(), to save a wrapper per chunk.
            while chunk := await content.readany():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(f"llama-server connection broke: {exc!r}") from exc

    async def read(self) -> bytes:
        import aiohttp

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
        # One session per UNIX socket (aiohttp binds a socket path to a connector), one for TCP.
        self._sessions: dict[str | None, aiohttp.ClientSession] = {}
        self._max_connections = max_connections + POOL_HEADROOM

    def _client(self, unix_path: str | None) -> aiohttp.ClientSession:
        import aiohttp

        # Created lazily: an aiohttp session binds to the running event loop.
        session = self._sessions.get(unix_path)
        if session is None:
            options = {"limit": self._max_connections, "force_close": False, "keepalive_timeout": IDLE_CONNECTION_TTL_S}
            connector = aiohttp.UnixConnector(path=unix_path, **options) if unix_path else aiohttp.TCPConnector(**options)
            session = self._sessions[unix_path] = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=READ_IDLE_TIMEOUT_S),
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
                read_bufsize=READ_BUFFER_BYTES,
            )
        return session

    async def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> HttpAnswer:
        import aiohttp

        address, target = split_url(url)
        if address.unix_path is not None:
            url = "http://localhost" + target
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONNECT_TIMEOUT_S
        pause = BUSY_SOCKET_FIRST_PAUSE_S
        attempt = 0
        while True:
            try:
                response = await self._client(address.unix_path).request(method, url, headers=headers, data=body, allow_redirects=False)
                return _AiohttpResponse(response)
            except aiohttp.ClientConnectorError as exc:
                if exc.os_error.errno in BUSY_ERRNOS and loop.time() + pause < deadline:
                    await asyncio.sleep(pause)  # the socket's accept queue was full: nothing was sent
                    pause = min(pause * 2, BUSY_SOCKET_MAX_PAUSE_S)
                    continue
                raise UpstreamError(f"llama-server unreachable: {exc!r}") from exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if attempt == STALE_CONNECTION_RETRIES:
                    raise UpstreamError(f"llama-server unreachable: {exc!r}") from exc
                attempt += 1
                # A pooled connection llama-server had already closed: no answer came, so the
                # request never ran; a fresh connection is safe to try.
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                raise UpstreamError(f"llama-server unreachable: {exc!r}") from exc

    async def aclose(self) -> None:
        for session in self._sessions.values():
            await session.close()
