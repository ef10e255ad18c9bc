"""Which upstream client the node uses: `--upstream-client raw|aiohttp|httpx`."""

from __future__ import annotations

from meshnet_gguf.llama.upstream import UpstreamClient, UpstreamClientKind
from meshnet_gguf.llama.upstream.raw import RawUpstream


def make_upstream_client(kind: UpstreamClientKind, max_connections: int) -> UpstreamClient:
    # The fallbacks are imported only when chosen: the default node never loads aiohttp or httpx for this hop.
    if kind == "aiohttp":
        from meshnet_gguf.llama.upstream.aiohttp_client import AiohttpUpstream

        return AiohttpUpstream(max_connections)
    if kind == "httpx":
        from meshnet_gguf.llama.upstream.httpx_client import HttpxUpstream

        return HttpxUpstream(max_connections)
    return RawUpstream(max_connections)
