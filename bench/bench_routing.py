#!/usr/bin/env python3
"""Time to first token of a mixed load over a fast and a slow node, by the tracker's routing rule.

    .venv/bin/python bench/bench_routing.py                      # small: 3 clients x 12 requests per rule
    .venv/bin/python bench/bench_routing.py --clients 4 --requests 30

Two real nodes (`meshnet-gguf serve --tracker`, `--parallel 2`) serve the same model name: a tiny
generated llama, and a wider, deeper one of the same family (about 100x the arithmetic per token),
each measuring itself at start. A reference tracker runs in this process (its own thread and event
loop); between rounds only its pick rule changes:

- **speed**: the tracker's rule (`registry.route_rank`: the soonest expected first token, spilling
  past full nodes), its estimates reset to the nodes' claims at the start of the round;
- **free-slots**: the rule before it, least busy fraction then least routed to;
- **round-robin**: each routable node in turn, whatever its load.

The load is closed-loop: each client sends its requests back to back, a seeded mix of short
(~20 words) and long (~300 words) prompts and of 8 or 32 completion tokens, streamed. TTFT is
measured at the client, request written to the first content delta. Reported per rule: mean, p50,
p95 TTFT and the share each node served. Logs and state under a temporary folder, removed after.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
from meshnet_gguf.reference.tracker.node_address import AddressPolicy
from meshnet_gguf.reference.tracker.node_speed import NodeSpeed, overhead_floor_s
from meshnet_gguf.reference.tracker.registry import NodeEntry, NodeRegistry, route_rank
from meshnet_gguf.reference.tracker.app import Tracker
from meshnet_gguf.reference.tracker.config import TrackerConfig

SLOW_SPEC = TinyModelSpec(n_layers=4, n_embd=384, n_head=4, n_head_kv=2, n_ff=1536)
SLOTS = 2
SHORT_WORDS, LONG_WORDS = 20, 300
READY_TIMEOUT_S = 180.0
Pick = Callable[[NodeRegistry, str, Collection[str], int], "NodeEntry | None"]


def pick_speed(registry: NodeRegistry, model: str, exclude: Collection[str], prompt_tokens: int) -> NodeEntry | None:
    candidates = [e for e in registry.routable(model) if e.node_id not in exclude]
    floor = overhead_floor_s(e.speed for e in candidates)
    return min(candidates, key=lambda e: route_rank(e, prompt_tokens, floor)) if candidates else None


def pick_free_slots(registry: NodeRegistry, model: str, exclude: Collection[str], prompt_tokens: int) -> NodeEntry | None:
    candidates = [e for e in registry.routable(model) if e.node_id not in exclude]
    return min(candidates, key=lambda e: (e.busy_fraction(), e.routed)) if candidates else None


_turn = itertools.count()


def pick_round_robin(registry: NodeRegistry, model: str, exclude: Collection[str], prompt_tokens: int) -> NodeEntry | None:
    candidates = sorted((e for e in registry.routable(model) if e.node_id not in exclude), key=lambda e: e.node_id)
    return candidates[next(_turn) % len(candidates)] if candidates else None


RULES: dict[str, Pick] = {"round-robin": pick_round_robin, "free-slots": pick_free_slots, "speed": pick_speed}


class TrackerThread:
    """The reference tracker on a loopback port, in its own thread and event loop."""

    def __init__(self, state_dir: Path) -> None:
        self.tracker = Tracker(TrackerConfig(
            state_dir=state_dir, open_enrolment=True, addresses=AddressPolicy(allow_loopback=True),
            heartbeat_interval_s=1.0, health_poll_interval_s=1.0,
        ))  # fmt: skip
        self.port = free_local_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.tracker.app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def use(self, rule: Pick) -> None:
        registry = self.tracker.registry
        for entry in registry.all():
            entry.speed = NodeSpeed(entry.speed.claim)  # every round starts from the nodes' own claims
            entry.routed = 0
        registry.pick = lambda model, exclude=(), prompt_tokens=0: rule(registry, model, exclude, prompt_tokens)  # type: ignore[method-assign]

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.tracker.close()


def start_node(gguf: Path, workdir: Path, tracker_url: str, public_key: str) -> tuple[subprocess.Popen[bytes], str, Any]:
    port = free_local_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = (workdir / "node.log").open("wb")
    env = {**os.environ, "MESHNET_TRACKER_PUBLIC_KEY": public_key}
    argv = [
        sys.executable, "-m", "meshnet_gguf", "serve", "--gguf", str(gguf), "--port", str(port), "--tracker", tracker_url,
        "--parallel", str(SLOTS), "--ctx-size", "4096", "--state-dir", str(workdir / "state"),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log


def wait_routable(url: str, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        nodes = httpx.get(url + "/v1/nodes", timeout=5).json()
        if len(nodes) == count and all(n["healthy"] and n["speed"]["claimed_prefill_tokens_per_s"] for n in nodes):
            return nodes
        time.sleep(0.2)
    raise SystemExit("the nodes did not become routable with their speed claims in time")


def requests_for(seed: int, count: int) -> list[tuple[int, int]]:
    """(prompt words, max tokens) per request: a seeded mix, the same for every rule."""
    rng = random.Random(seed)
    return [(rng.choice((SHORT_WORDS, SHORT_WORDS, LONG_WORDS)), rng.choice((8, 32))) for _ in range(count)]


async def one(http: httpx.AsyncClient, url: str, words: int, max_tokens: int, n: int) -> tuple[float, str] | None:
    # A fresh number first, so llama-server's prompt cache never serves one request from another's work.
    prompt = f"{n} " + " the" * words
    body = {"model": "model", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    started = time.perf_counter()
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return None
        ttft = None
        async for chunk in response.aiter_raw():
            if ttft is None and b'"content":"' in chunk:
                ttft = time.perf_counter() - started
        request_id = response.headers["x-meshnet-request-id"]
    node = (await http.get(f"{url}/v1/usage/{request_id}")).json()["node_id"]
    return (ttft if ttft is not None else float("nan")), node


async def round_of(url: str, clients: int, requests: int, seed: int) -> dict[str, Any]:
    ttfts: list[float] = []
    nodes: Counter[str] = Counter()
    refused = 0
    counter = itertools.count(seed * 100_000)

    async def client(i: int) -> None:
        nonlocal refused
        async with httpx.AsyncClient(timeout=120) as http:
            for words, max_tokens in requests_for(seed + i, requests):
                got = await one(http, url, words, max_tokens, next(counter))
                if got is None:
                    refused += 1  # a full node's 503: counted, not retried
                    continue
                ttfts.append(got[0])
                nodes[got[1]] += 1

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    ordered = sorted(t for t in ttfts if not math.isnan(t))
    return {
        "requests": len(ttfts), "refused": refused, "wall_s": round(time.perf_counter() - started, 2),
        "ttft_mean_ms": round(statistics.fmean(ordered) * 1000, 1),
        "ttft_p50_ms": round(ordered[len(ordered) // 2] * 1000, 1),
        "ttft_p95_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1000, 1),
        "served": dict(nodes),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=SLOTS + 1, help="concurrent clients (default: the fast node's slots + 1)")
    parser.add_argument("--requests", type=int, default=12, help="requests per client per rule")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        work = Path(tmp)
        fast_gguf = write_tiny_model(work / "fast-model" / "model.gguf")
        slow_gguf = write_tiny_model(work / "slow-model" / "model.gguf", SLOW_SPEC)
        tracker = TrackerThread(work / "tracker")
        children = []
        try:
            for name, gguf in (("fast", fast_gguf), ("slow", slow_gguf)):
                children.append((name, *start_node(gguf, work / name, tracker.url, tracker.tracker.public_key_text)))
            nodes = wait_routable(tracker.url, 2)
            names = {n["node_id"]: next(name for name, _p, url, _l in children if url == n["advertised_url"]) for n in nodes}
            claims = {names[n["node_id"]]: n["speed"] for n in nodes}
            results: dict[str, Any] = {"claims": claims, "rules": {}}
            for rule_name, rule in RULES.items():
                tracker.use(rule)
                outcome = asyncio.run(round_of(tracker.url, args.clients, args.requests, args.seed))
                outcome["served"] = {names.get(k, k): v for k, v in outcome["served"].items()}
                results["rules"][rule_name] = outcome
                print(f"{rule_name:12} {json.dumps(outcome)}", flush=True)
                time.sleep(1.0)
            print(json.dumps(results, indent=1))
        finally:
            for _name, proc, _url, log in children:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        os.kill(proc.pid, signal.SIGKILL)
                log.close()
            tracker.close()


if __name__ == "__main__":
    main()
