"""Run an ASGI app under uvicorn on 127.0.0.1 inside a test's event loop, and stop it again."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import uvicorn

STARTUP_TIMEOUT_S = 10.0


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the test runner owns signals
        yield


@contextlib.asynccontextmanager
async def serve_asgi(app: Any, port: int, *, lifespan: str = "off") -> AsyncIterator[_QuietServer]:
    server = _QuietServer(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan, timeout_graceful_shutdown=1)
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        with anyio.fail_after(STARTUP_TIMEOUT_S):
            while not server.started:
                if server.should_exit:
                    raise RuntimeError(f"server on port {port} did not start")
                await anyio.sleep(0.01)
        try:
            yield server
        finally:
            server.should_exit = True
