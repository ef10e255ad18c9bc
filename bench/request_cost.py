#!/usr/bin/env python3
"""The node's own Python work per request, without sockets: the production proxy (`build_proxy`, the
node's usage sinks, and for `meshed` the real route gate, ledger and receipts) called in process,
in front of an in-process llama-server stand-in that answers at once with a short stream.

    PYTHONPATH=src python bench/request_cost.py [--requests N] [--tokens T] [--prompt-tokens P] [--profile K] [--json OUT]

For each mode it prints, per request: the time from the app being called to the upstream `send`
(all admission work before forwarding: on a meshed node the route check and the synced ledger
row), the process CPU of a whole request (that work, metering the stream, the usage sinks, the
receipt and settled row), and the CPU per streamed token. With `--profile K` it adds the top K
functions of a cProfile run by their own time (what to cut first). What the network and
llama-server cost is `bench_mesh_path.py`'s; this is only what the node's code costs, and so
what the issue's CPU targets measure without the noise of a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import logging
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import ROUTE_HEADER, HealthReport
from meshnet_gguf.contract.signing import body_sha256, encode_token, tracker_issuer_for
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.ledger import UsageLedger
from meshnet_gguf.mesh.meshed_mode import MeshedMode, RouteGate
from meshnet_gguf.mesh.receipts import LedgerUsageSink
from meshnet_gguf.node import build_proxy
from meshnet_gguf.ops.metrics import NodeMetrics
from meshnet_gguf.serving.slots import Slots
from meshnet_gguf.serving.prompt_count import PromptCounter
from meshnet_gguf.serving.node_surface import NodeDoors, node_table
from meshnet_gguf.serving.routes import RouteTable
from meshnet_gguf.serving.status_page import RecentRequests
from meshnet_gguf.serving.upstream_target import UpstreamTarget
from meshnet_gguf.serving.usage_journal import UsageJournal
from meshnet_gguf.serving.usage_stats import UsageLog, UsageStats

MODEL, LAYERS, PATH = "cost-model", 22, "/v1/chat/completions"
WARMUP_REQUESTS = 200
# English of about ten tokens a sentence, for --prompt-tokens.
SENTENCE = "The quick brown fox jumps over the lazy dog. "


def chat_body(prompt_tokens: int) -> bytes:
    """The streamed chat each request sends: "Say hi.", or about `prompt_tokens` tokens of English."""
    content = SENTENCE * (prompt_tokens // 10) if prompt_tokens else "Say hi."
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": True, "max_tokens": 64}).encode()


def stream_chunks(tokens: int) -> list[bytes]:
    """What llama-server streams for a chat: a role delta, one event per token, the finish with timings, [DONE]."""
    head = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"object":"chat.completion.chunk"}\n\n'
    token = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" hi"}}],"object":"chat.completion.chunk"}\n\n'
    tail = (
        b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"object":"chat.completion.chunk",'
        b'"timings":{"cache_n":0,"prompt_n":12,"prompt_ms":1.0,"predicted_n":' + str(tokens).encode() + b',"predicted_ms":10.0,'
        b'"predicted_per_second":1000.0}}\n\ndata: [DONE]\n\n'
    )
    return [head, *([token] * tokens), tail]


class InstantResponse:
    status = 200
    headers = [("content-type", "text/event-stream")]

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk

    async def read(self) -> bytes:
        return b"".join(self._chunks)

    async def aclose(self) -> None:
        return None


class InstantUpstream:
    """Answers every request at once; notes when each `send` came (the end of admission)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks
        self.sent_at = 0.0

    async def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> InstantResponse:
        if url.endswith("/apply-template"):  # a standalone stream's prompt count
            return InstantResponse([b'{"prompt":"<|user|>Say hi.<|assistant|>"}'])
        if url.endswith("/tokenize"):
            return InstantResponse([b'{"tokens":[1,2,3,4,5,6,7,8,9,10,11,12]}'])
        self.sent_at = time.perf_counter()
        return InstantResponse(self._chunks)

    async def aclose(self) -> None:
        return None


