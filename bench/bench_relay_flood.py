#!/usr/bin/env python3
"""Benchmark the relay under a flood of strangers: do honest streams notice?

    PYTHONPATH=src .venv/bin/python bench/bench_relay_flood.py --out bench/RESULTS.md

One `meshnet-gguf dev relay` process trusting one tracker key. In this process: a
node's relay link in front of a local server that streams numbered SSE events
(`EVENTS` events, one every `EVENT_GAP_S`), and the tracker's side (CONNECT with a
fresh signed token per connection, TLS pinned to the node's certificate, exactly
as the reference tracker dials). Eight honest streams run at once, `ROUNDS`
times: first quiet, then while a second process (this script in `--flood` mode)
throws at the relay, from `--networks` other networks (loopback addresses spread
over 127.0.0.0/8, each its own /24, as many IPv4 networks as the relay counts), for
as long as the honest streams run:

- anonymous connections opened and closed at once;
- half-sent heads, held open;
- CONNECTs with no token and with a forged one (407), and with one byte of TLS held;
- tunnel attaches by fresh keys (provisional tunnels, then `too_many_provisional`
  and `rate_limited`), and work attaches for nodes with no control connection.

Bounded: at most `FLOOD_CONCURRENCY` flood connections at a time, for the run's
duration, loopback only. Reports per run: honest errors, time to first event
(p50/p95/max), the flood's connections by outcome, and the relay's CPU, peak RSS and
peak open descriptors (sampled every `SAMPLE_S`).
Every process listens on 127.0.0.1 and is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.contract.protocol import NodeAnnouncement, relay_audience
from meshnet_gguf.contract.signing import encode_token, public_key_text, tracker_issuer_for
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.relay_link import build_relay_link, local_address_for
from meshnet_gguf.reference.tracker.node_address import AddressPolicy
from meshnet_gguf.reference.tracker.relay_dialer import NodeDialer, new_connect_claims

HONEST_STREAMS = 8
ROUNDS = 5
EVENTS = 50
EVENT_GAP_S = 0.02
FLOOD_CONCURRENCY = 1500
FLOOD_NETWORKS = 1000
SAMPLE_S = 0.1  # the relay's RSS and descriptors, sampled this often while a run lasts
START_TIMEOUT_S = 30.0
HELD_S = 3.0  # how long a flood connection that holds something holds it
FLOOD_NICE = 19
# The control run (--flood-decoy): the same flood aimed at a second relay process on the same machine, so the
# honest streams pay only for the shared cores, not for their relay's work on the strangers.
FLOOD_AT_DECOY = False
# --ipv6: the relay, the node and the honest side in one IPv6 /64, the flood from other /64s of one ULA /48, all made
# local on `lo` for the run (an AnyIP route, with non-local binds allowed so any of its addresses can be a source),
# as 127.0.0.0/8 is for IPv4. Both are put back after the run.
IPV6_BLOCK = "fd6d:6573:6800::/48"
# --pin (a machine of 4 or more CPUs): the relay alone on the first CPU, this process (the node and the honest side) on
# the second, the flood on the rest, so that the figures are the relay's own and not a fight for shared cores.
PIN = False
RELAY_CPU, HONEST_CPU = 0, 1
IPV6_RELAY_HOST = "fd6d:6573:6800::1"
IPV6_NONLOCAL_BIND = "/proc/sys/net/ipv6/ip_nonlocal_bind"
IP_TIMEOUT_S = 10
RELAY_HOST = "127.0.0.1"
# How the tracker's side pools its connections to the node. *cold*: every stream a fresh CONNECT, token and TLS
# handshake (the hardest case); *warm*: the reference tracker's own pool (kept-alive connections, 2 s expiry).
POOLS = {
    "cold": httpx.Limits(max_connections=64, max_keepalive_connections=0),
    "warm": httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0),
}


# --- the node's stand-in: numbered SSE events -----------------------------------------------------------


async def stream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(EVENTS):
        await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
        await asyncio.sleep(EVENT_GAP_S)
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


# --- the flood -----------------------------------------------------------------------------------------------


def flood_sources(networks: int, ipv6: bool = False) -> list[str]:
    """One address in each of `networks` distinct networks the relay counts: a /24 of 127.0.0.0/8 (never the tracker's
    127.0.0.0/24), or with `ipv6` a /64 of IPV6_BLOCK (never the relay's and the tracker's, its first)."""
    if ipv6:
        return [f"fd6d:6573:6800:{1 + i:x}::1" for i in range(networks)]
    return [f"127.{1 + i // 254}.{1 + i % 254}.1" for i in range(networks)]


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@contextlib.contextmanager
def local_ipv6_block() -> Iterator[None]:
    """IPV6_BLOCK local on `lo` and bindable for the run (root and iproute2); the route and the sysctl put back after."""
    nonlocal_before = Path(IPV6_NONLOCAL_BIND).read_text().strip()
    subprocess.run(["ip", "-6", "route", "add", "local", IPV6_BLOCK, "dev", "lo"], check=True, capture_output=True, timeout=IP_TIMEOUT_S)
    try:
        Path(IPV6_NONLOCAL_BIND).write_text("1")
        yield
    finally:
        Path(IPV6_NONLOCAL_BIND).write_text(nonlocal_before)
        subprocess.run(["ip", "-6", "route", "del", "local", IPV6_BLOCK, "dev", "lo"], capture_output=True, timeout=IP_TIMEOUT_S)


async def flood(relay_port: int, duration_s: float, node_id: str, seed_out: Path) -> None:
    """Runs in its own process: strangers at the relay for `duration_s`; writes outcome counts as JSON."""
    outcomes: Counter[str] = Counter()
    limiter = anyio.Semaphore(FLOOD_CONCURRENCY)
    deadline = time.monotonic() + duration_s
    host = RELAY_HOST
    sources = flood_sources(FLOOD_NETWORKS, ipv6=":" in host)
    # Every other network's forged CONNECT carries a bad token, the rest none.
    forged_token_sources = set(sources[::2])

    async def connect(source: str) -> anyio.abc.SocketStream:
        return await anyio.connect_tcp(host, relay_port, local_host=source)

    async def answer_of(stream: anyio.abc.SocketStream) -> str:
        try:
            with anyio.fail_after(HELD_S + 12):
                data = await stream.receive()
            return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1") else "other"
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            return "closed"
        except TimeoutError:
            return "no answer"

    async def open_close(source: str) -> str:
        stream = await connect(source)
        await stream.aclose()
        return "opened+closed"

    async def half_head(source: str) -> str:
        async with await connect(source) as stream:
            await stream.send(b"GET /health HTTP/1.1\r\nHost: relay\r\n")
            with anyio.move_on_after(HELD_S):
                return "half head: " + await answer_of(stream)
            return "half head: held"

    async def connect_forged(source: str) -> str:
        async with await connect(source) as stream:
            auth = "Proxy-Authorization: Bearer eyJhbGciOiJFZERTQSJ9.e30.AAAA\r\n" if source in forged_token_sources else ""
            await stream.send(f"CONNECT {node_id}:443 HTTP/1.1\r\nHost: {node_id}:443\r\n{auth}\r\n".encode())
            return "CONNECT: " + await answer_of(stream)

    async def connect_one_byte(source: str) -> str:
        async with await connect(source) as stream:
            await stream.send(f"CONNECT {node_id}:443 HTTP/1.1\r\nHost: {node_id}:443\r\n\r\n".encode())
            status = await answer_of(stream)
            if status == "200":
                await stream.send(b"\x16")
                await anyio.sleep(HELD_S)
            return "CONNECT+1 byte: " + status

    async def attach(source: str, role: str) -> str:
        identity = NodeIdentity.from_private_key(Ed25519PrivateKey.generate())
        async with await connect(source) as stream:
            await stream.send(b"GET /v1/relay/tunnel HTTP/1.1\r\nHost: relay\r\nConnection: Upgrade\r\nUpgrade: meshnet-relay/1\r\n\r\n")
            buffered = anyio.streams.buffered.BufferedByteReceiveStream(stream)
            try:
                with anyio.fail_after(10):
                    head = await buffered.receive_until(b"\r\n\r\n", 8192)
                    if not head.startswith(b"HTTP/1.1 101"):
                        return f"{role} attach: " + head.split(b" ", 2)[1].decode()
                    challenge = json.loads(await buffered.receive_until(b"\n", 65536))
                    now = int(time.time())
                    claims = {"iss": identity.node_id, "aud": relay_audience(f"http://{url_host(host)}:{relay_port}"), "nonce": challenge["nonce"],
                              "role": role, "iat": now, "exp": now + 30}  # fmt: skip
                    message = {"type": "attach", "role": role, "node_id": identity.node_id, "public_key": identity.public_key_text,
                               "proof": encode_token(claims, identity.private_key)}  # fmt: skip
                    await stream.send(json.dumps(message).encode() + b"\n")
                    answer = json.loads(await buffered.receive_until(b"\n", 65536))
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.IncompleteRead, OSError):
                return f"{role} attach: closed"
            except TimeoutError:
                return f"{role} attach: no answer"
            if answer.get("type") == "attached":
                await anyio.sleep(HELD_S)  # a provisional tunnel, held
                return f"{role} attach: attached"
            return f"{role} attach: {answer.get('code')}"

    kinds = [open_close, open_close, half_head, connect_forged, connect_one_byte,
             lambda s: attach(s, "control"), lambda s: attach(s, "work")]  # fmt: skip

    async def one(i: int) -> None:
        try:
            outcomes[await kinds[i % len(kinds)](sources[i % len(sources)])] += 1
        except OSError as exc:
            outcomes[f"connect failed: {exc.strerror or exc}"] += 1
        finally:
            limiter.release()

    async with anyio.create_task_group() as tg:
        i = 0
        while time.monotonic() < deadline:
            await limiter.acquire()
            tg.start_soon(one, i)
            i += 1
    seed_out.write_text(json.dumps(dict(outcomes)))


# --- honest streams ------------------------------------------------------------------------------------------


async def honest_stream(http: httpx.AsyncClient, target: Any) -> float | None:
    """One stream the tracker's way: its time to the first event, or None when it failed or came short."""
    started = time.perf_counter()
    first = None
    events = 0
    try:
        request = target.request(http, "POST", "/v1/chat/completions", content=b"{}", headers={"content-type": "application/json"})
        response = await http.send(request, stream=True)
        try:
            if response.status_code != 200:
                return None
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    if first is None:
                        first = time.perf_counter() - started
                    events += 1
        finally:
            await response.aclose()
    except httpx.HTTPError:
        return None
    return first if events == EVENTS + 1 else None


