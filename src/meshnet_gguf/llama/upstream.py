"""The HTTP client for the proxy -> llama-server hop, behind one small interface.

Three implementations, chosen by measurement (`bench/RESULTS.md`, `docs/architecture.md`):

- `raw` (the default): one asyncio protocol per connection with httptools (the
  C parser uvicorn already uses) doing the HTTP framing. A request is one socket
  write; the body is handed on in whatever arrived since the last read, so a
  slow reader gets fewer, larger pieces. Connections llama-server keeps alive are
  reused. It is the only one that reaches the floor of this hop.
- `aiohttp` and `httpx`: the general-purpose clients, kept as fallbacks behind
  `--upstream-client` (imported only when chosen).

llama-server is reached over a UNIX socket where its build supports one
(`http+unix://<percent-encoded socket path>` URLs, see `unix_socket_url`), else
over loopback TCP (`http://127.0.0.1:PORT`).
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol
from urllib.parse import quote, unquote

import httptools

if TYPE_CHECKING:
    import aiohttp
    import httpx

UNIX_SCHEME = "http+unix://"
# Connecting to 127.0.0.1 is instant unless the child is wedged.
CONNECT_TIMEOUT_S = 5.0
# A UNIX socket whose accept queue is full refuses a connect at once (EAGAIN) where TCP would
# queue the SYN: llama-server's queue is short, and a burst of requests overflows it. Such a
# connect is tried again after a pause this long, doubling up to the cap, within CONNECT_TIMEOUT_S.
BUSY_SOCKET_FIRST_PAUSE_S = 0.0005
BUSY_SOCKET_MAX_PAUSE_S = 0.02
_BUSY_ERRNOS = frozenset({errno.EAGAIN, errno.EWOULDBLOCK})
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


class _Address(NamedTuple):
    unix_path: str | None
    host: str
    port: int


def _split_url(url: str) -> tuple[_Address, str]:
    """(where to connect, request target) of an `http://host:port/...` or `http+unix://...` URL."""
    if url.startswith(UNIX_SCHEME):
        rest = url[len(UNIX_SCHEME) :]
        cut = rest.find("/")
        cut = len(rest) if cut < 0 else cut
        return _Address(unquote(rest[:cut]), "localhost", 0), rest[cut:] or "/"
    if not url.startswith("http://"):
        raise UpstreamError(f"unsupported upstream URL {url!r} (http:// or {UNIX_SCHEME} only)")
    rest = url[len("http://") :]
    cut = rest.find("/")
    cut = len(rest) if cut < 0 else cut
    host, _, port = rest[:cut].rpartition(":")
    if not host or not port.isdigit():
        host, port = rest[:cut], "80"
    return _Address(None, host.strip("[]"), int(port)), rest[cut:] or "/"


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


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to llama-server; httptools calls the `on_*` methods as bytes arrive."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
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
        self.error: UpstreamError | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False

    # --- asyncio.Protocol -------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self._last_io = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail("llama-server answered with a protocol upgrade")
        except httptools.HttpParserError as exc:
            self._fail(f"llama-server sent malformed HTTP: {exc}")
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
                self.error = UpstreamError(f"llama-server closed the connection mid-answer ({exc or 'EOF'})")
        self._wake()

    # --- httptools callbacks ------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > RAW_MAX_BUFFERED_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    # --- used by the client -----------------------------------------------------------
    def start(self, request: bytes) -> None:
        self._reset()
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
        """Until bytes arrive, the answer ends or the connection breaks; UpstreamError after
        READ_IDLE_TIMEOUT_S of silence."""
        waiter = self._loop.create_future()
        self._waiter = waiter
        if self._silence_timer is None:
            self._silence_timer = self._loop.call_at(self._last_io + READ_IDLE_TIMEOUT_S, self._check_silence)
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
        if self._loop.time() - self._last_io >= READ_IDLE_TIMEOUT_S:
            waiter.set_exception(UpstreamError(f"llama-server sent nothing for {READ_IDLE_TIMEOUT_S:.0f} s"))
        else:
            self._silence_timer = self._loop.call_at(self._last_io + READ_IDLE_TIMEOUT_S, self._check_silence)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, message: str) -> None:
        self.error = UpstreamError(message)
        self.close()

    def reusable(self) -> bool:
        """Whether the next request may use this connection. llama-server (cpp-httplib) closes
        the connection just after a chunked (streamed) answer although it announces keep-alive;
        pooling it would make the next request race that close, so only answers of a known
        length are kept."""
        if not (self.complete and self.keep_alive) or self.closed or self._chunks:
            return False
        return any(name.lower() == "content-length" for name, _ in self.headers)

    def _reads_until_close(self) -> bool:
        names = {name.lower() for name, _ in self.headers}
        return "content-length" not in names and "transfer-encoding" not in names


class _RawResponse:
    def __init__(self, connection: _Connection, pool: RawUpstream, address: _Address) -> None:
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
        if connection.reusable():
            self._pool.release(self._address, connection)
        else:
            # An unfinished answer drops the connection, so llama-server sees the client
            # gone and frees the slot.
            connection.close()


class RawUpstream:
    """asyncio protocols + httptools, with a pool of the connections llama-server keeps alive."""

    def __init__(self, max_connections: int) -> None:
        self._max_idle = max_connections + POOL_HEADROOM
        self._idle: dict[_Address, deque[_Connection]] = {}

    async def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> UpstreamResponse:
        address, target = _split_url(url)
        request = _request_bytes(method, target, address, headers, body)
        for attempt in range(STALE_CONNECTION_RETRIES + 1):
            connection, reused = await self._acquire(address)
            try:
                connection.start(request)
                while not connection.headers_done:
                    if connection.error is not None:
                        raise connection.error
                    await connection.wait()
            except UpstreamError as exc:
                connection.close()
                if reused and not connection.got_bytes and attempt < STALE_CONNECTION_RETRIES:
                    # A pooled connection llama-server had already closed: no answer came, so
                    # the request never ran; a fresh connection is safe to try.
                    continue
                raise UpstreamError(f"llama-server unreachable: {exc}") from exc
            except BaseException:
                connection.close()  # cancelled: the request is abandoned with its connection
                raise
            return _RawResponse(connection, self, address)
        raise AssertionError("unreachable")

    def release(self, address: _Address, connection: _Connection) -> None:
        idle = self._idle.setdefault(address, deque())
        if len(idle) >= self._max_idle:
            connection.close()
            return
        connection.idle_since = asyncio.get_running_loop().time()
        idle.append(connection)

    async def _acquire(self, address: _Address) -> tuple[_Connection, bool]:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(address)
        while idle:
            connection = idle.pop()
            if connection.closed or loop.time() - connection.idle_since > IDLE_CONNECTION_TTL_S:
                connection.close()
                continue
            return connection, True
        connection = _Connection(loop)
        try:
            if address.unix_path is not None:
                sock = await _connect_unix(address.unix_path, loop.time() + CONNECT_TIMEOUT_S)
                await loop.create_unix_connection(lambda: connection, sock=sock)
            else:
                connecting = loop.create_connection(lambda: connection, address.host, address.port)
                await asyncio.wait_for(connecting, CONNECT_TIMEOUT_S)
        except OSError as exc:
            where = address.unix_path or f"{address.host}:{address.port}"
            raise UpstreamError(f"llama-server unreachable at {where}: {exc!r}") from exc
        return connection, False

    async def aclose(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()


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
            if exc.errno not in _BUSY_ERRNOS or loop.time() + pause > deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(pause * 2, BUSY_SOCKET_MAX_PAUSE_S)


def _request_bytes(method: str, target: str, address: _Address, headers: dict[str, str], body: bytes | None) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"host: {address.host}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    if body is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"content-length: {len(body or b'')}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + body if body else head


class _AiohttpResponse:
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
            options = dict(limit=self._max_connections, force_close=False, keepalive_timeout=IDLE_CONNECTION_TTL_S)
            connector = (
                aiohttp.UnixConnector(path=unix_path, **options) if unix_path else aiohttp.TCPConnector(**options)
            )
            session = self._sessions[unix_path] = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=READ_IDLE_TIMEOUT_S),
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
                read_bufsize=READ_BUFFER_BYTES,
            )
        return session

    async def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> UpstreamResponse:
        import aiohttp

        address, target = _split_url(url)
        if address.unix_path is not None:
            url = "http://localhost" + target
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONNECT_TIMEOUT_S
        pause = BUSY_SOCKET_FIRST_PAUSE_S
        attempt = 0
        while True:
            try:
                response = await self._client(address.unix_path).request(
                    method, url, headers=headers, data=body, allow_redirects=False
                )
                return _AiohttpResponse(response)
            except aiohttp.ClientConnectorError as exc:
                if exc.os_error.errno in _BUSY_ERRNOS and loop.time() + pause < deadline:
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

        address, target = _split_url(url)
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


def make_upstream_client(kind: UpstreamClientKind, max_connections: int) -> UpstreamClient:
    if kind == "aiohttp":
        return AiohttpUpstream(max_connections)
    if kind == "httpx":
        return HttpxUpstream(max_connections)
    return RawUpstream(max_connections)
