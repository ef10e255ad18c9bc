"""A lean HTTP/1.1 client: one asyncio protocol per connection with httptools (the C parser
uvicorn already uses) doing the framing, and a pool of the connections the server keeps alive.

The node reaches llama-server with it (`llama/upstream/raw.RawUpstream`, the only client that
reaches the floor of that hop, bench/RESULTS.md), and the reference tracker its nodes over plain
http: about 0.1 ms a streamed request to its first chunk where httpx takes 0.8-1.0 ms
(`bench/http_client_cost.py`). A request is one socket write; the body is handed on in whatever
arrived since the last read, so a slow reader gets fewer, larger pieces.

Servers are reached over a UNIX socket (`http+unix://<percent-encoded socket path>` URLs, see
`unix_socket_url`) or TCP (`http://host:port`). A client given an `open_connection` reaches
its server however that says (the reference tracker's: CONNECT through a relay, then TLS
pinned to the node's certificate; `reference/tracker/relay_dialer`), and then takes `https://` URLs;
it speaks no TLS of its own.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple, Protocol
from urllib.parse import quote, unquote

import httptools

UNIX_SCHEME = "http+unix://"
# Connecting over loopback is instant unless the server is wedged.
CONNECT_TIMEOUT_S = 5.0
# A UNIX socket whose accept queue is full refuses a connect at once (EAGAIN) where TCP would
# queue the SYN: llama-server's queue is short, and a burst of requests overflows it. Such a
# connect is tried again after a pause this long, doubling up to the cap, within CONNECT_TIMEOUT_S.
BUSY_SOCKET_FIRST_PAUSE_S = 0.0005
BUSY_SOCKET_MAX_PAUSE_S = 0.02
BUSY_ERRNOS = frozenset({errno.EAGAIN, errno.EWOULDBLOCK})
# Longest silence tolerated between two bytes of an answer (unless the client is given its
# own): a long prompt's prefill on a big model sends nothing for minutes, so this is generous;
# a dead server closes its sockets and is noticed at once regardless.
READ_IDLE_TIMEOUT_S = 900.0
# Idle connections kept beyond one per expected concurrent request (health probes and the like).
POOL_HEADROOM = 8
# Fresh-connection retries after a pooled connection turned out closed before any answer.
STALE_CONNECTION_RETRIES = 1
# llama-server (cpp-httplib) closes a connection idle for 5 s, as uvicorn does. A pooled one
# kept longer can be reused just as the server closes it, and the request fails with "Can not
# write request body"; dropping idle ones first avoids that race.
IDLE_CONNECTION_TTL_S = 4.0
# Bytes of a response held before the client stops reading from the socket (back-pressure to
# the server when whoever reads the answer reads slower than the server writes).
MAX_BUFFERED_BYTES = 32 * 1024


def unix_socket_url(socket_path: str) -> str:
    """The base URL for a server listening on the UNIX socket `socket_path`."""
    return UNIX_SCHEME + quote(socket_path, safe="")


class Address(NamedTuple):
    unix_path: str | None
    host: str
    port: int
    tls: bool = False  # an https:// URL: reached only through an `open_connection` that speaks TLS


# Connects `protocol` to the server however it is reached; when it returns, the protocol's
# `connection_made` has been called with a transport that carries plain HTTP.
ConnectionOpener = Callable[[asyncio.Protocol], Awaitable[None]]


class HttpClientError(Exception):
    """The server could not be reached, or the connection broke mid-answer."""


class HttpConnectError(HttpClientError):
    """No connection could be made: the server never saw the request."""


def split_url(url: str) -> tuple[Address, str]:
    """(where to connect, request target) of an `http://host:port/...` or `http+unix://...` URL."""
    if url.startswith(UNIX_SCHEME):
        rest = url[len(UNIX_SCHEME) :]
        cut = rest.find("/")
        cut = len(rest) if cut < 0 else cut
        return Address(unquote(rest[:cut]), "localhost", 0), rest[cut:] or "/"
    tls = url.startswith("https://")
    if not tls and not url.startswith("http://"):
        raise HttpClientError(f"unsupported URL {url!r} (http://, https:// or {UNIX_SCHEME} only)")
    rest = url[len("https://" if tls else "http://") :]
    cut = rest.find("/")
    cut = len(rest) if cut < 0 else cut
    host, _, port = rest[:cut].rpartition(":")
    if not host or not port.isdigit():
        host, port = rest[:cut], ("443" if tls else "80")
    return Address(None, host.strip("[]"), int(port), tls), rest[cut:] or "/"


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to the server; httptools calls the `on_*` methods as bytes arrive."""

    def __init__(self, loop: asyncio.AbstractEventLoop, peer: str, read_idle_timeout_s: float, keep_streamed: bool) -> None:
        self._loop = loop
        self._peer = peer
        self._read_idle_timeout_s = read_idle_timeout_s
        self._keep_streamed = keep_streamed
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        # Between `start` and the pool taking it back: bytes outside that are bytes nobody asked for.
        self.in_use = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        # One silence timer per connection, re-armed only when it fires: arming a timer per
        # wait (per streamed token) cost more than the rest of the token's handling.
        self._last_io = loop.time()
        self._silence_timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self.error: HttpClientError | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._unasked = False

    # --- asyncio.Protocol -------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.in_use:
            # A pooled connection the server writes to unasked: what it sent would be read as the
            # answer to the next request sent on it, so the connection is dropped instead.
            self._fail(f"{self._peer} sent bytes on an idle connection")
            return
        self.got_bytes = True
        self._last_io = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(f"{self._peer} answered with a protocol upgrade")
        except httptools.HttpParserError as exc:
            self._fail(f"{self._peer} sent malformed HTTP: {exc}")
        # One wake-up per socket read, however many body pieces it held.
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._silence_timer is not None:
            self._silence_timer.cancel()
        if not self.complete and self.error is None:
            if self.headers_done and self._reads_until_close():
                self.complete = True
            else:
                self.error = HttpClientError(f"{self._peer} closed the connection mid-answer ({exc or 'EOF'})")
        self._wake()

    # --- httptools callbacks ------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:
            # A second answer to one request: bytes nobody asked for, which the next request on
            # this connection would take for its own. The answer already read stands; the rest
            # is dropped with the connection.
            self._unasked = True
            self._fail(f"{self._peer} sent a second answer to one request")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._unasked:
            self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        if self._unasked:
            return
        self.status = self._parser.get_status_code()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if self._unasked:
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > MAX_BUFFERED_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self._unasked:
            return
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    # --- used by the client -----------------------------------------------------------
    def start(self, request: bytes) -> None:
        self._reset()
        self.in_use = True
        self._last_io = self._loop.time()
        assert self.transport is not None
        self.transport.write(request)

    def take(self) -> bytes:
        """Everything received since the last take, as one piece."""
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    @property
    def has_data(self) -> bool:
        return bool(self._chunks)

    async def wait(self) -> None:
        """Until bytes arrive, the answer ends or the connection breaks; HttpClientError after
        the client's read idle timeout of silence."""
        waiter = self._loop.create_future()
        self._waiter = waiter
        if self._silence_timer is None:
            self._silence_timer = self._loop.call_at(self._last_io + self._read_idle_timeout_s, self._check_silence)
        try:
            await waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        self.closed = True
        if self._silence_timer is not None:
            self._silence_timer.cancel()
            self._silence_timer = None
        if self.transport is not None:
            self.transport.close()

    def _check_silence(self) -> None:
        self._silence_timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait() arms a new timer
        if self._loop.time() - self._last_io >= self._read_idle_timeout_s:
            waiter.set_exception(HttpClientError(f"{self._peer} sent nothing for {self._read_idle_timeout_s:.0f} s"))
        else:
            self._silence_timer = self._loop.call_at(self._last_io + self._read_idle_timeout_s, self._check_silence)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, message: str) -> None:
        self.error = HttpClientError(message)
        self.close()

    def reusable(self) -> bool:
        """Whether the next request may use this connection. llama-server (cpp-httplib) closes
        the connection just after a chunked (streamed) answer although it announces keep-alive;
        pooling it would make the next request race that close, so unless the client was told
        its server keeps streamed answers' connections (`keep_streamed`: uvicorn, the node's
        server, does), only answers of a known length are kept."""
        if not (self.complete and self.keep_alive) or self.closed or self._chunks:
            return False
        return self._keep_streamed or any(name.lower() == "content-length" for name, _ in self.headers)

    def _reads_until_close(self) -> bool:
        names = {name.lower() for name, _ in self.headers}
        return "content-length" not in names and "transfer-encoding" not in names


