"""The node's HTTP listener: uvicorn serving the proxy app, as a node part.

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

from meshnet_gguf.node_part import BasePart

log = logging.getLogger(__name__)

# uvicorn's graceful shutdown runs after the node's drain, so it only closes idle keep-alives.
HTTP_SHUTDOWN_TIMEOUT_S = 2.0
# Pending connections the kernel queues before accept(): a burst of clients must not be refused.
LISTEN_BACKLOG = 2048


class ListenError(RuntimeError):
    """The public address cannot be bound; the message says what to do."""


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # type: ignore[override]
        yield


class HttpServerPart(BasePart):
    name = "http"

    def __init__(self, app: Any, host: str, port: int) -> None:
        self._sock = bind_listener(host, port)
        self.host = host
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
        )
        self._server = _Server(config)
        self._done = anyio.Event()

    async def run(self) -> None:
        log.info("node listening on http://%s:%s", self.host, self.port)
        try:
            await self._server.serve([self._sock])
        finally:
            self._done.set()

    async def close(self) -> None:
        self._server.should_exit = True
        with anyio.move_on_after(HTTP_SHUTDOWN_TIMEOUT_S + 1):
            await self._done.wait()
        self._sock.close()


def bind_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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
