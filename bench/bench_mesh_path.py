#!/usr/bin/env python3
"""The four ways a request reaches a model, side by side in one run, each against the same llama-server reached directly.

    .venv/bin/python bench/bench_mesh_path.py                   # tiny generated model, fast settings
    .venv/bin/python bench/bench_mesh_path.py --model M.gguf --pairs 40 --decode-rounds 4 --gpu-layers all

Three real nodes (`meshnet-gguf serve`, `--parallel 8`), each with its own llama-server,
a reference tracker and a reference relay, all on loopback:

- **standalone**: client -> node S (no tracker);
- **route**: client -> node M with a route token the bench signs with the tracker's key
  (the meshed node's own path: route check, durable ledger row, prompt count; no tracker hop);
- **tracker**: client -> tracker -> node M;
- **tracker+relay**: client -> tracker -> relay -> node R (which dials out to the relay);
- **splice**: client -> a bare byte splice (`splice_hop.py`) -> node S's llama-server: not a way
  the mesh uses but its floor, what one more process on the path costs on this machine with
  nothing parsed or checked (the node over it is what the node's own work costs).

Every figure is paired: each request through a path alternates (ABBA) with the same
request sent straight to that path's node's own llama-server (its port or socket and
internal key read from /proc), so drift hits both alike. Each prompt starts with a fresh
number, so llama-server's prompt cache never serves one request from another's work.
Reported per path: added TTFT (median of the pairs' differences, and p90/p99) on a
short and a ~1,500-token prompt (and, paired the same way against each other, what each hop
adds: the node over the splice, a route over standalone, the tracker over the route, the relay
over the tracker, and the relay link alone: node R through the relay as the tracker reaches it
against node R directly and against a bare splice in the relay's place); client-side tokens/s
at c=1 and c=8 against direct; the node process's CPU per request (on the short-prompt pairs)
and per 1,000 streamed tokens (on the decode rounds). M and R serve the same file under two names (hard links),
so the tracker's choice of node is the model the request names.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_proxy import CHAT_PATH, Conn, Node, Stream, _Proto, pct, stop_process  # noqa: E402
from cryptography import x509  # noqa: E402

from meshnet_gguf.common.http1_client import HttpConnectError  # noqa: E402
from meshnet_gguf.common.ports import free_local_port  # noqa: E402
from meshnet_gguf.contract.node_tls import certificate_from_text, pinned_client_context  # noqa: E402
from meshnet_gguf.contract.protocol import ROUTE_HEADER, WELL_KNOWN_PATH  # noqa: E402
from meshnet_gguf.contract.signing import body_sha256, encode_token, load_or_create_private_key, tracker_issuer_for  # noqa: E402
from meshnet_gguf.models.tiny_model import write_tiny_model  # noqa: E402
from meshnet_gguf.reference.tracker.node_address import AddressPolicy, pin_node_url  # noqa: E402
from meshnet_gguf.reference.tracker.relay_dialer import RelayTunnel, new_connect_claims  # noqa: E402
from meshnet_gguf.reference.tracker.relay_failover import RelayOrder  # noqa: E402

SERVICE_START_TIMEOUT_S = 30.0
ROUTABLE_TIMEOUT_S = 120.0
ROUTE_LIFETIME_S = 60
ENROLMENT_SECRET = "bench-mesh-path-enrolment-secret"
PATHS = ("splice", "standalone", "route", "tracker", "tracker+relay")
SPLICE_START_TIMEOUT_S = 10.0
CHILD_STOP_TIMEOUT_S = 10.0
# The paths whose requests write ledger rows (the meshed nodes' and the tracker's).
LEDGER_PATHS = ("route", "tracker", "tracker+relay")
LEDGER_WARMUP_REQUESTS = 320
# Under --trace: the warm-up requests left out of the traced nodes' summaries.
TRACE_SKIP = 10


class RoutedConn(Conn):
    """A `Conn` whose requests may carry extra headers (the route token of the next request)."""

    def __init__(self, port: int | str, key: str | None = None, *, fresh: bool = False) -> None:
        super().__init__(port, key, fresh=fresh)
        self.headers: dict[str, str] = {}

    def twin(self) -> RoutedConn:
        """Another connection like this one (the other streams at c=8)."""
        return RoutedConn(self.port, self.key, fresh=self.fresh)

    def _request_bytes(self, method: str, path: str, body: bytes) -> bytes:
        raw = super()._request_bytes(method, path, body)
        if not self.headers:
            return raw
        head, rest = raw.split(b"\r\n", 1)
        extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items()).encode()
        return head + b"\r\n" + extra + rest


class RelayedConn(RoutedConn):
    """A `RoutedConn` through the relay, as the tracker reaches a relayed node: the tracker's own
    `RelayTunnel` (CONNECT with a tracker-signed token, then TLS pinned to the node's certificate),
    the connection kept between requests as the tracker keeps it."""

    def __init__(self, tunnel: RelayTunnel) -> None:
        super().__init__(0)  # no port: the tunnel reaches the node
        self.tunnel = tunnel

    def twin(self) -> RelayedConn:
        return RelayedConn(self.tunnel)

    async def _ensure(self) -> _Proto:
        if self.proto is None or self.proto.lost:
            proto = _Proto()
            try:
                await self.tunnel(proto)
            except HttpConnectError as exc:
                raise OSError(f"through the relay: {exc}") from exc
            self.proto = proto
        return self.proto


async def relay_tunnel(minter: RouteMinter, node: dict[str, Any]) -> RelayTunnel:
    """The tracker's way to a relayed node (`node`: its /v1/nodes announcement), with the tracker's key."""
    relay = node["relay"]
    certificate = certificate_from_text(relay["tls_certificate"])
    node_tls = pinned_client_context(certificate, x509.load_der_x509_certificate(certificate).public_key())  # type: ignore[arg-type]
    issuer = tracker_issuer_for(minter.key.public_key())

    def sign(relay_url: str, node_id: str) -> str:
        return encode_token(new_connect_claims(issuer, relay_url, node_id, ROUTE_LIFETIME_S), minter.key)

    relay_target = await pin_node_url(relay["url"], AddressPolicy(allow_loopback=True))
    return RelayTunnel(RelayOrder([relay_target]), node["node_id"], sign, ssl.create_default_context(), node_tls)


def stop_child(proc: subprocess.Popen[bytes], log: BinaryIO) -> None:
    """`stop_process` with CHILD_STOP_TIMEOUT_S; then its log is closed."""
    stop_process(proc, CHILD_STOP_TIMEOUT_S)
    log.close()


class Service:
    """A `meshnet-gguf dev tracker|relay` child on a free loopback port, stopped by its PID."""

    def __init__(self, work: Path, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name, self.args, self.env = name, args, {**os.environ, **env}
        self.port = free_local_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work / f"{name}.log"
        self.log = self.log_path.open("ab")
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshnet_gguf", "dev", self.name, "--port", str(self.port), *self.args],
            stdout=self.log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not start")

    def restart(self) -> None:
        """Start it again on the same port, as a restarted service comes back (the old one must be gone)."""
        assert self.proc.poll() is not None, f"{self.name} is still running"
        self._start()

    def close(self) -> None:
        stop_child(self.proc, self.log)


class SpliceProcess:
    """`splice_hop.py` in front of a llama-server, on a free loopback port, stopped by its PID."""

    def __init__(self, work: Path, to: int | str, name: str = "splice") -> None:
        self.port = free_local_port()
        self.log = (work / f"{name}.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "splice_hop.py"), "--port", str(self.port), "--to", str(to)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + SPLICE_START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError("the splice did not start")

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def close(self) -> None:
        stop_child(self.proc, self.log)


class RouteMinter:
    """Signs routes for node M as the tracker would (the tracker's own key, read from its state dir)."""

    def __init__(self, tracker_state: Path, node: dict[str, Any]) -> None:
        self.key = load_or_create_private_key(tracker_state / "tracker_key.pem")  # the tracker made it: only read
        self.node = node
        self.n = 0

    def token(self, body: bytes) -> str:
        now = int(time.time())
        self.n += 1
        node = self.node
        claims = {
            "iss": tracker_issuer_for(self.key.public_key()), "sub": node["node_id"], "jti": f"bench-{now}-{self.n}",
            "iat": now, "exp": now + ROUTE_LIFETIME_S, "path": CHAT_PATH, "model": node["model_id"],
            "hops": [{"node_id": node["node_id"], "first_layer": 0, "last_layer": node["total_layers"] - 1}],
            "body_sha256": body_sha256(body),
        }  # fmt: skip
        return encode_token(claims, self.key)


def body_for(model: str, prompt: str, max_tokens: int, n: int, *, cached: bool = False) -> bytes:
    """A streamed chat; the leading number makes each prompt new to llama-server's prompt cache.
    `cached`: the number goes last instead, so llama-server reuses the prompt's cached prefix and
    evaluates only its last few tokens, while the node still handles the whole body."""
    content = f"{prompt} {n}" if cached else f"{n} {prompt}"
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
        }  # fmt: skip
    ).encode()


