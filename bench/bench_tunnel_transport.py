#!/usr/bin/env python3
"""Which transport for the relay's tunnel connections: raw bytes after an HTTP/1.1 Upgrade, or WebSocket?

    .venv/bin/python bench/bench_tunnel_transport.py

A node-side work connection carries TLS records between the relay and the node.
This measures, on loopback in one process (uvloop), what each transport adds to
that hop: the round trip of a small record (an SSE event's TLS record is ~100
bytes) and the CPU per MB of a bulk copy. Raw: asyncio streams, the bytes as
they are. WebSocket: the `websockets` package (its C speedups for masking), one
binary message per record, client to server masked as RFC 6455 requires.

Then the node's TLS on such a connection: CPU per 150-byte chunk sent through
anyio's `TLSStream` (Python-level MemoryBIO pumping) against the event loop's
own TLS transport, both ends in this process, with the node's Ed25519 certificate.
"""

from __future__ import annotations

import asyncio
import ssl
import statistics
import tempfile
import time
from pathlib import Path

import anyio
import websockets
from anyio.streams.tls import TLSStream
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.contract.node_tls import certificate_pem, node_certificate, server_context

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


TLS_CHUNKS = 20_000
TLS_CHUNK = b"x" * 150


def tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    key = Ed25519PrivateKey.generate()
    folder = Path(tempfile.mkdtemp())
    (folder / "cert.pem").write_bytes(certificate_pem(node_certificate(key)))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (folder / "key.pem").write_bytes(pem)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    return server_context(str(folder / "cert.pem"), str(folder / "key.pem")), client


async def tls_cost(native: bool) -> float:
    server_ctx, client_ctx = tls_contexts()
    done = asyncio.Event()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got = 0
        while got < TLS_CHUNKS * len(TLS_CHUNK):
            data = await reader.read(65536)
            if not data:
                break
            got += len(data)
        done.set()

    server = await asyncio.start_server(sink, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    cpu = time.process_time()
    if native:
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx, server_hostname="node")
        for _ in range(TLS_CHUNKS):
            writer.write(TLS_CHUNK)
            await writer.drain()
    else:
        stream = await TLSStream.wrap(await anyio.connect_tcp("127.0.0.1", port), ssl_context=client_ctx,
                                      hostname="node", standard_compatible=False)  # fmt: skip
        for _ in range(TLS_CHUNKS):
            await stream.send(TLS_CHUNK)
    await done.wait()
    server.close()
    return (time.process_time() - cpu) / TLS_CHUNKS


def main() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    print("| transport | round trip of a 123-byte record (median) | CPU per MB, bulk copy |")
    for name, bench in (("raw (HTTP/1.1 Upgrade)", raw), ("WebSocket (websockets)", ws)):
        rtt, cpu = asyncio.run(bench())
        print(f"| {name} | {rtt * 1e6:.0f} µs | {cpu * 1e3:.2f} ms |")
    for name, native in (("anyio TLSStream", False), ("event loop's TLS", True)):
        print(f"| {name} | {asyncio.run(tls_cost(native)) * 1e6:.1f} µs CPU per 150-byte chunk |")


if __name__ == "__main__":
    main()