async def honest_round(http: httpx.AsyncClient, target: Any) -> tuple[list[float], int]:
    ttfts: list[float] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        first = await honest_stream(http, target)
        if first is None:
            errors += 1
        else:
            ttfts.append(first)

    async with anyio.create_task_group() as tg:
        for _ in range(HONEST_STREAMS):
            tg.start_soon(one)
    return ttfts, errors


def summary(ttfts: list[float]) -> dict[str, float]:
    ordered = sorted(ttfts)
    return {
        "p50_ms": 1000 * statistics.median(ordered),
        "p95_ms": 1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "max_ms": 1000 * ordered[-1],
    }


async def measure(
    limits: httpx.Limits,
    sign: Any,
    announcement: NodeAnnouncement,
    relay: subprocess.Popen[bytes],
    relay_port: int,
    flooded: bool,
    outcomes_path: Path,
) -> dict[str, Any]:
    """`ROUNDS` rounds of honest streams, with or without a flood process at the relay meanwhile."""
    dialer = NodeDialer(limits, sign)
    async with httpx.AsyncClient(transport=dialer, trust_env=False, timeout=30) as http:
        target = await dialer.through_relay(announcement, AddressPolicy(allow_loopback=True, allow_private=":" in RELAY_HOST))
        await honest_round(http, target)  # warm-up; the first ever also admits the tunnel (a tracker's CONNECT)
        proc = psutil.Process(relay.pid)
        flood_proc = None
        if flooded:
            duration = ROUNDS * (EVENTS * EVENT_GAP_S + 1.0)
            flood_proc = subprocess.Popen(
                [sys.executable, __file__, "--flood", str(relay_port), str(duration), announcement.node_id, str(outcomes_path),
                 str(FLOOD_NETWORKS), str(FLOOD_CONCURRENCY), RELAY_HOST],
                start_new_session=True,
            )  # fmt: skip
            pin(flood_proc.pid, set(range(HONEST_CPU + 1, os.cpu_count() or 1)))
            await anyio.sleep(1.0)  # the flood is under way before the honest streams start
        cpu0, wall0 = proc.cpu_times(), time.monotonic()
        ttfts: list[float] = []
        errors = peak_rss = peak_fds = 0
        async with anyio.create_task_group() as sampling:

            async def sample() -> None:
                nonlocal peak_rss, peak_fds
                while True:
                    peak_rss, peak_fds = max(peak_rss, proc.memory_info().rss), max(peak_fds, proc.num_fds())
                    await anyio.sleep(SAMPLE_S)

            sampling.start_soon(sample)
            for _ in range(ROUNDS):
                got, bad = await honest_round(http, target)
                ttfts += got
                errors += bad
            sampling.cancel_scope.cancel()
        cpu1, wall = proc.cpu_times(), time.monotonic() - wall0
        if flood_proc is not None:
            await anyio.to_thread.run_sync(flood_proc.wait, 120)
    return {
        "streams": HONEST_STREAMS * ROUNDS, "errors": errors, **summary(ttfts),
        "relay_cpu_pct": 100 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / wall,
        "relay_peak_rss_mb": peak_rss / 2**20, "relay_peak_fds": peak_fds, "relay_alive": relay.poll() is None,
        "flood": json.loads(outcomes_path.read_text()) if outcomes_path.exists() else {},
    }  # fmt: skip


