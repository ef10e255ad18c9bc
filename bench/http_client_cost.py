#!/usr/bin/env python3
"""What one streamed request costs the client side of a hop, by HTTP client: httpx (what the
reference tracker forwarded with) against the node's own lean client (`common/http1_client.py`),
as the node uses it for llama-server (a new connection for each stream, `raw`) and as the
tracker uses it for nodes (a streamed answer's connection kept for the next, `kept`).

    PYTHONPATH=src python bench/http_client_cost.py [--requests N]

A local asyncio server answers each POST at once with a chunked SSE head and one event; each
client sends the same request (a route-sized header included) and reads the first chunk. It
prints the p50 time to that chunk and the CPU per request, two rounds each, alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import httpx

from meshnet_gguf.common.http1_client import Http1Client
from meshnet_gguf.llama.upstream.raw import RawUpstream

_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
_EVENT = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
_ANSWER = _HEAD + b"%x\r\n" % len(_EVENT) + _EVENT + b"\r\n0\r\n\r\n"
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
HEADERS = {"content-type": "application/json", "x-meshnet-route": "x" * 600, "x-request-id": "req-1"}
WARMUP_REQUESTS = 200
ROUNDS = 2


class _InstantServer(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.received = b""

    def data_received(self, data: bytes) -> None:
        self.received += data
        if b"\r\n\r\n" in self.received and self.received.endswith(BODY):
            self.received = b""
            self.transport.write(_ANSWER)  # type: ignore[attr-defined]


async def measure(requests: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_InstantServer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    raw = RawUpstream(8)
    kept = Http1Client(8, keep_streamed=True)  # the tracker's: a node's uvicorn keeps streamed answers' connections
    async with httpx.AsyncClient(trust_env=False) as http:

        async def with_httpx() -> None:
            response = await http.send(http.build_request("POST", url, content=BODY, headers=HEADERS), stream=True)
            async for _ in response.aiter_raw():
                break
            await response.aclose()

        async def with_raw() -> None:
            response = await raw.send("POST", url, HEADERS, BODY)
            async for _ in response.iter_chunks():
                break
            await response.aclose()

        async def with_kept() -> None:
            response = await kept.send("POST", url, HEADERS, BODY)
            async for _ in response.iter_chunks():
                pass
            await response.aclose()

        clients: list[tuple[str, Callable[[], Awaitable[None]]]] = [("httpx", with_httpx), ("raw", with_raw), ("kept", with_kept)] * ROUNDS
        for name, one in clients:
            for _ in range(WARMUP_REQUESTS):
                await one()
            samples = []
            cpu = time.process_time()
            for _ in range(requests):
                started = time.perf_counter()
                await one()
                samples.append(time.perf_counter() - started)
            cpu = time.process_time() - cpu
            print(f"{name:>6}: first chunk p50 {statistics.median(samples) * 1e6:6.0f} µs, CPU {cpu / requests * 1e6:6.0f} µs a request")
    print(f"  (kept: {kept.opened} connection(s) opened for {len(clients) // 3 * (requests + WARMUP_REQUESTS)} requests)")
    await raw.aclose()
    await kept.aclose()
    server.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(measure(args.requests))
    else:
        uvloop.run(measure(args.requests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
