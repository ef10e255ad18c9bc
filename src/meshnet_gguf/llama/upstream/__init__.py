"""The HTTP client for the proxy -> llama-server hop: this module is its small interface.

Three implementations, one module each, chosen by measurement (`bench/RESULTS.md`,
`docs/architecture.md`); `choice.make_upstream_client` picks one:

- `raw.RawUpstream` (the default): one asyncio protocol per connection with httptools (the
  C parser uvicorn already uses) doing the HTTP framing. A request is one socket
  write; the body is handed on in whatever arrived since the last read, so a
  slow reader gets fewer, larger pieces. Connections llama-server keeps alive are
  reused. It is the only one that reaches the floor of this hop.
- `aiohttp_client` and `httpx_client`: the general-purpose clients, kept as fallbacks behind
  `--upstream-client` (imported only when chosen).

llama-server is reached over a UNIX socket where its build supports one
(`http+unix://<percent-encoded socket path>` URLs, see `common/http1_client.unix_socket_url`), else
over loopback TCP (`http://127.0.0.1:PORT`).
"""

from __future__ import annotations

from typing import Literal, Protocol

from meshnet_gguf.common.http1_client import HttpAnswer, HttpClientError

# Per-connection read buffer of the aiohttp hop (its StreamReader stops reading from the
# socket at twice this). aiohttp's 64 KiB default lets 256 streams whose clients read
# slower than llama-server writes hold 30-110 MB more in the node (bench/RESULTS.md);
# 16 KiB (still ~60 SSE events) bounds that at no measurable cost in events/s.
READ_BUFFER_BYTES = 16 * 1024
UpstreamClientKind = Literal["raw", "aiohttp", "httpx"]


# llama-server could not be reached, or the connection broke mid-answer (every client here raises it).
UpstreamError = HttpClientError


# The name the proxy still reads llama-server's answer by; the answer is the package's one shape,
# `common/http1_client.HttpAnswer`, which every client here returns.
UpstreamResponse = HttpAnswer


class UpstreamClient(Protocol):
    async def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> HttpAnswer:
        """Send a request; the response's body is not read yet. Raises UpstreamError."""
        ...

    async def aclose(self) -> None: ...


__all__ = [
    "READ_BUFFER_BYTES",
    "UpstreamClient",
    "UpstreamClientKind",
    "UpstreamError",
    "UpstreamResponse",
]
