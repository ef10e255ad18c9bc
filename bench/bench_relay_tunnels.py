#!/usr/bin/env python3
"""Benchmark one relay holding many attached tunnels: its RSS and descriptors per tunnel, and its CPU per stream.

    PYTHONPATH=src .venv/bin/python bench/bench_relay_tunnels.py --tunnels 10000 --out bench/RESULTS.md

One `meshnet-gguf dev relay` process trusting one tracker key (`--ipv4-network-prefix 24`), its descriptor
limit raised to the hard limit. Then, in stages (0, `--first-stage`, `--tunnels`):

- **bulk nodes**: child processes of this script (`--client` mode, `--clients` of them for the last stage), each
  holding its share of node identities (fresh Ed25519 keys). Each node attaches as a node's relay link does:
  upgrade, challenge, control attach signed by its key, from its own loopback address, `PER_NETWORK` nodes per
  127.a.b.0/24 (so no network's attach rate, provisional share or pending bound is what binds), then pings every
  10 s as the link does. It is admitted the way a tracker admits it: the node dials one work connection (attach
  proof, `ready`), and a CONNECT with a fresh tracker-signed token (from 127.0.0.1, the tracker's address) is
  answered 200 and spliced to it; both then close. Afterwards the node keeps its control connection and **no idle
  work pool**: a pool is one relay descriptor per idle connection, and even one per node would put 10,000 nodes at
  20,000 descriptors, this machine's hard limit per process (the relay's default asks 16 per node, the node's link
  keeps 4). The pool's own cost per connection is measured by bench_relay.py part 3. At most `IN_FLIGHT` nodes per
  client are between attach and admission at once, so the 256 provisional places never fill.
- **stream nodes**: `STREAM_NODES` real node relay links (their default idle work pool) in this process, in front
  of a local server streaming numbered SSE events, reached the tracker's way (NodeDialer: CONNECT with a signed
  token, TLS pinned to the node), a fresh CONNECT per stream.

Measured at each stage once the tunnels are attached, admitted and settled: the relay's RSS and open descriptors.
With the stream nodes alone and again with every bulk tunnel attached: the relay's CPU over a quiet span (the
bulk tunnels' pings), then over `ROUNDS` rounds of `STREAMS` concurrent streams; CPU per stream is the CPU during
the streams less the quiet rate over the same span, divided by the streams.
Every process listens on or dials 127.0.0.0/8 and is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# The stream nodes serve the flood bench's numbered events, so the two benches' streams are the same.
from bench_relay_flood import EVENT_GAP_S, EVENTS, honest_stream, stream_app  # noqa: E402

PER_NETWORK = 8  # bulk nodes per 127.a.b.0/24: within a network's attach burst (20) and provisional share (16)
IN_FLIGHT = 24  # per client: nodes attached but not yet admitted (all clients together stay under 256)
CONNECTS_AT_ONCE = 8  # per client: CONNECTs in flight from the tracker's one network (its pending bound is 64)
PING_INTERVAL_S = 10.0  # relay_wire.RELAY_PING_INTERVAL_S, as the node's link pings
ATTEMPTS = 20
STREAM_NODES = 4
STREAMS = 8
ROUNDS = 10
QUIET_S = 10.0
SETTLE_S = 5.0
START_TIMEOUT_S = 60.0


def raise_fd_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def source_for(index: int) -> str:
    """Bulk node `index`'s loopback address: `PER_NETWORK` to a /24, never the tracker's 127.0.0.0/24."""
    network = index // PER_NETWORK
    return f"127.{1 + network // 250}.{network % 250}.{1 + index % PER_NETWORK}"


# --- a client process: bulk nodes -------------------------------------------------------------------------------


class Refused(Exception):
    pass


async def client_main(port: int, key_hex: str, first: int, count: int, status_file: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from meshnet_gguf.contract.protocol import relay_audience
    from meshnet_gguf.contract.signing import encode_token, node_id_for, public_key_text, tracker_issuer_for
    from meshnet_gguf.reference.tracker.relay_dialer import new_connect_claims

    tracker_key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(key_hex))
    issuer = tracker_issuer_for(tracker_key.public_key())
    relay_url = f"http://127.0.0.1:{port}"
    audience = relay_audience(relay_url)
    in_flight, connects = asyncio.Semaphore(IN_FLIGHT), asyncio.Semaphore(CONNECTS_AT_ONCE)
    counts: Counter[str] = Counter()
    done = 0

    async def upgraded(source: str, key: Any, node_id: str, role: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        try:
            writer.write(b"GET /v1/relay/tunnel HTTP/1.1\r\nHost: relay\r\nConnection: Upgrade\r\nUpgrade: meshnet-relay/1\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 101"):
                raise Refused(head.split(b"\r\n")[0].decode())
            challenge = json.loads(await reader.readline())
            now = int(time.time())
            claims = {"iss": node_id, "aud": audience, "nonce": challenge["nonce"], "role": role, "iat": now, "exp": now + 30}
            message = {"type": "attach", "role": role, "node_id": node_id, "public_key": public_key_text(key.public_key()),
                       "proof": encode_token(claims, key)}  # fmt: skip
            writer.write(json.dumps(message).encode() + b"\n")
            answer = json.loads(await reader.readline())
            if answer.get("type") != "attached":
                raise Refused(answer.get("code", str(answer)))
        except BaseException:
            writer.close()
            raise
        return reader, writer, answer

    async def admit(node_id: str) -> None:
        """The tracker's CONNECT, token-bearing, reaching the node's one work connection: 200, then both close."""
        async with connects:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                token = encode_token(new_connect_claims(issuer, relay_url, node_id, 30), tracker_key)
                writer.write(
                    f"CONNECT {node_id}:443 HTTP/1.1\r\nHost: {node_id}:443\r\nProxy-Authorization: Bearer {token}\r\n\r\n".encode()
                )
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise Refused("connect " + head.split(b"\r\n")[0].decode())
            finally:
                writer.close()

    async def node(index: int) -> None:
        nonlocal done
        key = Ed25519PrivateKey.generate()
        node_id = node_id_for(key.public_key())
        source = source_for(index)
        await asyncio.sleep(random.random() * 0.5)
        for attempt in range(ATTEMPTS):
            async with in_flight:
                try:
                    reader, writer, _ = await upgraded(source, key, node_id, "control")
                    try:
                        _work_reader, work_writer, _ = await upgraded(source, key, node_id, "work")
                        work_writer.write(b'{"type":"ready"}\n')
                        try:
                            await admit(node_id)
                        finally:
                            work_writer.close()
                    except BaseException:
                        writer.close()
                        raise
                except (Refused, OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    counts[f"retry: {exc}"[:80]] += 1
                    await asyncio.sleep(1.0 + random.random())
                    continue
            break
        else:
            counts["gave up"] += 1
            return
        done += 1
        await asyncio.sleep(random.random() * PING_INTERVAL_S)
        try:
            while True:  # the node's link: a ping every interval, the relay's pong back
                writer.write(b'{"type":"ping"}\n')
                await asyncio.wait_for(reader.readline(), PING_INTERVAL_S)
                await asyncio.sleep(PING_INTERVAL_S)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            counts["control lost"] += 1
            done -= 1

    async def report() -> None:
        started = time.monotonic()
        while True:
            partial = status_file.with_suffix(".part")  # renamed into place: the parent never reads half a file
            partial.write_text(json.dumps({"attached": done, "of": count, "s": time.monotonic() - started, "counts": counts}))
            partial.replace(status_file)
            await asyncio.sleep(0.5)

    tasks = [asyncio.ensure_future(node(first + i)) for i in range(count)]
    await asyncio.gather(report(), *tasks)


# --- the stream nodes and the tracker's side -------------------------------------------------------------------


async def stream_rounds(http: Any, targets: list[Any], rounds: int) -> tuple[int, int, list[float]]:
    """(streams, errors, times to first event) over `rounds` rounds of STREAMS concurrent streams."""
    import anyio

    errors, ttfts = 0, []

    async def one(target: Any) -> None:
        nonlocal errors
        first = await honest_stream(http, target)
        if first is None:
            errors += 1
        else:
            ttfts.append(first)

    for _ in range(rounds):
        async with anyio.create_task_group() as tg:
            for i in range(STREAMS):
                tg.start_soon(one, targets[i % len(targets)])
    return rounds * STREAMS, errors, ttfts


class RelayProcess:
    def __init__(self, work: Path, tracker_public: str) -> None:
        from meshnet_gguf.common.ports import free_local_port

        self.port = free_local_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / "relay.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshnet_gguf", "dev", "relay", "--port", str(self.port), "--log-level", "WARNING",
             "--trust-tracker-key", tracker_public, "--state-dir", str(work / "relay"), "--ipv4-network-prefix", "24"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=raise_fd_limit,
        )  # fmt: skip
        import psutil

        self.ps = psutil.Process(self.proc.pid)

    def health(self) -> dict[str, Any]:
        import httpx

        return httpx.get(self.url + "/health", timeout=10, trust_env=False).json()

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def snapshot(self) -> dict[str, Any]:
        return {"rss_kib": self.ps.memory_info().rss / 1024, "fds": self.ps.num_fds(), **self.health()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_clients(relay: RelayProcess, key_hex: str, first: int, count: int, clients: int, work: Path, tag: str) -> list[tuple[Any, Path]]:
    started = []
    share = -(-count // clients)
    for c in range(clients):
        n = min(share, count - c * share)
        if n <= 0:
            break
        status = work / f"client-{tag}-{c}.json"
        status.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [sys.executable, __file__, "--client", str(relay.port), key_hex, str(first + c * share), str(n), str(status)],
            stdout=(work / f"client-{tag}-{c}.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=raise_fd_limit,
        )  # fmt: skip
        started.append((proc, status))
    return started


async def wait_tunnels(relay: RelayProcess, clients: list[tuple[Any, Path]], want: int, timeout_s: float) -> dict[str, Any]:
    """Until the relay holds `want` tunnels, none provisional; returns the clients' counters."""
    import anyio

    started = time.monotonic()
    while True:
        stats = await anyio.to_thread.run_sync(relay.health)
        statuses = [json.loads(s.read_text()) for _, s in clients if s.exists()]
        if stats["tunnels"] >= want and stats["provisional"] == 0:
            break
        for proc, _ in clients:
            if proc.poll() is not None:
                raise SystemExit(f"a client exited ({proc.returncode}); see its log")
        if relay.proc.poll() is not None:
            raise SystemExit("the relay exited:\n" + relay.log.read_text()[-3000:])
        if time.monotonic() - started > timeout_s:
            print(f"timed out at {stats} (wanted {want})", flush=True)
            break
        print(f"  {time.monotonic() - started:6.1f} s  {stats}", flush=True)
        await anyio.sleep(2.0)
    counts: Counter[str] = Counter()
    for status in statuses:
        counts.update(status["counts"])
    return {"attach_s": time.monotonic() - started, "client_counts": dict(counts), **stats}


