"""The default upstream client: the node's lean HTTP/1.1 client (`common/http1_client`), named
for llama-server. The only client that reaches the floor of this hop (`bench/RESULTS.md`)."""

from __future__ import annotations

from meshnet_gguf.common.http1_client import Http1Client


class RawUpstream(Http1Client):
    """asyncio protocols + httptools, with a pool of the connections llama-server keeps alive."""

    def __init__(self, max_connections: int) -> None:
        super().__init__(max_connections, peer="llama-server")


__all__ = ["RawUpstream"]