def build(
    mode_name: str, state_dir: Path, upstream: InstantUpstream, body: bytes
) -> tuple[RouteTable, Callable[[], dict[str, str]], UsageLedger | None]:
    slots = Slots(total=8)
    target = UpstreamTarget("http://127.0.0.1:1", "llama-key")
    sinks: list[Any] = [UsageStats(), RecentRequests(), UsageLog(), NodeMetrics(in_flight=lambda: slots.in_flight)]
    if mode_name == "standalone":
        # As the node wires a standalone node: its usage appended to the journal in the state dir.
        # "standalone-no-journal" is the standalone path as it was before the journal.
        sinks.append(UsageJournal.in_state_dir(state_dir))
    mode = None
    ledger = None
    headers: Callable[[], dict[str, str]] = lambda: {}  # noqa: E731
    if mode_name == "meshed":
        identity = NodeIdentity.load_or_create(state_dir)
        ledger = UsageLedger.in_state_dir(state_dir)
        tracker = Ed25519PrivateKey.generate()
        gate = RouteGate(identity.node_id, MODEL, LAYERS, tracker.public_key())
        journal = LedgerUsageSink(ledger, identity)
        mode = MeshedMode(gate, journal, retry_after_s=1)
        sinks.append(journal)
        serial = iter(range(10**9))

        def routed() -> dict[str, str]:
            now = int(time.time())
            claims = {
                "iss": tracker_issuer_for(tracker.public_key()), "sub": identity.node_id, "jti": f"req-{next(serial)}",
                "iat": now, "exp": now + 60, "path": PATH, "model": MODEL,
                "hops": [{"node_id": identity.node_id, "first_layer": 0, "last_layer": LAYERS - 1}],
                "body_sha256": body_sha256(body), "max_tokens": 512,
            }  # fmt: skip
            return {ROUTE_HEADER.lower(): encode_token(claims, tracker)}

        headers = routed
    settings = NodeSettings()
    health = lambda: HealthReport(state="ready", model=MODEL, slots_total=8, slots_busy=slots.in_flight)  # noqa: E731
    proxy = build_proxy(
        settings,
        upstream=lambda: target,
        client=upstream,  # type: ignore[arg-type]
        slots=slots,
        prompt_counter=PromptCounter(upstream, settings.retry_after_s),  # type: ignore[arg-type]
        model_name=MODEL,
        health=health,
        usage_sinks=sinks,
        mode=mode,
    )
    # As the listener serves it: the node's table in front of the proxy.
    return node_table(NodeDoors(proxy, health)), headers, ledger


async def one_request(app: RouteTable, extra_headers: dict[str, str], body: bytes) -> tuple[float, int]:
    """(when the app was called, the status it answered)."""
    headers = [(b"host", b"127.0.0.1:8080"), (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in extra_headers.items()]
    scope = {"type": "http", "method": "POST", "path": PATH, "headers": headers, "query_string": b""}
    delivered = False
    never = asyncio.Event()
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    called = time.perf_counter()
    await app(scope, receive, send)
    return called, status


async def measure(mode_name: str, requests: int, tokens: int, body: bytes, profile: cProfile.Profile | None) -> dict[str, float]:
    upstream = InstantUpstream(stream_chunks(tokens))
    with tempfile.TemporaryDirectory(prefix="request-cost-") as tmp:
        app, headers, ledger = build(mode_name, Path(tmp), upstream, body)
        pre_forward: list[float] = []
        cpu = 0.0
        for i in range(WARMUP_REQUESTS + requests):
            extra = headers()  # the tracker's signing is not the node's work: outside the timing
            measured = i >= WARMUP_REQUESTS
            if measured and profile is not None:
                profile.enable()
            cpu_before = time.process_time()
            called, status = await one_request(app, extra, body)
            cpu_after = time.process_time()
            if measured and profile is not None:
                profile.disable()
            if status != 200:
                raise SystemExit(f"{mode_name}: request {i} answered {status}")
            if measured:
                pre_forward.append((upstream.sent_at - called) * 1e6)
                cpu += cpu_after - cpu_before
        if ledger is not None:
            await ledger.aclose()
    pre_forward.sort()
    return {
        "pre_forward_p50_us": statistics.median(pre_forward),
        "pre_forward_p90_us": pre_forward[int(len(pre_forward) * 0.9)],
        "cpu_ms_per_request": cpu * 1000 / requests,
        "cpu_us_per_token": cpu * 1e6 / (requests * tokens),
    }


def run_loop(main: Awaitable[Any]) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)  # type: ignore[arg-type]
    return uvloop.run(main)  # type: ignore[arg-type]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per streamed answer (one SSE event each)")
    parser.add_argument(
        "--modes", default="standalone,meshed", help="standalone, standalone-no-journal (without the usage journal), meshed"
    )
    parser.add_argument("--prompt-tokens", type=int, default=0, help="a prompt of about this many tokens (default: a short chat)")
    parser.add_argument("--profile", type=int, default=0, metavar="K", help="print the top K functions by own time")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=1, help="run the modes this many times, alternating (a shared machine's drift)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=io.StringIO())  # the usage line is formatted, as in a node
    os.environ.setdefault("MESHNET_STATE_DIR", tempfile.mkdtemp(prefix="request-cost-state-"))
    results: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"}
    results["prompt_tokens"] = args.prompt_tokens
    print(results["machine"])
    prompt = f"~{args.prompt_tokens:,}-token" if args.prompt_tokens else "a short"
    for mode_name in args.modes.split(",") * args.rounds:
        profile = cProfile.Profile() if args.profile else None
        r = run_loop(measure(mode_name, args.requests, args.tokens, chat_body(args.prompt_tokens), profile))
        results[mode_name] = r
        results.setdefault("rounds", []).append({"mode": mode_name, **r})
        print(
            f"{mode_name:>10}: before forwarding p50 {r['pre_forward_p50_us']:.0f} µs (p90 {r['pre_forward_p90_us']:.0f}); "
            f"CPU {r['cpu_ms_per_request']:.3f} ms per request, {r['cpu_us_per_token']:.1f} µs per streamed token "
            f"({args.tokens}-token streams, {prompt} prompt, {args.requests} requests)"
        )
        if profile is not None:
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.profile)
            print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
