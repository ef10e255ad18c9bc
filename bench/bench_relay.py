#!/usr/bin/env python3
"""Benchmark the relay: what reaching a node through it costs against reaching the node directly.

    .venv/bin/python bench/bench_relay.py --out bench/RESULTS.md

Part 1 (real node): `meshnet-gguf serve --relay` on the tiny generated F16 model
with the real llama-server, and `meshnet-gguf dev relay`, both on loopback. The
client reaches the same node two ways, interleaved request by request so drift
hits both alike: **direct** (plain HTTP to the node's port) and **relay** (the
tracker's way: HTTP CONNECT to the relay, then TLS 1.3 pinned to the node's
certificate, inside the tunnel). Measures time to first token (warm: a kept-alive
connection, as the tracker's pool holds; cold: a new connection per request) and
streamed tokens/s. Both paths use the same client library (httpx), so the
difference is the relay and the TLS inside it.

Part 2 (capacity): 64 concurrent streams through one node's tunnel. The node
side is this script in `--numbered-node` mode: the node's relay link in front of
a local HTTP server that streams numbered SSE events, so every stream's order can
be checked exactly. Measures errors, order, and the relay process's CPU and RSS
per stream. Part 3: the relay's RSS per attached tunnel (control connection plus
idle work pool), with 100 tunnels.

Every process listens on 127.0.0.1 and is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.contract.node_tls import node_certificate, pinned_client_context
from meshnet_gguf.mesh.identity import NodeIdentity

HERE = Path(__file__).resolve().parent
CHAT = "/v1/chat/completions"
CONTENT = b'"content":"'
START_TIMEOUT_S = 60.0
MESSAGES = [{"role": "user", "content": "Count from one to ten."}]


# --- processes -------------------------------------------------------------------------------------


def start(args: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, *args], stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, ok: Any = None) -> dict[str, Any]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: process exited\n{log.read_text()[-3000:]}")
        try:
            response = httpx.get(url, timeout=2, trust_env=False)
            body = response.json()
            if response.status_code == 200 and (ok is None or ok(body)):
                return body
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} not ready\n{log.read_text()[-3000:]}")


def relay_client(relay_url: str, state_dir: Path, **kwargs: Any) -> tuple[httpx.AsyncClient, str]:
    identity = NodeIdentity.load_or_create(state_dir)
    context = pinned_client_context(node_certificate(identity.private_key), identity.public_key)
    client = httpx.AsyncClient(proxy=relay_url, verify=context, trust_env=False, timeout=60, **kwargs)
    return client, f"https://{identity.node_id}"


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# --- part 1: TTFT and tokens/s ------------------------------------------------------------------------


LAST_SERVER_RATE: list[float] = []  # llama-server's own decode rate of the latest stream (its `timings`)
SERVER_RATE = re.compile(rb'"predicted_per_second":([0-9.]+)')


async def one_stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[float, float, int]:
    """(ttft_s, decode_s from first to last content delta, content deltas) for one streamed chat request."""
    body = {
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }  # the usage chunk carries llama-server's timings
    sent = time.perf_counter()
    first = last = 0.0
    tokens = 0
    tail = b""
    async with client.stream("POST", url + CHAT, json=body) as response:
        response.raise_for_status()
        async for chunk in response.aiter_raw():
            tail = (tail + chunk)[-4096:]
            n = chunk.count(CONTENT)
            if n:
                last = time.perf_counter()
                if not tokens:
                    first = last
                tokens += n
    rate = SERVER_RATE.search(tail)
    LAST_SERVER_RATE[:] = [float(rate.group(1))] if rate else []
    return first - sent, last - first, tokens


async def part_ttft(direct_url: str, relay_url: str, state_dir: Path, pairs: int, cold: bool) -> dict[str, Any]:
    ttft: dict[str, list[float]] = {"direct": [], "relay": []}
    # cold: no connection is kept, so each request pays TCP (+ CONNECT + TLS through the relay) afresh.
    limits = httpx.Limits(max_keepalive_connections=0) if cold else httpx.Limits()
    direct = httpx.AsyncClient(trust_env=False, timeout=60, limits=limits)
    relayed, node_url = relay_client(relay_url, state_dir, limits=limits)
    try:
        for i in range(pairs + 5):
            for path in ("direct", "relay") if i % 2 == 0 else ("relay", "direct"):
                client, base = (direct, direct_url) if path == "direct" else (relayed, node_url)
                t, _, _ = await one_stream(client, base, 4)
                if i >= 5:  # warm-up pairs not counted
                    ttft[path].append(t)
    finally:
        await direct.aclose()
        await relayed.aclose()
    added = [r - d for d, r in zip(ttft["direct"], ttft["relay"])]
    return {
        "pairs": pairs,
        "cold": cold,
        **{f"{p}_p50_ms": pct(v, 0.5) * 1e3 for p, v in ttft.items()},
        **{f"{p}_p99_ms": pct(v, 0.99) * 1e3 for p, v in ttft.items()},
        "added_p50_ms": (pct(ttft["relay"], 0.5) - pct(ttft["direct"], 0.5)) * 1e3,
        "added_p99_ms": (pct(ttft["relay"], 0.99) - pct(ttft["direct"], 0.99)) * 1e3,
        "paired_added_median_ms": statistics.median(added) * 1e3,
    }


async def part_decode(direct_url: str, relay_url: str, state_dir: Path, rounds: int, max_tokens: int) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"direct": [], "relay": []}
    server_rates: dict[str, list[float]] = {"direct": [], "relay": []}
    ratios: list[float] = []
    direct = httpx.AsyncClient(trust_env=False, timeout=120)
    relayed, node_url = relay_client(relay_url, state_dir)
    try:
        for i in range(rounds + 1):
            for path in ("direct", "relay") if i % 2 == 0 else ("relay", "direct"):
                client, base = (direct, direct_url) if path == "direct" else (relayed, node_url)
                _, span, tokens = await one_stream(client, base, max_tokens)
                if i >= 1 and span > 0:
                    rates[path].append((tokens - 1) / span)
                    server_rates[path].extend(LAST_SERVER_RATE)
            if i >= 1:  # each round's relay rate against the direct rate measured next to it
                ratios.append(rates["relay"][-1] / rates["direct"][-1])
    finally:
        await direct.aclose()
        await relayed.aclose()
    d, r = statistics.median(rates["direct"]), statistics.median(rates["relay"])
    return {"rounds": rounds, "max_tokens": max_tokens, "direct_tok_s": d, "relay_tok_s": r, "ratio": r / d,
            "server_direct_tok_s": statistics.median(server_rates["direct"]) if server_rates["direct"] else None,
            "server_relay_tok_s": statistics.median(server_rates["relay"]) if server_rates["relay"] else None,
            "paired_ratio_median": statistics.median(ratios), "paired_ratio_q1": pct(ratios, 0.25), "paired_ratio_q3": pct(ratios, 0.75)}  # fmt: skip


def run_part1(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from meshnet_gguf.models.tiny_model import write_tiny_model

    model = write_tiny_model(work / "tiny.gguf")
    relay_port, node_port = free_local_port(), free_local_port()
    relay_url = f"http://127.0.0.1:{relay_port}"
    relay = start(
        ["-m", "meshnet_gguf", "dev", "relay", "--port", str(relay_port), "--open", "--log-level", "WARNING"], work / "relay1.log"
    )
    state = work / "node-state"
    node = start([
        "-m", "meshnet_gguf", "serve", "--gguf", str(model), "--port", str(node_port), "--state-dir", str(state),
        "--download-dir", str(work / "models"), "--relay", relay_url, "--parallel", "4", "--ctx-size", "8192",
    ], work / "node1.log")  # fmt: skip
    try:
        wait_http(relay_url + "/health", relay, work / "relay1.log")
        direct_url = f"http://127.0.0.1:{node_port}"
        wait_http(direct_url + "/health", node, work / "node1.log", ok=lambda b: b.get("relay", {}).get("state") == "attached")
        return {
            "ttft_warm": asyncio.run(part_ttft(direct_url, relay_url, state, args.ttft_pairs, cold=False)),
            "ttft_cold": asyncio.run(part_ttft(direct_url, relay_url, state, args.ttft_pairs // 2, cold=True)),
            "decode": asyncio.run(part_decode(direct_url, relay_url, state, args.decode_rounds, args.decode_tokens)),
        }
    finally:
        stop(node)
        stop(relay)


# --- part 2: 64 streams through one tunnel; part 3: memory per tunnel ---------------------------------


async def numbered_node(relay_url: str, state_dir: Path, ready_file: Path, tunnels: int) -> None:
    """`--numbered-node`: relay link(s) in front of a local server streaming numbered SSE events."""
    import anyio
    import uvicorn

    from meshnet_gguf.contract.node_tls import server_context  # noqa: F401 - same context the node uses
    from meshnet_gguf.mesh.relay_link import build_relay_link, local_address_for

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body or b"{}")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(int(request.get("n", 10))):
            await send({"type": "http.response.body", "body": b'data: {"content":"%d"}\n\n' % i, "more_body": True})
            await asyncio.sleep(float(request.get("delay", 0)))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    port = free_local_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    links = [build_relay_link(relay_url, NodeIdentity.load_or_create(state_dir), state_dir, local_address_for("127.0.0.1", port))]
    for _ in range(tunnels - 1):  # extra nodes (own keys) for the per-tunnel memory figure
        key_dir = Path(tempfile.mkdtemp(dir=state_dir.parent))
        links.append(build_relay_link(relay_url, NodeIdentity.load_or_create(key_dir), key_dir, local_address_for("127.0.0.1", port)))
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        for link in links:
            tg.start_soon(link.run)
        while not all(l.link_health().idle_work >= 1 and l.state == "attached" for l in links) or not server.started:
            await anyio.sleep(0.05)
        ready_file.write_text("ready")
        await anyio.sleep_forever()


class Sampler:
    """Peak RSS of a process, sampled every 50 ms in a thread."""

    def __init__(self, pid: int) -> None:
        import threading

        self.proc = psutil.Process(pid)
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def many_streams(relay_url: str, state_dir: Path, streams: int, events: int, delay: float) -> dict[str, Any]:
    client, node_url = relay_client(relay_url, state_dir, limits=httpx.Limits(max_connections=streams * 2))
    errors, out_of_order = 0, 0
    first_byte: list[float] = []

    async def one() -> None:
        nonlocal errors, out_of_order
        got: list[int] = []
        sent = time.perf_counter()
        try:
            async with client.stream("POST", node_url + CHAT, json={"n": events, "delay": delay}) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith('data: {"content"'):
                        if not got:
                            first_byte.append(time.perf_counter() - sent)
                        got.append(int(json.loads(line[6:])["content"]))
        except httpx.HTTPError:
            errors += 1
            return
        if got != list(range(events)):
            out_of_order += 1

    try:
        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(streams)))
        elapsed = time.perf_counter() - started
    finally:
        await client.aclose()
    return {"errors": errors, "out_of_order": out_of_order, "elapsed_s": elapsed, "first_byte_p50_ms": pct(first_byte, 0.5) * 1e3,
            "first_byte_max_ms": max(first_byte) * 1e3 if first_byte else None}  # fmt: skip


def run_part2(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    relay_port = free_local_port()
    relay_url = f"http://127.0.0.1:{relay_port}"
    relay = start(
        ["-m", "meshnet_gguf", "dev", "relay", "--port", str(relay_port), "--open", "--log-level", "WARNING"], work / "relay2.log"
    )
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        wait_http(relay_url + "/health", relay, work / "relay2.log")
        proc = psutil.Process(relay.pid)
        rss_empty = proc.memory_info().rss
        for tunnels, key in ((1, "one"), (args.tunnels, "many")):
            ready = work / f"ready-{key}"
            ready.unlink(missing_ok=True)
            node = start([__file__, "--numbered-node", relay_url, str(work / f"numbered-{key}" / "state"), str(ready), str(tunnels)],
                         work / f"numbered-{key}.log")  # fmt: skip
            nodes.append(node)
            deadline = time.monotonic() + START_TIMEOUT_S
            while not ready.exists():
                if node.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit((work / f"numbered-{key}.log").read_text()[-3000:])
                time.sleep(0.1)
            time.sleep(0.5)
            stats = httpx.get(relay_url + "/health", trust_env=False).json()
            if key == "one":
                rss_idle = proc.memory_info().rss
                cpu_before = sum(proc.cpu_times()[:2])
                with Sampler(relay.pid) as sampler:
                    run = asyncio.run(many_streams(relay_url, work / "numbered-one" / "state", args.streams, args.events, args.event_delay))
                cpu = sum(proc.cpu_times()[:2]) - cpu_before
                results["streams"] = {
                    **run, "streams": args.streams, "events_per_stream": args.events, "event_delay_s": args.event_delay,
                    "relay_cpu_s": cpu, "relay_cpu_per_stream_ms": cpu / args.streams * 1e3,
                    "relay_cpu_per_event_us": cpu / (args.streams * args.events) * 1e6,
                    "relay_cpu_share": cpu / run["elapsed_s"],
                    "relay_rss_idle_mb": rss_idle / 2**20, "relay_rss_peak_mb": sampler.peak / 2**20,
                    "relay_rss_per_stream_kb": (sampler.peak - rss_idle) / args.streams / 1024,
                }  # fmt: skip
                stop(node)
                time.sleep(0.5)
                rss_empty = proc.memory_info().rss
            else:
                rss_many = proc.memory_info().rss
                results["tunnels"] = {
                    "tunnels": tunnels, "relay_stats": stats, "relay_rss_empty_mb": rss_empty / 2**20,
                    "relay_rss_mb": rss_many / 2**20, "relay_rss_per_tunnel_kb": (rss_many - rss_empty) / tunnels / 1024,
                }  # fmt: skip
    finally:
        for node in nodes:
            stop(node)
        stop(relay)
    return results


# --- report ------------------------------------------------------------------------------------------------


def report(results: dict[str, Any], command: str) -> str:
    lines = [
        f"## Relay: through the relay vs direct ({dt.date.today().isoformat()})",
        "",
        f"`{command}` on {platform.node() and 'this machine'}: {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()}), Python {platform.python_version()}, everything on loopback; "
        f"load average {results['load_before']:.1f} before and {results['load_after']:.1f} after the run (a shared machine). "
        "Raw figures in `bench/.cache/relay-results.json`.",
        "",
    ]
    p1 = results.get("part1")
    if p1:
        lines += [
            "### Time to first token and tokens/s (real node, tiny F16 model, real llama-server)",
            "",
            "*direct*: plain HTTP to the node's port. *relay*: CONNECT through `dev relay`, TLS 1.3 pinned to the node's "
            "certificate inside the tunnel, the node's relay link splicing to its own listener. Interleaved request by "
            "request. *warm*: kept-alive connections (what the tracker's pool holds); *cold*: a new connection per request "
            "(TCP + CONNECT + TLS handshake through the relay).",
            "",
            "| connections | pairs | direct p50 | direct p99 | relay p50 | relay p99 | added p50 | added p99 | paired median added |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for key in ("ttft_warm", "ttft_cold"):
            t = p1[key]
            lines.append(
                f"| {'cold' if t['cold'] else 'warm'} | {t['pairs']} | {t['direct_p50_ms']:.2f} ms | {t['direct_p99_ms']:.2f} ms | "
                f"{t['relay_p50_ms']:.2f} ms | {t['relay_p99_ms']:.2f} ms | **{t['added_p50_ms']:.2f} ms** | {t['added_p99_ms']:.2f} ms | "
                f"{t['paired_added_median_ms']:.2f} ms |"
            )
        d = p1["decode"]
        lines += [
            "",
            f"Streamed tokens/s, {d['max_tokens']} tokens per stream, median of {d['rounds']} per path: direct "
            f"{d['direct_tok_s']:.0f} tok/s, relay {d['relay_tok_s']:.0f} tok/s: {d['ratio'] * 100:.1f} % of direct; "
            f"round by round (relay over the direct run beside it) the median is **{d['paired_ratio_median'] * 100:.1f} %** "
            f"(quartiles {d['paired_ratio_q1'] * 100:.1f}–{d['paired_ratio_q3'] * 100:.1f} %). "
            f"llama-server's own decode rate (its `timings`) meanwhile: {d['server_direct_tok_s'] or 0:.0f} tok/s on direct "
            f"requests, {d['server_relay_tok_s'] or 0:.0f} tok/s on relayed ones.",
            "",
        ]
    p2 = results.get("part2")
    if p2:
        s, t = p2["streams"], p2["tunnels"]
        lines += [
            f"### {s['streams']} concurrent streams through one tunnel",
            "",
            f"A node-side relay link in front of a local server streaming numbered SSE events ({s['events_per_stream']} per stream, "
            f"one every {s['event_delay_s'] * 1e3:.0f} ms), so each stream's order is checked exactly. The relay is its own process "
            "(`dev relay`, uvloop); CPU and RSS are that process's alone.",
            "",
            "| streams | errors | out of order | all done in | first event p50 / max | relay CPU | CPU per stream | CPU per event | relay RSS idle → peak | RSS per stream |",
            "|---|---|---|---|---|---|---|---|---|---|",
            f"| {s['streams']} | **{s['errors']}** | **{s['out_of_order']}** | {s['elapsed_s']:.2f} s | "
            f"{s['first_byte_p50_ms']:.1f} / {s['first_byte_max_ms']:.1f} ms | {s['relay_cpu_share'] * 100:.0f} % of a core | "
            f"{s['relay_cpu_per_stream_ms']:.1f} ms | {s['relay_cpu_per_event_us']:.1f} µs | "
            f"{s['relay_rss_idle_mb']:.1f} → {s['relay_rss_peak_mb']:.1f} MB | {s['relay_rss_per_stream_kb']:.0f} kB |",
            "",
            f"Per tunnel: {t['tunnels']} nodes attached (each a control connection and its idle work pool; relay stats "
            f"{t['relay_stats']}): relay RSS {t['relay_rss_empty_mb']:.1f} → {t['relay_rss_mb']:.1f} MB, "
            f"**{t['relay_rss_per_tunnel_kb']:.0f} kB per tunnel**.",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--numbered-node":
        relay_url, state_dir, ready, tunnels = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
        state_dir.mkdir(parents=True, exist_ok=True)
        try:
            asyncio.run(numbered_node(relay_url, state_dir, ready, tunnels))
        except KeyboardInterrupt:
            pass
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="append the results section to this Markdown file")
    parser.add_argument("--ttft-pairs", type=int, default=200)
    parser.add_argument("--decode-rounds", type=int, default=20)
    parser.add_argument("--decode-tokens", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--event-delay", type=float, default=0.01)
    parser.add_argument("--tunnels", type=int, default=100)
    parser.add_argument("--skip-real", action="store_true", help="skip part 1 (real node)")
    args = parser.parse_args()
    cache = HERE / ".cache" / "relay-run"
    cache.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"load_before": os.getloadavg()[0]}
    if not args.skip_real:
        results["part1"] = run_part1(args, cache)
        print(json.dumps(results["part1"], indent=1))
    results["part2"] = run_part2(args, cache)
    print(json.dumps(results["part2"], indent=1))
    results["load_after"] = os.getloadavg()[0]
    (HERE / ".cache" / "relay-results.json").write_text(json.dumps(results, indent=1))
    text = report(results, "python bench/bench_relay.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.out:
        with args.out.open("a") as fh:
            fh.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
