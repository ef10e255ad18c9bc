#!/usr/bin/env python3
"""What the relay's splice costs a stream, by how it copies: the relay's own `_splice` (anyio streams,
a task per direction) at several read sizes, against copy loops on the bare sockets (asyncio's
`sock_recv`/`sock_sendall`, and `os.splice` through a pipe, the bytes never entering Python).

    PYTHONPATH=src python bench/relay_splice_cost.py [--rounds 3] [--pings 2000] [--bulk-mb 64]

A splice runs in a child process per variant (one at a time, the variants alternating round by
round); a thread echoes each message back (the node), and the main thread (the tracker) sends a
message the size of one SSE token event and waits for it to come back through the splice, both
ways spliced: the p50 and p90 round trip over `--pings` messages, and the splice's CPU per message.
Then `--bulk-mb` MB one way (a long prompt's body, or a big answer) as throughput. A direct round trip
(no splice) is the floor. Binds 127.0.0.1 only; each child is stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}],"object":"chat.completion.chunk"}\n\n'
VARIANTS = ("anyio-16k", "anyio-64k", "anyio-256k", "sock", "os-splice")
PIPE_BYTES = 1 << 20


# --- the splice (child process) -------------------------------------------------
async def _splice_anyio(a: socket.socket, b: socket.socket, chunk: int) -> None:
    """The relay's own splice, as it runs between a tracker's CONNECT and a node's work connection."""
    from anyio.abc import SocketStream

    from meshnet_gguf.reference.relay import server as relay

    relay.SPLICE_CHUNK_BYTES = chunk
    await relay._splice(await SocketStream.from_socket(a), await SocketStream.from_socket(b))


async def _both_ways(pump, a: socket.socket, b: socket.socket) -> None:  # type: ignore[no-untyped-def]
    """Both directions until either ends (as the relay's splice), then both sockets closed."""
    tasks = [asyncio.ensure_future(pump(a, b)), asyncio.ensure_future(pump(b, a))]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    a.close()
    b.close()


async def _splice_sock(a: socket.socket, b: socket.socket) -> None:
    loop = asyncio.get_running_loop()

    async def pump(src: socket.socket, dst: socket.socket) -> None:
        buf = bytearray(64 * 1024)
        while n := await loop.sock_recv_into(src, buf):
            await loop.sock_sendall(dst, memoryview(buf)[:n])

    await _both_ways(pump, a, b)


async def _splice_os(a: socket.socket, b: socket.socket) -> None:
    loop = asyncio.get_running_loop()

    async def ready(fd: int, write: bool) -> None:
        done = loop.create_future()
        (loop.add_writer if write else loop.add_reader)(fd, lambda: done.done() or done.set_result(None))
        try:
            await done
        finally:
            (loop.remove_writer if write else loop.remove_reader)(fd)

    async def pump(src: socket.socket, dst: socket.socket) -> None:
        r, w = os.pipe()
        flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
        try:
            while True:
                try:
                    n = os.splice(src.fileno(), w, PIPE_BYTES, flags=flags)
                except BlockingIOError:
                    await ready(src.fileno(), False)
                    continue
                if n == 0:
                    return
                while n:
                    try:
                        n -= os.splice(r, dst.fileno(), n, flags=flags)
                    except BlockingIOError:
                        await ready(dst.fileno(), True)
        finally:
            os.close(r)
            os.close(w)

    await _both_ways(pump, a, b)


def child(variant: str, upstream_port: int) -> None:
    import anyio

    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        while True:
            a, _ = await loop.sock_accept(listener)
            b = socket.create_connection(("127.0.0.1", upstream_port))
            for s in (a, b):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.setblocking(False)
            if variant.startswith("anyio-"):
                chunk = int(variant.split("-")[1].rstrip("k")) * 1024
                loop.create_task(_splice_anyio(a, b, chunk))
            elif variant == "sock":
                loop.create_task(_splice_sock(a, b))
            else:
                loop.create_task(_splice_os(a, b))

    # As `dev relay` runs it: on uvloop where it is installed.
    anyio.run(main, backend_options={"use_uvloop": importlib.util.find_spec("uvloop") is not None})


# --- the measurement (parent) ---------------------------------------------------
def echo_server() -> int:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(1 << 20):
                if data[:1] != b"B":  # bulk bytes are swallowed, pings echoed
                    conn.sendall(data)

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname()[1]


def child_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(port: int, pings: int, bulk_mb: int, pid: int | None) -> dict[str, float]:
    conn = socket.create_connection(("127.0.0.1", port), timeout=30)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(200):  # warm
        conn.sendall(EVENT)
        conn.recv(4096)
    cpu0 = child_cpu(pid) if pid else 0.0
    for _ in range(pings):
        t = time.perf_counter()
        conn.sendall(EVENT)
        got = 0
        while got < len(EVENT):
            got += len(conn.recv(4096))
        times.append(time.perf_counter() - t)
    cpu = (child_cpu(pid) - cpu0) / pings if pid else 0.0
    conn.close()
    bulk = socket.create_connection(("127.0.0.1", port), timeout=60)
    block = b"B" * (1 << 20)
    t = time.perf_counter()
    for _ in range(bulk_mb):
        bulk.sendall(block)
    bulk.shutdown(socket.SHUT_WR)
    bulk.recv(1)  # the splice closes once the echo server has read it all
    secs = time.perf_counter() - t
    bulk.close()
    times.sort()
    return {"p50_us": statistics.median(times) * 1e6, "p90_us": times[int(len(times) * 0.9)] * 1e6, "cpu_us": cpu * 1e6,
            "bulk_mb_s": bulk_mb / secs}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pings", type=int, default=2000)
    parser.add_argument("--bulk-mb", type=int, default=64)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    upstream = echo_server()
    variants = args.variants.split(",")
    results: dict[str, list[dict[str, float]]] = {v: [] for v in ("direct", *variants)}
    for _ in range(args.rounds):
        results["direct"].append(measure(upstream, args.pings, args.bulk_mb, None))
        for variant in variants:
            proc = subprocess.Popen([sys.executable, __file__, "--child", variant, str(upstream)], stdout=subprocess.PIPE)
            try:
                assert proc.stdout is not None
                port = int(proc.stdout.readline())
                results[variant].append(measure(port, args.pings, args.bulk_mb, proc.pid))
            finally:
                proc.kill()
                proc.wait()
    print(f"{'variant':<12} {'rtt p50 µs':>11} {'rtt p90 µs':>11} {'splice CPU µs/msg':>18} {'bulk MB/s':>10}")
    for variant, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{variant:<12} {med['p50_us']:>11.1f} {med['p90_us']:>11.1f} {med['cpu_us']:>18.1f} {med['bulk_mb_s']:>10.0f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