async def cpu_figures(relay: RelayProcess, http: Any, targets: list[Any]) -> dict[str, Any]:
    import anyio

    cpu0, wall0 = relay.cpu(), time.monotonic()
    await anyio.sleep(QUIET_S)
    quiet_rate = (relay.cpu() - cpu0) / (time.monotonic() - wall0)
    cpu1, wall1 = relay.cpu(), time.monotonic()
    streams, errors, ttfts = await stream_rounds(http, targets, ROUNDS)
    cpu, wall = relay.cpu() - cpu1, time.monotonic() - wall1
    net = cpu - quiet_rate * wall
    ttfts.sort()
    return {
        "quiet_cpu_pct": 100 * quiet_rate, "streams": streams, "errors": errors, "wall_s": wall, "cpu_s": cpu,
        "cpu_per_stream_ms": 1000 * net / streams, "cpu_per_event_us": 1e6 * net / (streams * (EVENTS + 1)),
        "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else None,
        "ttft_max_ms": 1000 * ttfts[-1] if ttfts else None,
    }  # fmt: skip


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import anyio
    import httpx
    import uvicorn
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from meshnet_gguf.common.ports import free_local_port
    from meshnet_gguf.contract.protocol import NodeAnnouncement
    from meshnet_gguf.contract.signing import encode_token, public_key_text, tracker_issuer_for
    from meshnet_gguf.mesh.identity import NodeIdentity
    from meshnet_gguf.mesh.relay_link import build_relay_link, local_address_for
    from meshnet_gguf.reference.tracker.node_address import AddressPolicy
    from meshnet_gguf.reference.tracker.relay_dialer import NodeDialer, new_connect_claims

    tracker_key = Ed25519PrivateKey.generate()
    key_hex = tracker_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()).hex()
    issuer = tracker_issuer_for(tracker_key.public_key())
    relay = RelayProcess(work, public_key_text(tracker_key.public_key()))
    clients: list[tuple[Any, Path]] = []
    results: dict[str, Any] = {"stages": []}
    app_port = free_local_port()
    server = uvicorn.Server(uvicorn.Config(stream_app, host="127.0.0.1", port=app_port, log_level="warning", lifespan="off"))
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                relay.health()
                break
            except httpx.HTTPError:
                if relay.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(relay.log.read_text()[-3000:])
                await anyio.sleep(0.1)
        await anyio.sleep(SETTLE_S)
        results["empty"] = relay.snapshot()
        print(results["empty"], flush=True)
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve)
            links = []
            for i in range(STREAM_NODES):
                link = build_relay_link(
                    relay.url, NodeIdentity.load_or_create(work / f"node{i}"), work / f"node{i}", local_address_for("127.0.0.1", app_port)
                )
                links.append(link)
                tg.start_soon(link.run)
            with anyio.fail_after(START_TIMEOUT_S):
                while any(link.link_health().idle_work < 1 for link in links):
                    await anyio.sleep(0.05)
            sign = lambda url, node_id: encode_token(new_connect_claims(issuer, url, node_id, 30), tracker_key)  # noqa: E731 - as bench_relay_flood
            dialer = NodeDialer(httpx.Limits(max_connections=64, max_keepalive_connections=0), sign)  # a fresh CONNECT per stream
            async with httpx.AsyncClient(transport=dialer, trust_env=False, timeout=60) as http:
                targets = []
                for link in links:
                    announcement = NodeAnnouncement(
                        node_id=link.identity.node_id, public_key=link.identity.public_key_text, advertised_url=relay.url,
                        model_id="m", first_layer=0, last_layer=0, total_layers=1, slots=STREAMS, node_version="bench",
                        relay=link.attachment(),
                    )  # fmt: skip
                    targets.append(await dialer.through_relay(announcement, AddressPolicy(allow_loopback=True)))
                await stream_rounds(http, targets, 1)  # warm-up; the first CONNECT to each also admits its tunnel
                await anyio.sleep(SETTLE_S)
                results["stages"].append({"bulk": 0, **relay.snapshot()})
                print(results["stages"][-1], flush=True)
                results["cpu_stream_nodes_only"] = await cpu_figures(relay, http, targets)
                print(results["cpu_stream_nodes_only"], flush=True)
                done = 0
                for stage, n_clients in ((args.first_stage, 1), (args.tunnels, args.clients)):
                    more = stage - done
                    if more <= 0:
                        continue
                    started = start_clients(relay, key_hex, done, more, n_clients, work, str(stage))
                    clients += started
                    attach = await wait_tunnels(relay, started, STREAM_NODES + stage, args.attach_timeout)
                    done = stage
                    await anyio.sleep(SETTLE_S)
                    results["stages"].append({"bulk": stage, **relay.snapshot(), "attach": attach})
                    print(results["stages"][-1], flush=True)
                results["cpu_all_attached"] = await cpu_figures(relay, http, targets)
                results["after"] = relay.snapshot()
                print(results["cpu_all_attached"], results["after"], flush=True)
            for link in links:
                await link.close()
            server.should_exit = True
            tg.cancel_scope.cancel()
    finally:
        for proc, _ in clients:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in clients:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        relay.stop()
    return results