class HttpAnswer(Protocol):
    """An answer whose head has arrived, whichever client fetched it: the one shape the node's proxy
    reads llama-server's answers in and the reference tracker its nodes'. Its body is read with
    `iter_chunks` (or whole with `read`), which raise HttpClientError when the connection breaks; it is
    closed once. `Http1Response` is one as it is (the hot paths adapt nothing); `httpx_answer` adapts
    httpx's."""

    status: int
    headers: list[tuple[str, str]]

    def iter_chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    async def aclose(self) -> None: ...


class Http1Response:
    """An answer whose head has arrived (an `HttpAnswer`); its body is read with `iter_chunks` or `read`."""

    def __init__(self, connection: _Connection, pool: Http1Client, address: Address) -> None:
        self._connection = connection
        self._pool = pool
        self._address = address
        self.status = connection.status
        self.headers = connection.headers

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        connection = self._connection
        while True:
            if connection.has_data:
                yield connection.take()
            elif connection.complete:
                return
            elif connection.error is not None:
                raise connection.error
            else:
                await connection.wait()

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_chunks()])

    async def aclose(self) -> None:
        connection = self._connection
        connection.in_use = False
        if connection.reusable():
            self._pool.release(self._address, connection)
        else:
            # An unfinished answer drops the connection, so the server (llama-server) sees the client
            # gone and frees the slot.
            connection.close()


