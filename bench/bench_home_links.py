#!/usr/bin/env python3
"""The relay on a home link, measured: a NAT that forgets the tunnel, and what latency adds to the first token.

    nice .venv/bin/python bench/bench_home_links.py
    nice .venv/bin/python bench/bench_home_links.py --src /tmp/before/src   # another tree's processes

Needs root, `ip`, `iptables`, `conntrack` and /dev/net/tun (tests/support/home_network.py builds the router
and the wires). One node behind the router's NAT (the fake llama-server, a token every 50 ms), tracker and relay
beyond it (the relay pinging at its default 10 s), the client on a link of its own. It prints:

1. **idle drops**: the router forgets every mapping (`conntrack -F`) while the node is idle; the time until the
   node's tunnel is attached again, and until a request through tracker and relay succeeds (one every 0.5 s
   from the drop, as a user retrying would, each given 10 s);
2. **mid-stream drops**: the same at a stream's fifth event; the time until the client's stream ends, and how
   (an error event, or nothing until the client gave up after 60 s);
3. **round trips**: first-token time with the node's link at 0, 50 and 100 ms each way, on a tunnel the tracker
   kept (back to back) and on a new one (after its 2 s idle TTL); the slope over the round-trip time is the
   number of the node link's round trips the relay path puts before the first token.

`--src` runs tracker, relay and node from another source tree (PYTHONPATH), for a before/after:
`git archive COMMIT src | tar -x -C /tmp/before`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from support.home_mesh import HomeMesh, HomeNode, MeshOptions, start_home_mesh
from support.home_network import HomeNetwork

from meshnet_gguf.models.tiny_model import write_tiny_model

FAKE_LLAMA = HERE.parent / "tests" / "support" / "fake_llama_server.py"
NODE_ENV = {"FAKE_LLAMA_TOKEN_DELAY_S": "0.05", "FAKE_LLAMA_TOKENS": "100000"}
# Between a request and the drop: the node idle, as the runs had it.
IDLE_BEFORE_DROP_S = 3.0
RETRY_EVERY_S = 0.5
RETRY_REQUEST_TIMEOUT_S = 10.0
# An idle drop is given up on after this (a node that never comes back).
GIVE_UP_S = 90.0
MID_STREAM_CLIENT_TIMEOUT_S = 60.0
DELAYS_MS = (0, 50, 100)
TTFT_SAMPLES = 7
# The tracker lets a relayed tunnel go after RELAYED_IDLE_TTL_S (2 s) idle: a pause past it makes the next
# request open a new one.
FRESH_TUNNEL_PAUSE_S = 2.6


def idle_drops(mesh: HomeMesh, node: HomeNode, count: int) -> list[tuple[float | None, float | None, int]]:
    """(reattached after, first success after, failed requests) per drop."""
    out = []
    for _ in range(count):
        assert mesh.stream(4).ok
        time.sleep(IDLE_BEFORE_DROP_S)
        before = (node.relay_link() or {}).get("connects", 0)
        reattached: list[float] = []
        stop = threading.Event()

        def watch(before: int = before, stop: threading.Event = stop, reattached: list[float] = reattached) -> None:
            while not stop.is_set():
                link = node.relay_link() or {}
                if link.get("connects", 0) > before and link.get("state") == "attached":
                    reattached.append(time.monotonic())
                    return
                time.sleep(0.1)

        mesh.net.flush_nat()
        dropped = time.monotonic()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        success, failures = None, 0
        while time.monotonic() - dropped < GIVE_UP_S:
            t0 = time.monotonic()
            if mesh.stream(4, timeout=RETRY_REQUEST_TIMEOUT_S).ok:
                success = time.monotonic() - dropped
                break
            failures += 1
            time.sleep(max(0.0, RETRY_EVERY_S - (time.monotonic() - t0)))
        watcher.join(GIVE_UP_S)
        stop.set()
        out.append((reattached[0] - dropped if reattached else None, success, failures))
        print(f"  idle drop: tunnel back after {_s(out[-1][0])}, a request through after {_s(success)} ({failures} failed)", flush=True)
    return out


def mid_stream_drops(mesh: HomeMesh, count: int) -> list[tuple[float, str]]:
    out = []
    for _ in range(count):
        _until_served(mesh)
        time.sleep(IDLE_BEFORE_DROP_S)
        flushed: list[float] = []

        def drop(event: int, flushed: list[float] = flushed) -> None:
            if event == 5 and not flushed:
                mesh.net.flush_nat()
                flushed.append(time.monotonic())

        result = mesh.stream(400, on_event=drop, timeout=MID_STREAM_CLIENT_TIMEOUT_S)
        ended = time.monotonic() - flushed[0] if flushed else float("nan")
        how = (
            f"error event {result.error_event.get('code')}" if result.error_event
            else f"no event: {result.transport_error}" if result.transport_error
            else "completed" if result.ok else f"answered {result.status}"
        )  # fmt: skip
        out.append((ended, how))
        print(f"  mid-stream drop: the client's stream ended {ended:.1f} s later, {how}", flush=True)
    return out


def _until_served(mesh: HomeMesh) -> None:
    """Until a request goes through (after a drop the tracker may still list a node whose tunnel is dead)."""
    deadline = time.monotonic() + GIVE_UP_S
    while not mesh.stream(4, timeout=RETRY_REQUEST_TIMEOUT_S).ok:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no request went through in {GIVE_UP_S:.0f} s")
        time.sleep(RETRY_EVERY_S)


def round_trips(mesh: HomeMesh) -> dict[str, list[tuple[float, float]]]:
    """{kept|fresh: [(rtt_s, median first-token s)]}"""
    out: dict[str, list[tuple[float, float]]] = {"kept": [], "fresh": []}
    for delay_ms in DELAYS_MS:
        mesh.net.node_link.set(delay_ms=delay_ms)
        for kind in ("kept", "fresh"):
            mesh.stream(2)
            times = []
            for _ in range(TTFT_SAMPLES):
                if kind == "fresh":
                    time.sleep(FRESH_TUNNEL_PAUSE_S)
                result = mesh.stream(2)
                assert result.ok and result.first_token_s is not None, result
                times.append(result.first_token_s)
            out[kind].append((2 * delay_ms / 1000, statistics.median(times)))
            print(f"  node link {delay_ms} ms each way, {kind} tunnel: first token {statistics.median(times) * 1000:.0f} ms", flush=True)
    mesh.net.node_link.set(delay_ms=0)
    return out


def _slope(points: list[tuple[float, float]]) -> float:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drops", type=int, default=5)
    parser.add_argument("--mid-stream", type=int, default=3)
    parser.add_argument("--src", type=Path, default=None, help="run tracker, relay and node from this source tree")
    parser.add_argument("--skip-round-trips", action="store_true")
    args = parser.parse_args()
    why = HomeNetwork.missing()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    if args.src is not None:
        os.environ["PYTHONPATH"] = f"{args.src.resolve()}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    workdir = Path(tempfile.mkdtemp(prefix="home-links-"))
    gguf = write_tiny_model(workdir / "tiny.gguf")
    fake = workdir / "llama-server"
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_LLAMA}" "$@"\n')
    fake.chmod(0o755)
    mesh_gen = start_home_mesh(workdir, gguf.stem, MeshOptions(nat_idle_timeout_s=30, relay_ping_interval_s=10.0))
    mesh = next(mesh_gen)
    try:
        node = mesh.add_node(gguf, fake, NODE_ENV)
        node.wait_ready()
        mesh.wait_routable(1)
        print(f"source: {args.src or 'this tree'}; logs in {workdir}")
        print("1. idle drops")
        drops = idle_drops(mesh, node, args.drops)
        print("2. mid-stream drops")
        cuts = mid_stream_drops(mesh, args.mid_stream)
        trips: dict[str, list[tuple[float, float]]] = {}
        if not args.skip_round_trips:
            print("3. round trips")
            trips = round_trips(mesh)
    finally:
        for _ in mesh_gen:
            pass
    back = [d[0] for d in drops if d[0] is not None]
    served = [d[1] for d in drops if d[1] is not None]
    print("\n| measure | value |\n|---|---|")
    print(f"| tunnel attached again after an idle drop | median {_s(statistics.median(back) if back else None)}, max {_s(max(back) if back else None)} ({len(back)}/{len(drops)}) |")  # fmt: skip
    print(f"| a request through again after an idle drop | median {_s(statistics.median(served) if served else None)}, max {_s(max(served) if served else None)}, failed requests {sum(d[2] for d in drops)} |")  # fmt: skip
    print(f"| a stream cut by a drop ends after | {', '.join(f'{c[0]:.1f} s ({c[1]})' for c in cuts)} |")
    for kind, points in trips.items():
        print(f"| first token, {kind} tunnel: added per round trip of the node's link | {_slope(points):.2f} round trips "
              f"({', '.join(f'{y * 1000:.0f} ms at {x * 1000:.0f} ms RTT' for x, y in points)}) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