def long_prompt(llama: Node, target_tokens: int) -> tuple[str, int]:
    """Words repeated until llama-server's own tokenizer counts about `target_tokens`."""
    unit = "the quick brown fox jumps over the lazy dog and keeps on running. "

    def count(text: str) -> int:
        transport = httpx.HTTPTransport(uds=llama.llama_port) if isinstance(llama.llama_port, str) else None
        base = "http://localhost" if transport else f"http://127.0.0.1:{llama.llama_port}"
        with httpx.Client(transport=transport, timeout=30, trust_env=False) as http:
            answer = http.post(base + "/tokenize", json={"content": text}, headers={"authorization": f"Bearer {llama.llama_key}"})
        return len(answer.json()["tokens"])

    per_unit = max(1, count(unit * 10) // 10)
    text = unit * max(1, target_tokens // per_unit)
    return text, count(text)


class PathUnderTest:
    def __init__(
        self, name: str, node: Node, conn: RoutedConn, model: str, minter: RouteMinter | None = None,
        cpu_s: Callable[[], float] | None = None,
    ) -> None:  # fmt: skip
        self.name, self.node, self.conn, self.model, self.minter = name, node, conn, model, minter
        self.direct = Conn(node.llama_port, node.llama_key, fresh=True)
        self.extra = [conn.twin() for _ in range(7)]  # the other streams at c=8
        # Whose CPU the path's figures are: the node's, or the splice's on the splice path.
        self.cpu_s = cpu_s or node.cpu_s

    async def send(self, conn: RoutedConn, body: bytes) -> Stream:
        conn.headers = {ROUTE_HEADER: self.minter.token(body)} if self.minter else {}
        return await conn.request("POST", CHAT_PATH, body)


async def ttft_pairs(p: PathUnderTest, prompt: str, pairs: int, start: int, *, cached: bool = False) -> dict[str, Any]:
    diffs: list[float] = []
    direct: list[float] = []
    errors = 0
    cpu = 0.0
    for i in range(pairs):
        body = body_for(p.model, prompt, 2, start + i, cached=cached)
        order = ("direct", "path") if i % 2 == 0 else ("path", "direct")
        got: dict[str, Stream] = {}
        for which in order:
            if which == "direct":
                got[which] = await p.direct.request("POST", CHAT_PATH, body_for(p.model, prompt, 2, start + pairs + i, cached=cached))
            else:
                before = p.cpu_s()
                got[which] = await p.send(p.conn, body)
                cpu += p.cpu_s() - before
        if all(s.ok and s.ttft is not None for s in got.values()):
            diffs.append(got["path"].ttft - got["direct"].ttft)  # type: ignore[operator]
            direct.append(got["direct"].ttft)  # type: ignore[arg-type]
        else:
            errors += 1
            bad = [s for s in got.values() if not s.ok]
            if bad:
                print(f"[{p.name}] error: {bad[0].status} {bad[0].error} {bad[0].body_head[:200]!r}", flush=True)
    return {
        "added_p50": pct(diffs, 50), "added_p90": pct(diffs, 90), "added_p99": pct(diffs, 99),
        "direct_p50": pct(direct, 50), "pairs": len(diffs), "errors": errors, "cpu_ms_per_request": cpu * 1000 / max(1, pairs),
    }  # fmt: skip


# Each hop measured on its own: the outer path against the inner one it adds to, request by
# request (ABBA), rather than as the difference of two paths' figures taken minutes apart.
HOPS = (
    ("the node over a bare splice", "standalone", "splice"),
    ("a route over standalone", "route", "standalone"),
    ("the tracker over the route", "tracker", "route"),
    ("the relay over the tracker", "tracker+relay", "tracker"),
    ("the relay and the node's link over the node reached directly", "node R through the relay", "node R direct"),
    # The relay splices a kept tunnel's bytes as the bare splice does: what is left is the node's link.
    ("the relay and the node's link over a bare splice in their place", "node R through the relay", "node R through a bare splice"),
)
# --long-hops: the first this many hops again with the long prompt (the node's own, and the route's).
LONG_HOPS = 2


async def hop_pairs(
    outer: PathUnderTest, inner: PathUnderTest, prompt: str, pairs: int, start: int, *, cached: bool = False
) -> dict[str, Any]:
    """What `outer` adds over `inner`: TTFT differences of the same prompt sent both ways, alternating."""
    diffs: list[float] = []
    errors = 0
    for i in range(pairs):
        got: dict[str, Stream] = {}
        for p in (outer, inner) if i % 2 == 0 else (inner, outer):
            got[p.name] = await p.send(p.conn, body_for(p.model, prompt, 2, start + 2 * i + (p is inner), cached=cached))
        if all(s.ok and s.ttft is not None for s in got.values()):
            diffs.append(got[outer.name].ttft - got[inner.name].ttft)  # type: ignore[operator]
        else:
            errors += 1
    return {"added_p50": pct(diffs, 50), "added_p90": pct(diffs, 90), "added_p99": pct(diffs, 99), "pairs": len(diffs), "errors": errors}


async def decode(p: PathUnderTest, c: int, rounds: int, tokens: int, start: int) -> dict[str, Any]:
    """Rounds of c streams, in the order direct, path, path, direct; each path round is paired with
    the direct round beside it, and the ratio is the median of the pairs' ratios."""
    rates: list[tuple[str, float]] = []
    cpu, streamed, errors = 0.0, 0, 0
    directs = [p.direct] + [Conn(p.node.llama_port, p.node.llama_key, fresh=True) for _ in range(c - 1)]
    conns = [p.conn, *p.extra][:c]
    n = start
    for i in range(rounds * 2):
        which = ("direct", "path", "path", "direct")[i % 4]
        bodies = [body_for(p.model, "Tell me a long story.", tokens, n + k) for k in range(c)]
        n += c
        before = p.cpu_s()
        if which == "direct":
            streams = await asyncio.gather(*(conn.request("POST", CHAT_PATH, b) for conn, b in zip(directs, bodies)))
        else:
            streams = await asyncio.gather(*(p.send(conn, b) for conn, b in zip(conns, bodies)))
            cpu += p.cpu_s() - before
            streamed += sum(s.n_content for s in streams)
        ok = [s for s in streams if s.ok and s.t_first_content is not None and s.t_last_content is not None and s.n_content > 1]
        errors += len(streams) - len(ok)
        if len(ok) != c:
            rates.append((which, float("nan")))
            continue
        first = min(s.t_first_content for s in ok)  # type: ignore[type-var]
        last = max(s.t_last_content for s in ok)  # type: ignore[type-var]
        produced = sum(s.n_content for s in ok) - c
        rates.append((which, produced / (last - first) if last > first else float("nan")))
    pairs = []
    for k in range(0, len(rates) - 1, 2):  # (direct, path) then (path, direct)
        (a, ra), (_, rb) = rates[k], rates[k + 1]
        d, q = (ra, rb) if a == "direct" else (rb, ra)
        if d == d and q == q and d > 0:
            pairs.append(q / d)
    return {
        "direct_tok_s": statistics.median(r for w, r in rates if w == "direct" and r == r)
        if any(w == "direct" and r == r for w, r in rates)
        else float("nan"),
        "ratio": statistics.median(pairs) if pairs else float("nan"),
        "pairs": len(pairs),
        "errors": errors,
        "cpu_ms_per_1k_tokens": cpu * 1e6 / streamed if streamed else float("nan"),
    }


async def send_many(p: PathUnderTest, conn: RoutedConn, count: int, start: int) -> None:
    """`count` one-token requests through `p` on `conn`, one after another."""
    for i in range(count):
        await p.send(conn, body_for(p.model, "warm up", 1, start + i))


def wait_routable(tracker: Service, models: set[str]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + ROUTABLE_TIMEOUT_S
    while time.monotonic() < deadline:
        served = {m["id"] for m in httpx.get(tracker.url + "/v1/models", timeout=2, trust_env=False).json().get("data", [])}
        if models <= served:
            return httpx.get(tracker.url + "/v1/nodes", timeout=2, trust_env=False).json()
        time.sleep(0.3)
    raise RuntimeError(f"the tracker never listed {models}")


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="meshnet-mesh-path-"))
    source = Path(args.model) if args.model else write_tiny_model(work / "tiny.gguf")
    models = {}
    for suffix in ("s", "m", "r"):
        linked = work / f"{source.stem}-{suffix}.gguf"
        try:
            os.link(source, linked)
        except OSError:
            linked.symlink_to(source.resolve())
        models[suffix] = linked
    node_args = ["--parallel", "8", "--ctx-size", str(args.ctx_size), *(["--n-gpu-layers", args.gpu_layers] if args.gpu_layers else [])]
    tracker = Service(work, "tracker", ["--state-dir", str(work / "tracker"), "--heartbeat-interval", "2",
                                        "--health-poll-interval", "1"], {"MESHNET_TRACKER_ENROLMENT_SECRET": ENROLMENT_SECRET})  # fmt: skip
    key = httpx.get(tracker.url + WELL_KNOWN_PATH, timeout=5, trust_env=False).json()["public_key"]
    # The relay lets through only CONNECTs this tracker signed (protocol 9.2).
    relay = Service(work, "relay", ["--trust-tracker-key", key], {})
    mesh = ["--tracker", tracker.url, "--tracker-public-key", key]
    secret = {"MESHNET_ENROLMENT_SECRET": ENROLMENT_SECRET}
    # --trace: the standalone and the routed node run under trace_node.py (where their time goes).
    traces = {k: work / f"trace-{k}.json" for k in ("s", "m")}
    trace_env = {k: {"MESHNET_BENCH_TRACE_OUT": str(v), "MESHNET_BENCH_TRACE_SKIP": str(TRACE_SKIP)} if args.trace else {}
                 for k, v in traces.items()}  # fmt: skip
    nodes = {
        "s": Node("path-s", ["--gguf", str(models["s"]), *node_args], trace_env["s"], trace=args.trace),
        "m": Node("path-m", ["--gguf", str(models["m"]), *node_args, *mesh], {**secret, **trace_env["m"]}, trace=args.trace),
        "r": Node("path-r", ["--gguf", str(models["r"]), *node_args, *mesh, "--relay", relay.url], secret),
    }
    results: dict[str, Any] = {"paths": {}}
    splice: SpliceProcess | None = None
    splice_r: SpliceProcess | None = None
    try:
        for node in nodes.values():
            await node.wait_ready()
        splice = SpliceProcess(work, nodes["s"].llama_port)
        registered = wait_routable(tracker, {models["m"].stem, models["r"].stem})
        node_m, node_r = (
            next(n["announcement"] | {"node_id": n["node_id"]} for n in registered if n["model"] == models[k].stem) for k in ("m", "r")
        )
        prompt, prompt_tokens = long_prompt(nodes["s"], args.long_tokens)
        results["long_prompt_tokens"] = prompt_tokens
        minter = RouteMinter(work / "tracker", node_m)
        paths = [
            PathUnderTest(
                "splice", nodes["s"], RoutedConn(splice.port, nodes["s"].llama_key, fresh=True), models["s"].stem, cpu_s=splice.cpu_s
            ),
            PathUnderTest("standalone", nodes["s"], RoutedConn(nodes["s"].port), models["s"].stem),
            PathUnderTest("route", nodes["m"], RoutedConn(nodes["m"].port), models["m"].stem, minter),
            PathUnderTest("tracker", nodes["m"], RoutedConn(tracker.port), models["m"].stem),
            PathUnderTest("tracker+relay", nodes["r"], RoutedConn(tracker.port), models["r"].stem),
        ]
        # For the relay link's hop alone: node R with its routes, reached directly and through the relay
        # as the tracker reaches it (only paired with each other, no phases of their own).
        minter_r = RouteMinter(work / "tracker", node_r)
        splice_r = SpliceProcess(work, nodes["r"].port, "splice-r")
        link_paths = [
            PathUnderTest("node R direct", nodes["r"], RoutedConn(nodes["r"].port), models["r"].stem, minter_r),
            PathUnderTest(
                "node R through the relay", nodes["r"], RelayedConn(await relay_tunnel(minter_r, node_r)), models["r"].stem, minter_r
            ),
            PathUnderTest("node R through a bare splice", nodes["r"], RoutedConn(splice_r.port), models["r"].stem, minter_r),
        ]
        n = 0
        for p in paths + link_paths:  # warm-up: connections, caches, the relay's idle work connections
            for _ in range(3):
                await p.send(p.conn, body_for(p.model, "warm up", 4, n))
                await p.direct.request("POST", CHAT_PATH, body_for(p.model, "warm up", 4, n + 1))
                n += 2
        # Then a mesh that has served a while: a few hundred requests through each ledger-writing
        # path. A freshly started one is slower for its first few hundred (its ledgers' logs grow,
        # its processes warm: bench/RESULTS.md, "Round 6"); --ledger-warmup 0 measures that.
        for p in paths:
            if p.name in LEDGER_PATHS and args.ledger_warmup:
                conns = [p.conn, *p.extra]
                per_conn = -(-args.ledger_warmup // len(conns))
                await asyncio.gather(*(send_many(p, conn, per_conn, n + k * per_conn) for k, conn in enumerate(conns)))
                n += per_conn * len(conns)
        for p in paths:
            r: dict[str, Any] = {}
            r["short"] = await ttft_pairs(p, "Say hello.", args.pairs, n)
            n += 2 * args.pairs
            r["long"] = await ttft_pairs(p, prompt, args.pairs, n, cached=args.long_cached)
            n += 2 * args.pairs
            for c in (1, 8):
                r[f"c{c}"] = await decode(p, c, args.decode_rounds, args.decode_tokens, n)
                n += 2 * args.decode_rounds * c
            results["paths"][p.name] = r
            print(f"[{p.name}] short {r['short']['added_p50'] * 1000:+.2f} ms, long {r['long']['added_p50'] * 1000:+.2f} ms, "
                  f"c1 {r['c1']['ratio']:.3f}, c8 {r['c8']['ratio']:.3f}, cpu/req {r['short']['cpu_ms_per_request']:.2f} ms", flush=True)  # fmt: skip
        by_name = {p.name: p for p in paths + link_paths}
        results["hops"] = {}
        for label, outer, inner in HOPS:
            hop = await hop_pairs(by_name[outer], by_name[inner], "Say hello.", args.pairs, n)
            n += 2 * args.pairs
            results["hops"][label] = hop
            print(f"[hop] {label}: {hop['added_p50'] * 1000:+.2f} ms (p90 {hop['added_p90'] * 1000:.2f}, {hop['pairs']} pairs)", flush=True)
        if args.long_hops:
            # The node's own work that grows with the prompt (the body parsed, hashed and kept in
            # the synced row), paired at the long prompt where a path's own figure drowns in prefill.
            results["hops_long"] = {}
            for label, outer, inner in HOPS[:LONG_HOPS]:
                hop = await hop_pairs(by_name[outer], by_name[inner], prompt, args.pairs, n, cached=args.long_cached)
                n += 2 * args.pairs
                results["hops_long"][label] = hop
                print(
                    f"[hop, long prompt] {label}: {hop['added_p50'] * 1000:+.2f} ms (p90 {hop['added_p90'] * 1000:.2f}, {hop['pairs']} pairs)",
                    flush=True,
                )
    finally:
        for bare in (splice, splice_r):
            if bare is not None:
                bare.close()
        for node in nodes.values():
            node.close()
        relay.close()
        tracker.close()
    if args.trace:
        results["trace"] = {k: json.loads(v.read_text()) for k, v in traces.items() if v.exists()}
        for k, segments in results["trace"].items():
            print(f"trace, {'standalone' if k == 's' else 'route'} node (p50 / p90 us):")
            for name, figures in segments.items():
                print(f"  {figures['p50_us']:8.0f} {figures['p90_us']:8.0f}  {name}")
    return results


def table(results: dict[str, Any]) -> str:
    long = f"~{results['long_prompt_tokens']:,}-token prompt" + (
        ", its prefix cached" if results.get("args", {}).get("long_cached") else ""
    )
    lines = [
        f"| path | added TTFT, short prompt: p50 (p90, p99) | added TTFT, {long}: p50 (p90, p99) "
        "| tok/s vs direct, c=1 | tok/s vs direct, c=8 | node CPU per request | node CPU per 1,000 streamed tokens (c=8) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in PATHS:
        r = results["paths"].get(name)
        if r is None:
            continue
        s, lg = r["short"], r["long"]
        lines.append(
            f"| {name} | {s['added_p50'] * 1000:+.2f} ms ({s['added_p90'] * 1000:.2f}, {s['added_p99'] * 1000:.2f}) "
            f"| {lg['added_p50'] * 1000:+.2f} ms ({lg['added_p90'] * 1000:.2f}, {lg['added_p99'] * 1000:.2f}) "
            f"| {r['c1']['ratio'] * 100:.1f} % | {r['c8']['ratio'] * 100:.1f} % | {s['cpu_ms_per_request']:.2f} ms "
            f"| {r['c8']['cpu_ms_per_1k_tokens']:.0f} ms |"
        )
    if results.get("hops"):
        lines += ["", "| hop, short prompt, paired with the path it adds to | p50 | p90 | p99 |", "|---|---|---|---|"]
        for label, hop in results["hops"].items():
            lines.append(
                f"| {label} | {hop['added_p50'] * 1000:+.2f} ms | {hop['added_p90'] * 1000:+.2f} ms | {hop['added_p99'] * 1000:+.2f} ms |"
            )
    if results.get("hops_long"):
        lines += ["", f"| hop, {long} | p50 | p90 | p99 |", "|---|---|---|---|"]
        for label, hop in results["hops_long"].items():
            lines.append(
                f"| {label} | {hop['added_p50'] * 1000:+.2f} ms | {hop['added_p90'] * 1000:+.2f} ms | {hop['added_p99'] * 1000:+.2f} ms |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GGUF file (default: the tiny generated model)")
    parser.add_argument("--pairs", type=int, default=20, help="TTFT pairs per path and prompt (default 20)")
    parser.add_argument("--long-tokens", type=int, default=1500, help="the long prompt's length in tokens")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens per stream in the tokens/s rounds")
    parser.add_argument("--decode-rounds", type=int, default=4, help="rounds per path and concurrency (each direct + path twice)")
    parser.add_argument(
        "--ledger-warmup",
        type=int,
        default=LEDGER_WARMUP_REQUESTS,
        help="requests through each ledger-writing path before measuring (0: a fresh mesh)",
    )
    parser.add_argument("--ctx-size", type=int, default=16384, help="node context (split over 8 slots)")
    parser.add_argument("--long-hops", action="store_true", help="pair the node's and the route's hops at the long prompt too")
    parser.add_argument("--long-cached", action="store_true",
                        help="long prompts end with their number, so llama-server reuses their cached prefix: the nodes' "
                             "work on a long body without the prefill's spread")  # fmt: skip
    parser.add_argument("--gpu-layers", help="passed to the nodes as --n-gpu-layers")
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    parser.add_argument(
        "--trace", action="store_true", help="run the standalone and routed nodes under trace_node.py and print where their time goes"
    )
    args = parser.parse_args()
    started = time.time()
    results = asyncio.run(amain(args))
    results["args"] = vars(args) | {"json": str(args.json) if args.json else None}
    results["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    results["seconds"] = time.time() - started
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print()
    print(table(results))


if __name__ == "__main__":
    main()