def pin(pid: int, cpus: set[int]) -> None:
    """With --pin, `pid` runs on `cpus` only."""
    if PIN and cpus:
        os.sched_setaffinity(pid, cpus)


async def run(work: Path) -> dict[str, Any]:
    tracker_key = Ed25519PrivateKey.generate()
    issuer = tracker_issuer_for(tracker_key.public_key())
    relay_port, app_port = free_local_port(), free_local_port()
    relay_url = f"http://{url_host(RELAY_HOST)}:{relay_port}"
    relay_log = work / "relay.log"
    relay = subprocess.Popen(
        [sys.executable, "-m", "meshnet_gguf", "dev", "relay", "--host", RELAY_HOST, "--port", str(relay_port), "--log-level", "WARNING",
         "--trust-tracker-key", public_key_text(tracker_key.public_key()), "--state-dir", str(work / "relay")],
        stdout=relay_log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    pin(relay.pid, {RELAY_CPU})
    pin(os.getpid(), {HONEST_CPU})
    decoy, flood_port = None, relay_port
    if FLOOD_AT_DECOY:
        flood_port = free_local_port()
        decoy = subprocess.Popen(
            [sys.executable, "-m", "meshnet_gguf", "dev", "relay", "--host", RELAY_HOST, "--port", str(flood_port), "--log-level", "WARNING",
             "--trust-tracker-key", public_key_text(tracker_key.public_key()), "--state-dir", str(work / "decoy")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        pin(decoy.pid, {RELAY_CPU})  # the decoy takes the flood's relay work on the same core the honest relay runs on
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(stream_app, host="127.0.0.1", port=app_port, log_level="warning", lifespan="off"))
    results: dict[str, Any] = {}
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve)
            link = build_relay_link(
                relay_url, NodeIdentity.load_or_create(work / "node"), work / "node", local_address_for("127.0.0.1", app_port)
            )
            tg.start_soon(link.run)
            with anyio.fail_after(START_TIMEOUT_S):
                while link.link_health().idle_work < 1:
                    await anyio.sleep(0.05)
            attachment = link.attachment()
            announcement = NodeAnnouncement(
                node_id=link.identity.node_id, public_key=link.identity.public_key_text, advertised_url=relay_url, model_id="m",
                first_layer=0, last_layer=0, total_layers=1, slots=HONEST_STREAMS, node_version="bench", relay=attachment,
            )  # fmt: skip
            sign = lambda url, node_id: encode_token(new_connect_claims(issuer, url, node_id, 30), tracker_key)  # noqa: E731
            for pool, limits in POOLS.items():
                for flooded in (False, True):
                    label = f"{pool}, {'flood' if flooded else 'quiet'}"
                    results[label] = await measure(limits, sign, announcement, relay, flood_port, flooded, work / f"{pool}-{flooded}.json")
            await link.drain()
            await link.close()
            server.should_exit = True
            tg.cancel_scope.cancel()
    finally:
        if decoy is not None:
            decoy.kill()
            decoy.wait(10)
        if relay.poll() is None:
            relay.send_signal(signal.SIGTERM)
            try:
                relay.wait(20)
            except subprocess.TimeoutExpired:  # a loaded machine: the figures are taken, the relay must not linger
                relay.kill()
                relay.wait(10)
    return results


def render(results: dict[str, Any], command: str) -> str:
    floods = [r for label, r in results.items() if label.endswith("flood")]
    total = sum(sum(r["flood"].values()) for r in floods)
    lines = [
        f"## Relay under a flood of strangers{' (control: the flood at a decoy relay)' if FLOOD_AT_DECOY else ''} "
        f"({dt.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores)",
        "",
        f"`{command}`",
        "",
        f"{HONEST_STREAMS} honest streams at once ({EVENTS} SSE events each, one every {EVENT_GAP_S * 1000:.0f} ms), {ROUNDS} rounds per run, "
        "the tracker's way: CONNECT with a tracker-signed token, TLS pinned to the node, through `dev relay --trust-tracker-key`. "
        "*cold*: a fresh CONNECT per stream; *warm*: the reference tracker's kept-alive pool. "
        f"*flood*: meanwhile a second process keeps up to {FLOOD_CONCURRENCY} stranger connections at the relay from "
        f"{FLOOD_NETWORKS:,} other networks ({'one address per IPv6 /64 of ' + IPV6_BLOCK if ':' in RELAY_HOST else 'one 127.x.y.1 address per /24'}; {total:,} connections over the flood runs). It runs at nice {FLOOD_NICE}: its own CPU "
        + (
            "(keys, proofs, sockets) stands for other machines'; pinned: the relay alone on CPU 0, the node and the honest side "
            "on CPU 1, the flood on the others."
            if PIN
            else f"(keys, proofs, sockets) stands for other machines'; the relay and the node run at normal priority on the same "
            f"{os.cpu_count()} cores."
        ),
        "",
        "| run | honest streams | errors | TTFT p50 | TTFT p95 | TTFT max | relay CPU | relay peak RSS | relay peak fds | relay alive |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        lines.append(
            f"| {label} | {r['streams']} | {r['errors']} | {r['p50_ms']:.0f} ms | {r['p95_ms']:.0f} ms | {r['max_ms']:.0f} ms | "
            f"{r['relay_cpu_pct']:.0f} % | {r['relay_peak_rss_mb']:.0f} MB | {r['relay_peak_fds']:,} | {'yes' if r['relay_alive'] else 'NO'} |"
        )
    outcomes: Counter[str] = Counter()
    for r in floods:
        outcomes.update(r["flood"])
    lines += ["", "What the strangers got (both flood runs):", "", "| flood connection | outcome | count |", "|---|---|---|"]
    for key, count in sorted(outcomes.items(), key=lambda kv: (kv[0].split(":")[0], -kv[1])):
        kind, _, outcome = key.partition(": ")
        lines.append(f"| {kind} | {outcome or '-'} | {count:,} |")
    lines.append("")
    for pool in POOLS:
        quiet, flood_ = results[f"{pool}, quiet"], results[f"{pool}, flood"]
        lines.append(f"{pool}: TTFT under flood / quiet: p50 {flood_['p50_ms'] / quiet['p50_ms']:.2f}x, "
                     f"p95 {flood_['p95_ms'] / quiet['p95_ms']:.2f}x; honest errors {flood_['errors']}.  ")  # fmt: skip
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    global FLOOD_AT_DECOY, FLOOD_NETWORKS, ROUNDS, FLOOD_CONCURRENCY, RELAY_HOST, PIN
    if len(sys.argv) > 1 and sys.argv[1] == "--flood":
        port, duration, node_id, out = int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
        FLOOD_NETWORKS, FLOOD_CONCURRENCY, RELAY_HOST = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        # The strangers' own CPU (making keys, proofs, sockets) is not the relay's: a real flood comes from other
        # machines. At the lowest priority it takes what the relay and the node leave on these few cores.
        os.nice(FLOOD_NICE)
        anyio.run(flood, port, duration, node_id, out)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="append the results to this Markdown file")
    parser.add_argument("--flood-decoy", action="store_true", help="control: flood a second relay, not the honest streams' one")
    parser.add_argument("--networks", type=int, default=FLOOD_NETWORKS, help="source networks of the flood (IPv4 /24s in 127/8)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of honest streams per run")
    parser.add_argument("--concurrency", type=int, default=FLOOD_CONCURRENCY, help="flood connections open at once, at most")
    parser.add_argument(
        "--ipv6", action="store_true", help=f"the relay on {IPV6_RELAY_HOST}, the flood from other /64s of {IPV6_BLOCK} (root)"
    )
    parser.add_argument("--pin", action="store_true", help="relay, honest side and flood each on their own CPUs (4 or more CPUs)")
    args = parser.parse_args()
    if args.pin and (os.cpu_count() or 1) < 4:
        parser.error("--pin needs 4 or more CPUs")
    PIN = args.pin
    FLOOD_AT_DECOY, FLOOD_NETWORKS, ROUNDS, FLOOD_CONCURRENCY = args.flood_decoy, args.networks, args.rounds, args.concurrency
    RELAY_HOST = IPV6_RELAY_HOST if args.ipv6 else RELAY_HOST
    with tempfile.TemporaryDirectory(prefix="meshnet-flood-") as tmp, local_ipv6_block() if args.ipv6 else contextlib.nullcontext():
        results = anyio.run(run, Path(tmp), backend_options={"use_uvloop": True})
    command = (
        "PYTHONPATH=src .venv/bin/python bench/bench_relay_flood.py"
        + (" --flood-decoy" if args.flood_decoy else "")
        + (" --ipv6" if args.ipv6 else "")
        + (" --pin" if args.pin else "")
        + (f" --networks {args.networks} --rounds {args.rounds} --concurrency {args.concurrency}")
        + (f" --out {args.out}" if args.out else "")
    )
    text = render(results, command)
    print(text)
    print(json.dumps(results, indent=2), file=sys.stderr)
    if args.out:
        with args.out.open("a") as fh:
            fh.write("\n" + text)


if __name__ == "__main__":
    main()
