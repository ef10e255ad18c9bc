"""The default upstream client: one asyncio protocol per connection with httptools (the C
parser uvicorn already uses) doing the HTTP framing, and a pool of the connections
llama-server keeps alive. The only client that reaches the floor of this hop (`bench/RESULTS.md`)."""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import AsyncIterator

import httptools

from meshnet_gguf.llama.upstream import (
    BUSY_ERRNOS,
    BUSY_SOCKET_FIRST_PAUSE_S,
    BUSY_SOCKET_MAX_PAUSE_S,
    CONNECT_TIMEOUT_S,
    IDLE_CONNECTION_TTL_S,
    POOL_HEADROOM,
    RAW_MAX_BUFFERED_BYTES,
    READ_IDLE_TIMEOUT_S,
    STALE_CONNECTION_RETRIES,
    Address,
    UpstreamError,
    UpstreamResponse,
    split_url,
)


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
    def __init__(self, connection: _Connection, pool: RawUpstream, address: Address) -> None:
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
        self._idle: dict[Address, deque[_Connection]] = {}

    async def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> UpstreamResponse:
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

    def release(self, address: Address, connection: _Connection) -> None:
        idle = self._idle.setdefault(address, deque())
        if len(idle) >= self._max_idle:
            connection.close()
            return
        connection.idle_since = asyncio.get_running_loop().time()
        idle.append(connection)

    async def _acquire(self, address: Address) -> tuple[_Connection, bool]:
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
            if exc.errno not in BUSY_ERRNOS or loop.time() + pause > deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(pause * 2, BUSY_SOCKET_MAX_PAUSE_S)


def _request_bytes(method: str, target: str, address: Address, headers: dict[str, str], body: bytes | None) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"host: {address.host}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    if body is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"content-length: {len(body or b'')}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + body if body else head
