#!/usr/bin/env python3
"""Which transport for the relay's tunnel connections: raw bytes after an HTTP/1.1 Upgrade, or WebSocket?

    .venv/bin/python bench/bench_tunnel_transport.py

A node-side work connection carries TLS records between the relay and the node.
This measures, on loopback in one process (uvloop), what each transport adds to
that hop: the round trip of a small record (an SSE event's TLS record is ~100
bytes) and the CPU per MB of a bulk copy. Raw: asyncio streams, the bytes as
they are. WebSocket: the `websockets` package (its C speedups for masking), one
binary message per record, client to server masked as RFC 6455 requires.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import websockets

ROUND_TRIPS = 3000
RECORD = b"\x17\x03\x03" + b"r" * 120
BULK_CHUNK = 16 * 1024
BULK_BYTES = 256 * 1024 * 1024


async def raw() -> tuple[float, float]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    times = []
    for _ in range(ROUND_TRIPS):
        t = time.perf_counter()
        writer.write(RECORD)
        await reader.readexactly(len(RECORD))
        times.append(time.perf_counter() - t)
    cpu = time.process_time()
    chunk = b"b" * BULK_CHUNK

    async def drain_all() -> None:
        got = 0
        while got < BULK_BYTES:
            got += len(await reader.read(65536))

    reading = asyncio.create_task(drain_all())
    for _ in range(BULK_BYTES // BULK_CHUNK):
        writer.write(chunk)
        await writer.drain()
    await reading
    cpu_per_mb = (time.process_time() - cpu) / (BULK_BYTES / 2**20)
    writer.close()
    server.close()
    return statistics.median(times), cpu_per_mb


async def ws() -> tuple[float, float]:
    async def echo(connection: websockets.asyncio.server.ServerConnection) -> None:
        async for message in connection:
            await connection.send(message)

    async with websockets.serve(echo, "127.0.0.1", 0, compression=None, max_size=None) as server:
        port = server.sockets[0].getsockname()[1]
        async with websockets.connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as client:
            times = []
            for _ in range(ROUND_TRIPS):
                t = time.perf_counter()
                await client.send(RECORD)
                await client.recv()
                times.append(time.perf_counter() - t)
            cpu = time.process_time()
            chunk = b"b" * BULK_CHUNK

            async def drain_all() -> None:
                got = 0
                while got < BULK_BYTES:
                    got += len(await client.recv())

            reading = asyncio.create_task(drain_all())
            for _ in range(BULK_BYTES // BULK_CHUNK):
                await client.send(chunk)
            await reading
            cpu_per_mb = (time.process_time() - cpu) / (BULK_BYTES / 2**20)
    return statistics.median(times), cpu_per_mb


def main() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    for name, bench in (("raw (HTTP/1.1 Upgrade)", raw), ("WebSocket (websockets)", ws)):
        rtt, cpu = asyncio.run(bench())
        print(f"| {name} | {rtt * 1e6:.0f} µs | {cpu * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