# --- report --------------------------------------------------------------------------------------------------------


def render(results: dict[str, Any], command: str) -> str:
    stages = results["stages"]
    base = stages[0]
    last = stages[-1]
    lines = [
        f"## Relay: {last['tunnels']:,} attached tunnels on one relay ({dt.date.today().isoformat()}, {platform.machine()}, "
        f"{os.cpu_count()} cores)",
        "",
        f"`{command}`",
        "",
        f"One `dev relay --trust-tracker-key … --ipv4-network-prefix 24` process (uvloop, descriptor limit raised to the hard "
        f"limit, {resource.getrlimit(resource.RLIMIT_NOFILE)[1]:,}). *Bulk* tunnels: fresh node keys in child processes "
        f"({PER_NETWORK} nodes per 127.a.b.0/24), each a control connection attached with the node's signed proof and pinging "
        "every 10 s as the node's link does, admitted the tracker's way (a CONNECT with a fresh tracker-signed token from "
        "127.0.0.1, answered 200 and spliced to one work connection of the node, then closed), and then **no idle work "
        "pool**: one idle connection per node would already put 10,000 nodes at 20,000 relay descriptors, this machine's "
        "hard limit per process (bench_relay.py part 3 measures a pool's cost). Plus "
        f"{STREAM_NODES} stream nodes (real node relay links with their idle pools) in front of a server streaming "
        f"{EVENTS} numbered SSE events one every {EVENT_GAP_S * 1000:.0f} ms. RSS and descriptors are the relay process's, "
        f"taken {SETTLE_S:.0f} s after every tunnel of the stage was attached and admitted; *per tunnel* is against the "
        f"first row (the stream nodes' tunnels alone). The relay with no tunnel at all: {results['empty']['rss_kib'] / 1024:.1f} MiB, "
        f"{results['empty']['fds']} fds.",
        "",
        "| bulk tunnels asked | tunnels held | relay RSS | relay fds | RSS per tunnel | fds per tunnel | attached and admitted in | client retries |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in stages:
        held = s["tunnels"] - base["tunnels"]  # bulk tunnels the relay holds: fewer than asked where a limit bound
        per_kib = (s["rss_kib"] - base["rss_kib"]) / held if s["bulk"] else None
        per_fd = (s["fds"] - base["fds"]) / held if s["bulk"] else None
        attach = s.get("attach", {})
        retries = sum(attach.get("client_counts", {}).values())
        attach_s = f"{attach['attach_s']:.0f} s" if attach else "-"
        lines.append(
            f"| {s['bulk']:,} | {s['tunnels']:,} | {s['rss_kib'] / 1024:.1f} MiB | {s['fds']:,} | "
            f"{f'**{per_kib:.1f} KiB**' if per_kib is not None else '-'} | {f'{per_fd:.2f}' if per_fd is not None else '-'} | "
            f"{attach_s} | {retries if attach else '-'} |"
        )
    for s in stages:
        if s.get("attach", {}).get("client_counts"):
            lines += ["", f"Stage {s['bulk']:,}: {s['tunnels'] - base['tunnels']:,} bulk tunnels held; the clients met {s['attach']['client_counts']} "
                      "(a node gives up after its last retry; *attached in* then includes the wait for the rest, until --attach-timeout)."]  # fmt: skip
    lines += [
        "",
        f"CPU: the relay's over {QUIET_S:.0f} s quiet (*idle*: pings), then over {ROUNDS} rounds of {STREAMS} concurrent "
        f"streams through the stream nodes, a fresh CONNECT, token and TLS handshake per stream; *per stream* is the CPU "
        "during the streams less the idle rate over the same span.",
        "",
        "| tunnels attached | relay CPU idle | idle CPU per ping | streams | errors | relay CPU per stream | per event | first event p50 / max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, key, tunnels in ((f"{STREAM_NODES} (stream nodes only)", "cpu_stream_nodes_only", STREAM_NODES),
                                (f"{last['tunnels']:,}", "cpu_all_attached", last["tunnels"])):  # fmt: skip
        c = results[key]
        # Only where the pings are many: a few tunnels' pings are below the CPU clock's 10 ms tick over QUIET_S.
        per_ping = f"{c['quiet_cpu_pct'] / 100 / (tunnels / PING_INTERVAL_S) * 1e6:.0f} µs" if tunnels > STREAM_NODES else "-"
        lines.append(
            f"| {label} | {c['quiet_cpu_pct']:.1f} % of a core | {per_ping} | {c['streams']} | **{c['errors']}** | **{c['cpu_per_stream_ms']:.1f} ms** | "
            f"{c['cpu_per_event_us']:.0f} µs | {c['ttft_p50_ms']:.1f} / {c['ttft_max_ms']:.1f} ms |"
        )
    after = results["after"]
    lines += ["", f"After the streams: {after['tunnels']:,} tunnels, {after['provisional']} provisional, relay RSS "
              f"{after['rss_kib'] / 1024:.1f} MiB, {after['fds']:,} fds.", ""]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        port, key_hex, first, count, status = int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6])
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            import uvloop

            uvloop.run(client_main(port, key_hex, first, count, status))
        except ImportError:
            asyncio.run(client_main(port, key_hex, first, count, status))
        except KeyboardInterrupt:
            pass
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tunnels", type=int, default=10_000, help="bulk tunnels at the last stage")
    parser.add_argument("--first-stage", type=int, default=1_000, help="bulk tunnels at the middle stage")
    parser.add_argument("--clients", type=int, default=4, help="client processes for the last stage's bulk tunnels")
    parser.add_argument("--attach-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, help="append the results section to this Markdown file")
    args = parser.parse_args()
    raise_fd_limit()
    work = HERE / ".cache" / "relay-tunnels-run"
    work.mkdir(parents=True, exist_ok=True)
    import anyio

    results = anyio.run(run, args, work)
    (HERE / ".cache" / "relay-tunnels-results.json").write_text(json.dumps(results, indent=1))
    text = render(results, "python bench/bench_relay_tunnels.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.out:
        with args.out.open("a") as fh:
            fh.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
