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
(`http+unix://<percent-encoded socket path>` URLs, see `unix_socket_url`), else
over loopback TCP (`http://127.0.0.1:PORT`).
"""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from typing import Literal, NamedTuple, Protocol
from urllib.parse import quote, unquote

UNIX_SCHEME = "http+unix://"
# Connecting to 127.0.0.1 is instant unless the child is wedged.
CONNECT_TIMEOUT_S = 5.0
# A UNIX socket whose accept queue is full refuses a connect at once (EAGAIN) where TCP would
# queue the SYN: llama-server's queue is short, and a burst of requests overflows it. Such a
# connect is tried again after a pause this long, doubling up to the cap, within CONNECT_TIMEOUT_S.
BUSY_SOCKET_FIRST_PAUSE_S = 0.0005
BUSY_SOCKET_MAX_PAUSE_S = 0.02
BUSY_ERRNOS = frozenset({errno.EAGAIN, errno.EWOULDBLOCK})
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
# Bytes of a response the raw client holds before it stops reading from the socket
# (back-pressure to llama-server when the proxy's client reads slower than it writes).
RAW_MAX_BUFFERED_BYTES = 2 * READ_BUFFER_BYTES
UpstreamClientKind = Literal["raw", "aiohttp", "httpx"]


def unix_socket_url(socket_path: str) -> str:
    """The base URL for llama-server listening on `socket_path`."""
    return UNIX_SCHEME + quote(socket_path, safe="")


class Address(NamedTuple):
    unix_path: str | None
    host: str
    port: int


def split_url(url: str) -> tuple[Address, str]:
    """(where to connect, request target) of an `http://host:port/...` or `http+unix://...` URL."""
    if url.startswith(UNIX_SCHEME):
        rest = url[len(UNIX_SCHEME) :]
        cut = rest.find("/")
        cut = len(rest) if cut < 0 else cut
        return Address(unquote(rest[:cut]), "localhost", 0), rest[cut:] or "/"
    if not url.startswith("http://"):
        raise UpstreamError(f"unsupported upstream URL {url!r} (http:// or {UNIX_SCHEME} only)")
    rest = url[len("http://") :]
    cut = rest.find("/")
    cut = len(rest) if cut < 0 else cut
    host, _, port = rest[:cut].rpartition(":")
    if not host or not port.isdigit():
        host, port = rest[:cut], "80"
    return Address(None, host.strip("[]"), int(port)), rest[cut:] or "/"


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