class Http1Client:
    """asyncio protocols + httptools, with a pool of the connections the server keeps alive.

    `peer` names the server in errors ("llama-server", "node"); `read_idle_timeout_s` is the
    longest silence within an answer (default READ_IDLE_TIMEOUT_S). `open_connection`, when
    given, makes every new connection (a URL then names only the Host and the path);
    `connect_timeout_s` bounds each one. `keep_streamed`: the server keeps a connection alive
    after a chunked answer, so it is pooled too; `idle_ttl_s`: a pooled connection idle longer
    is dropped, not reused (keep it under the server's own idle close). `resend_on_stale: False` where
    a pooled connection that ends unanswered may still have delivered the request (a tunnel whose relay
    died after forwarding it): the request is then never sent twice.

    After `aclose`, answers still being read finish; their connections are closed, not pooled.
    """

    def __init__(
        self,
        max_connections: int,
        *,
        peer: str = "the server",
        read_idle_timeout_s: float | None = None,
        open_connection: ConnectionOpener | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        keep_streamed: bool = False,
        idle_ttl_s: float = IDLE_CONNECTION_TTL_S,
        resend_on_stale: bool = True,
    ) -> None:
        self._peer = peer
        self._read_idle_timeout_s = READ_IDLE_TIMEOUT_S if read_idle_timeout_s is None else read_idle_timeout_s
        self._max_idle = max_connections + POOL_HEADROOM
        self._idle: dict[Address, deque[_Connection]] = {}
        self._open_connection = open_connection
        self._connect_timeout_s = connect_timeout_s
        self._keep_streamed = keep_streamed
        self._idle_ttl_s = idle_ttl_s
        self._resend_on_stale = resend_on_stale
        self._closed = False
        self.opened = 0  # connections made so far (a pool that works reuses them)

    async def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> Http1Response:
        """Send a request (header names in lower case); the answer's body is not read yet. Raises
        HttpClientError, HttpConnectError when no connection could be made (the server never saw it)."""
        address, target = split_url(url)
        request = _request_bytes(method, target, address, headers, body)
        for attempt in range(STALE_CONNECTION_RETRIES + 1):
            connection, reused = await self._acquire(address)
            try:
                connection.start(request)
                while not connection.headers_done:
                    if connection.error is not None:
                        raise connection.error
                    await connection.wait()
            except HttpClientError as exc:
                connection.close()
                if self._resend_on_stale and reused and not connection.got_bytes and attempt < STALE_CONNECTION_RETRIES:
                    # A pooled connection the server had already closed: no answer came, so
                    # the request never ran; a fresh connection is safe to try.
                    continue
                raise HttpClientError(f"{self._peer} unreachable: {exc}") from exc
            except BaseException:
                connection.close()  # cancelled: the request is abandoned with its connection
                raise
            return Http1Response(connection, self, address)
        raise AssertionError("unreachable")

    def release(self, address: Address, connection: _Connection) -> None:
        idle = self._idle.setdefault(address, deque())
        if self._closed or len(idle) >= self._max_idle:
            connection.close()
            return
        connection.idle_since = asyncio.get_running_loop().time()
        idle.append(connection)

    async def _acquire(self, address: Address) -> tuple[_Connection, bool]:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(address)
        while idle:
            connection = idle.pop()
            if connection.closed or loop.time() - connection.idle_since > self._idle_ttl_s:
                connection.close()
                continue
            return connection, True
        if self._closed:
            raise HttpConnectError(f"the client for {self._peer} is closed")
        connection = _Connection(loop, self._peer, self._read_idle_timeout_s, self._keep_streamed)
        try:
            if self._open_connection is not None:
                await asyncio.wait_for(self._open_connection(connection), self._connect_timeout_s)
            elif address.tls:
                raise HttpConnectError(f"{self._peer}: https needs a client made with an open_connection that speaks TLS")
            elif address.unix_path is not None:
                sock = await _connect_unix(address.unix_path, loop.time() + self._connect_timeout_s)
                await loop.create_unix_connection(lambda: connection, sock=sock)
            else:
                connecting = loop.create_connection(lambda: connection, address.host, address.port)
                await asyncio.wait_for(connecting, self._connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:  # the second is no OSError before Python 3.11
            where = address.unix_path or f"{address.host}:{address.port}"
            raise HttpConnectError(f"{self._peer} unreachable at {where}: {exc!r}") from exc
        self.opened += 1
        return connection, False

    def close(self) -> None:
        """Close the kept connections and keep no more; answers being read finish first."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()

    async def aclose(self) -> None:
        self.close()


async def _connect_unix(path: str, deadline: float) -> socket.socket:
    """A connected UNIX socket. Connected here rather than by the event loop: a full accept
    queue makes a non-blocking connect fail with EAGAIN, which uvloop reports as an error and
    asyncio's own loop mistakes for a connect in progress (it then waits forever)."""
    loop = asyncio.get_running_loop()
    pause = BUSY_SOCKET_FIRST_PAUSE_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno not in BUSY_ERRNOS or loop.time() + pause > deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(pause * 2, BUSY_SOCKET_MAX_PAUSE_S)


def _request_bytes(method: str, target: str, address: Address, headers: dict[str, str], body: bytes | None) -> bytes:
    lines = [f"{method} {target} HTTP/1.1"]
    if "host" not in headers:  # a caller's own Host (a pinned address's name) wins; names are lower-case
        lines.append(f"host: {address.host}")
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    if body is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"content-length: {len(body or b'')}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + body if body else head


__all__ = [
    "CONNECT_TIMEOUT_S",
    "READ_IDLE_TIMEOUT_S",
    "Address",
    "ConnectionOpener",
    "Http1Client",
    "Http1Response",
    "HttpClientError",
    "HttpConnectError",
    "split_url",
    "unix_socket_url",
]
