"""The node's HTTP listener: uvicorn serving the proxy app, as a node part; a pool worker's
status port listens on the same guarded listener (`cli/worker`).

The socket is bound at construction, so a taken port fails before anything
starts. uvicorn's own signal handling is off: the node drains first, then
closes this part, which lets uvicorn close idle keep-alives and end.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

import anyio
import uvicorn

from meshnet_gguf.contract.errors import openai_error_body
from meshnet_gguf.contract.node_part import BasePart

try:  # uvicorn[standard] brings httptools; plain uvicorn falls back to h11
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - exercised only without the extra
    httptools = None

log = logging.getLogger(__name__)

# uvicorn's graceful shutdown runs after the node's drain, so it only closes idle keep-alives.
HTTP_SHUTDOWN_TIMEOUT_S = 2.0
# Pending connections the kernel queues before accept(): a burst of clients must not be refused.
LISTEN_BACKLOG = 2048
# Request line + headers of one request. httptools sets no limit of its own; 64 KiB is
# far above any real client's (nginx's default is 8 KiB; llama-server's 8 KiB per line).
MAX_REQUEST_HEAD_BYTES = 64 * 1024
# From a connection's first byte (or the end of its previous answer) to the end of its
# headers: a slow-header socket holds a file descriptor and nothing else.
REQUEST_HEAD_TIMEOUT_S = 10.0
# An idle keep-alive connection is closed after this long.
KEEP_ALIVE_TIMEOUT_S = 5.0


class ListenError(RuntimeError):
    """The public address cannot be bound; the message says what to do."""


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # type: ignore[override]
        yield


class HttpServerPart(BasePart):
    name = "http"

    def __init__(self, app: Any, host: str, port: int, *, serves: str = "node") -> None:
        self._sock = bind_listener(host, port)
        self.host = host
        self.serves = serves  # who listens, for the log line: the node, or a pool worker's status port
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=HTTP_SHUTDOWN_TIMEOUT_S,
            # SSE frames must leave as written: uvicorn adds no compression, and no Server header.
            server_header=False,
            date_header=True,
            # uvicorn's loggers propagate to the node's handler (text or JSON) instead of their own.
            log_config=None,
            http=GuardedHttpToolsProtocol if httptools is not None else "h11",
            h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES,
            timeout_keep_alive=int(KEEP_ALIVE_TIMEOUT_S),
        )
        self._server = _Server(config)
        self._done = anyio.Event()

    async def run(self) -> None:
        log.info("%s listening on http://%s:%s", self.serves, self.host, self.port)
        try:
            await self._server.serve([self._sock])
        finally:
            self._done.set()

    async def close(self) -> None:
        self._server.should_exit = True
        with anyio.move_on_after(HTTP_SHUTDOWN_TIMEOUT_S + 1):
            await self._done.wait()
        self._sock.close()


if httptools is not None:

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with a size limit (431) and a deadline (408) on each
        request's head. Bytes are counted as they arrive, before the parser buffers them."""

        _head_bytes = 0
        _reading_head = True
        _head_timer: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._start_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._reading_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._reading_head and self._head_bytes > MAX_REQUEST_HEAD_BYTES and not self.transport.is_closing():
                self._refuse(431, "Request Header Fields Too Large", "head_too_large", "request head over the node's limit")

        def on_headers_complete(self) -> None:
            self._reading_head = False
            self._stop_head_timer()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._start_head()

        def _start_head(self) -> None:
            self._reading_head = True
            self._head_bytes = 0
            self._stop_head_timer()
            self._head_timer = self.loop.call_later(REQUEST_HEAD_TIMEOUT_S, self._head_timed_out)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._reading_head and not self.transport.is_closing():
                if self._head_bytes:
                    self._refuse(408, "Request Timeout", "head_timeout", "request head not received in time")
                else:
                    self.transport.close()  # an idle connection: nothing to answer

        def _refuse(self, status: int, reason: str, code: str, message: str) -> None:
            # Before any app sees the request, in the same OpenAI error JSON as every door behind it.
            body = openai_error_body(message, "invalid_request_error", code)
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (status, reason.encode(), len(body), body)
            )
            self.transport.close()


def bind_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP;
    # without it a response head and body written apart wait ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror} (is another node running? pick --port)") from exc
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


__all__ = ["HTTP_SHUTDOWN_TIMEOUT_S", "HttpServerPart", "ListenError", "bind_listener"]
