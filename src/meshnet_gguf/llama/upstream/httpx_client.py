"""The httpx upstream client: a general-purpose fallback behind `--upstream-client httpx`
(httpx is imported only when this client is used: `choice` imports this module only then).
Its answers are `common/httpx_answer`'s, the adapter the reference tracker uses too."""

from __future__ import annotations

import httpx

from meshnet_gguf.common.http1_client import (
    CONNECT_TIMEOUT_S,
    IDLE_CONNECTION_TTL_S,
    POOL_HEADROOM,
    READ_IDLE_TIMEOUT_S,
    HttpAnswer,
    split_url,
)
from meshnet_gguf.common.httpx_answer import send_through_httpx
from meshnet_gguf.llama.upstream import UpstreamError

# Longest a request's body may take to write to llama-server.
WRITE_TIMEOUT_S = 60.0
PEER = "llama-server"


class HttpxUpstream:
    def __init__(self, max_connections: int) -> None:
        self._max_connections = max_connections + POOL_HEADROOM
        self._clients: dict[str | None, httpx.AsyncClient] = {}

    def _client(self, unix_path: str | None) -> httpx.AsyncClient:
        client = self._clients.get(unix_path)
        if client is None:
            client = self._clients[unix_path] = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=READ_IDLE_TIMEOUT_S, write=WRITE_TIMEOUT_S, pool=None),
                limits=httpx.Limits(max_connections=self._max_connections, keepalive_expiry=IDLE_CONNECTION_TTL_S),
                transport=httpx.AsyncHTTPTransport(uds=unix_path) if unix_path else None,
            )
        return client

    async def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> HttpAnswer:
        address, target = split_url(url)
        if address.unix_path is not None:
            url = "http://localhost" + target
        client = self._client(address.unix_path)
        try:
            request = client.build_request(method, url, headers=headers, content=body)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{PEER} unreachable: {exc!r}") from exc
        return await send_through_httpx(client, request, peer=PEER)

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
