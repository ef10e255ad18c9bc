"""The httpx upstream client: a general-purpose fallback behind `--upstream-client httpx`
(httpx is imported only when this client is used)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from meshnet_gguf.common.http1_client import CONNECT_TIMEOUT_S, IDLE_CONNECTION_TTL_S, POOL_HEADROOM, READ_IDLE_TIMEOUT_S, split_url
from meshnet_gguf.llama.upstream import UpstreamError, UpstreamResponse

if TYPE_CHECKING:
    import httpx


class _HttpxResponse:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.headers = list(response.headers.items())

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        import httpx

        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise UpstreamError(f"llama-server connection broke: {exc!r}") from exc

    async def read(self) -> bytes:
        import httpx

        try:
            return await self._response.aread()
        except httpx.HTTPError as exc:
            raise UpstreamError(f"llama-server connection broke: {exc!r}") from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstream:
    def __init__(self, max_connections: int) -> None:
        self._max_connections = max_connections + POOL_HEADROOM
        self._clients: dict[str | None, httpx.AsyncClient] = {}

    def _client(self, unix_path: str | None) -> httpx.AsyncClient:
        import httpx

        client = self._clients.get(unix_path)
        if client is None:
            client = self._clients[unix_path] = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=READ_IDLE_TIMEOUT_S, write=60.0, pool=None),
                limits=httpx.Limits(max_connections=self._max_connections, keepalive_expiry=IDLE_CONNECTION_TTL_S),
                transport=httpx.AsyncHTTPTransport(uds=unix_path) if unix_path else None,
            )
        return client

    async def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> UpstreamResponse:
        import httpx

        address, target = split_url(url)
        if address.unix_path is not None:
            url = "http://localhost" + target
        client = self._client(address.unix_path)
        try:
            request = client.build_request(method, url, headers=headers, content=body)
            response = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"llama-server unreachable: {exc!r}") from exc
        return _HttpxResponse(response)

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
