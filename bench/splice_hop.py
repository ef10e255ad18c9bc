#!/usr/bin/env python3
"""The floor of any proxy on this machine: a bare byte splice between a client and llama-server.

    python bench/splice_hop.py --port PORT --to PORT_OR_SOCKET_PATH

Each accepted connection is paired with an upstream connection to llama-server (`--to`: a
loopback port, or the path of a UNIX socket) and bytes are passed both ways as they arrive,
with nothing parsed, checked or counted: asyncio protocols, one `write` per `data_received`.
An upstream connection is opened ahead of need, so a request through the splice makes the
same number of connections on its critical path as one sent to llama-server directly, and
what the splice adds is only the extra process: its socket reads and writes and the wake-ups
between them. `bench_mesh_path.py` measures it paired against direct, like every path;
a node's added TTFT minus this is what the node's own work costs.

Bench use only: no flow control (the bench's answers are a few kilobytes), binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

# How long a connection opened ahead may wait for a client before it is replaced: llama-server
# drops an idle connection after its own keep-alive timeout (5 s by default).
SPARE_MAX_AGE_S = 3.0


class Upstream(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.client: asyncio.Transport | None = None
        self.lost = False
        self.opened_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.opened_at = asyncio.get_running_loop().time()

    def data_received(self, data: bytes) -> None:
        if self.client is not None:
            self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.client is not None:
            self.client.close()


class Splice:
    def __init__(self, to: str) -> None:
        self._to = to
        self._spare: asyncio.Task[Upstream] | None = None

    async def _open(self) -> Upstream:
        loop = asyncio.get_running_loop()
        if self._to.isdigit():
            _, upstream = await loop.create_connection(Upstream, "127.0.0.1", int(self._to))
        else:
            _, upstream = await loop.create_unix_connection(Upstream, self._to)
        return upstream

    def open_spare(self) -> None:
        self._spare = asyncio.get_running_loop().create_task(self._open())

    async def take(self) -> Upstream:
        spare, self._spare = self._spare, None
        self.open_spare()
        if spare is not None:
            try:
                upstream = await spare
            except OSError:
                upstream = None
            if upstream is not None and not upstream.lost and asyncio.get_running_loop().time() - upstream.opened_at < SPARE_MAX_AGE_S:
                return upstream
            if upstream is not None and upstream.transport is not None:
                upstream.transport.close()
        return await self._open()


class Client(asyncio.Protocol):
    def __init__(self, splice: Splice) -> None:
        self._splice = splice
        self._transport: asyncio.Transport | None = None
        self._upstream: Upstream | None = None
        self._early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        asyncio.get_running_loop().create_task(self._pair())

    async def _pair(self) -> None:
        try:
            upstream = await self._splice.take()
        except OSError:
            assert self._transport is not None
            self._transport.close()
            return
        assert upstream.transport is not None and self._transport is not None
        if self._transport.is_closing():  # the client left while its upstream was being opened
            upstream.transport.close()
            return
        upstream.client = self._transport
        self._upstream = upstream
        for data in self._early:
            upstream.transport.write(data)
        self._early.clear()

    def data_received(self, data: bytes) -> None:
        if self._upstream is None:
            self._early.append(data)
        elif self._upstream.transport is not None:
            self._upstream.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._upstream is not None and self._upstream.transport is not None:
            self._upstream.transport.close()


async def serve(port: int, to: str) -> None:
    splice = Splice(to)
    splice.open_spare()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(splice), "127.0.0.1", port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"splice 127.0.0.1:{port} -> {to}", flush=True)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="the loopback port to listen on")
    parser.add_argument("--to", required=True, help="llama-server's loopback port, or its UNIX socket's path")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.to))


if __name__ == "__main__":
    main()
