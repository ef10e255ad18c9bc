#!/usr/bin/env python3
"""A fair market among equal nodes: the tracker's pick against the strict minimum that came before it.

    .venv/bin/python bench/bench_fair_market.py                          # shares, unequal, newcomer (fake llama-server)
    .venv/bin/python bench/bench_fair_market.py shares --rounds 3
    .venv/bin/python bench/bench_fair_market.py claims --model PATH.gguf  # a real llama-server node: claim vs measured
    .venv/bin/python bench/bench_fair_market.py claims --model PATH.gguf --n-gpu-layers 0   # the same model on the CPU

A reference tracker runs in this process (its own thread and event loop, `bench_routing.TrackerThread`);
the nodes are real `meshnet-gguf serve` processes (`tests/support/node_process.NodeProcess`). For the
pick figures they front the fake llama-server (`tests/support/fake_llama_server.py`), whose first token
comes after a set delay (a node's prefill) and its tokens at a set pace, so equal nodes are equal and
the figures are the rule's, not the box's. Between rounds only the tracker's pick rule changes, and
every round starts from the nodes' claims (a tracker just started) with a few warm requests first:

- **strict**: the pick before the fair market: the strict minimum of `registry.route_rank`;
- **weighted-random**: the fair market's band, one node drawn at random by weight;
- **two-choices**: two free nodes drawn at random, the sooner by `route_rank` taken;
- **fair**: the tracker's pick (`registry.pick`: the band by smooth weighted turns, the unmeasured share).

Scenarios:

- `shares`: three equal nodes, `--requests` (60) sequential requests a round: each node's share,
  and p50 / p95 TTFT at the client (request written to first content chunk);
- `unequal`: a fast and a slow node (`--slow-factor` 5x the first-token delay): p50 / p95 TTFT;
- `newcomer`: two equal nodes under `--clients` (2) closed-loop clients; a third equal node starts:
  seconds and requests from its first health to the tracker trusting it (fair and strict rounds);
- `claims`: one real node on `--model` (llama-server as the node finds it, or `--llama-server`),
  `--requests` streamed requests of chat-sized prompts one at a time through the tracker; the node's
  claimed prefill and decode rates beside the tracker's measurement of them, and each request's prefill
  beside the claim at its own prompt size (`prefill_at_each_size`: how the tracker reads a claim).

Logs and state under a temporary folder, removed after (`--keep` keeps it). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_routing import TrackerThread  # noqa: E402
from support.node_process import NodeProcess  # noqa: E402

from meshnet_gguf.contract.prompt_ceiling import prompt_ceiling  # noqa: E402
from meshnet_gguf.contract.protocol import RatePoint  # noqa: E402
from meshnet_gguf.models.tiny_model import write_tiny_model  # noqa: E402
from meshnet_gguf.reference.tracker.market import Market  # noqa: E402
from meshnet_gguf.reference.tracker.node_speed import NodeSpeed, overhead_floor_s, rate_at  # noqa: E402
from meshnet_gguf.reference.tracker.registry import NodeEntry, NodeRegistry, route_rank  # noqa: E402

FAKE_LLAMA = HERE.parent / "tests" / "support" / "fake_llama_server.py"
MODEL = "model"  # the gguf's file stem: every node serves this name
SLOTS = 2
# The fake llama-server's pace: a first token after this (a node's prefill), then 8 tokens 5 ms apart.
FIRST_TOKEN_S, TOKEN_S, TOKENS = 0.02, 0.005, 8
# Before each round's counted requests, sent until every node is measured (a tracker that ran a while), at most these.
WARM_LIMIT = 60
READY_TIMEOUT_S = 120.0
NEWCOMER_LIMIT_S = 90.0
# claims: chat turns of a line to half a page; the longest is ~1,200 tokens with a byte-level tokenizer (the generated
# test models), ~300 with a real one, within any model's trained context.
CLAIMS_PROMPT_WORDS = (25, 75, 150, 300)
CLAIMS_CTX_PER_SLOT = 2048
Pick = Callable[[NodeRegistry, str, Collection[str], int], "NodeEntry | None"]


# --- the rules ----------------------------------------------------------------------------------------
def pick_strict(registry: NodeRegistry, model: str, exclude: Collection[str], prompt_tokens: int) -> NodeEntry | None:
    candidates = [e for e in registry.routable(model) if e.node_id not in exclude]
    floor = overhead_floor_s(e.speed for e in candidates)
    return min(candidates, key=lambda e: route_rank(e, prompt_tokens, floor)) if candidates else None


_draws = random.Random(7)


def pick_two_choices(registry: NodeRegistry, model: str, exclude: Collection[str], prompt_tokens: int) -> NodeEntry | None:
    candidates = [e for e in registry.routable(model) if e.node_id not in exclude]
    if not candidates:
        return None
    floor = overhead_floor_s(e.speed for e in candidates)
    free = [e for e in candidates if not e.full()] or candidates
    drawn = _draws.sample(free, min(2, len(free)))
    return min(drawn, key=lambda e: route_rank(e, prompt_tokens, floor))


class _WeightedRandomMarket(Market[NodeEntry]):
    """The fair market with its turn replaced by one weighted draw."""

    def take_turn(self, band: Any) -> NodeEntry:
        nodes, weights = zip(*band, strict=True)
        return _draws.choices(nodes, weights=weights)[0]


def pick_fair(registry: NodeRegistry, model: str, exclude: Collection[str], prompt_tokens: int) -> NodeEntry | None:
    return NodeRegistry.pick(registry, model, exclude, prompt_tokens)


def pick_weighted_random(registry: NodeRegistry, model: str, exclude: Collection[str], prompt_tokens: int) -> NodeEntry | None:
    return NodeRegistry.pick(registry, model, exclude, prompt_tokens)


RULES: dict[str, Pick] = {
    "strict": pick_strict,
    "weighted-random": pick_weighted_random,
    "two-choices": pick_two_choices,
    "fair": pick_fair,
}


def use(tracker: TrackerThread, rule: str) -> None:
    """Every node's speed back to its claim, the markets anew (a tracker just started), and `rule` picking."""
    registry = tracker.tracker.registry
    for entry in registry.all():
        entry.speed = NodeSpeed(entry.speed.claim)
        entry.routed = 0
    registry._markets.clear()  # noqa: SLF001 - the bench restarts the tracker's bookkeeping between rounds
    if rule == "weighted-random":
        for entry in registry.all():
            registry._markets.setdefault(entry.announcement.model_id, _WeightedRandomMarket(random.Random(7)))  # noqa: SLF001
    registry.pick = lambda model, exclude=(), prompt_tokens=0: RULES[rule](registry, model, exclude, prompt_tokens)  # type: ignore[method-assign]


# --- nodes ----------------------------------------------------------------------------------------------
def fake_llama_wrapper(folder: Path, first_token_s: float) -> Path:
    """An executable `llama-server` that runs the fake one with this pace."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "llama-server"
    wrapper.write_text(
        f"#!/bin/sh\nexport FAKE_LLAMA_FIRST_TOKEN_DELAY_S={first_token_s} FAKE_LLAMA_TOKEN_DELAY_S={TOKEN_S} FAKE_LLAMA_TOKENS={TOKENS}\n"
        f'exec "{sys.executable}" "{FAKE_LLAMA}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


@contextmanager
def nodes_running(tracker: TrackerThread, work: Path, specs: dict[str, list[str]]) -> Iterator[dict[str, NodeProcess]]:
    """`serve` processes, one per name with its extra arguments, each stopped by its PID after."""
    started: dict[str, NodeProcess] = {}
    try:
        for name, args in specs.items():
            env = {"MESHNET_TRACKER_PUBLIC_KEY": tracker.tracker.public_key_text}
            (work / name).mkdir(parents=True, exist_ok=True)
            started[name] = NodeProcess([*args, "--tracker", tracker.url], workdir=work / name, env=env)
        yield started
    finally:
        for node in started.values():
            node.close()


def wait_routable(tracker: TrackerThread, nodes: dict[str, NodeProcess], timeout: float = READY_TIMEOUT_S) -> dict[str, str]:
    """Node name -> its id, once every one is healthy on the tracker with its claim."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = httpx.get(tracker.url + "/v1/nodes", timeout=5).json()
        by_url = {n["advertised_url"]: n for n in listed if n["healthy"]}
        if all(node.url in by_url for node in nodes.values()):
            return {name: by_url[node.url]["node_id"] for name, node in nodes.items()}
        time.sleep(0.1)
    raise SystemExit(f"the nodes did not become routable in {timeout:.0f} s")


# --- load ---------------------------------------------------------------------------------------------
def one(http: httpx.Client, url: str, n: int, words: int = 20, max_tokens: int = TOKENS) -> tuple[float, str]:
    """One streamed request: (TTFT at the client in s, the node it was billed to)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"{n}" + " the" * words}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}  # fmt: skip
    for _ in range(50):
        started = time.perf_counter()
        with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code == 503:  # a slot counted free a moment early: as a client would, again
                response.read()
                time.sleep(0.02)
                continue
            assert response.status_code == 200, response.read()
            ttft = None
            for chunk in response.iter_raw():
                if ttft is None and b'"content":"' in chunk:
                    ttft = time.perf_counter() - started
            request_id = response.headers["x-meshnet-request-id"]
        node = http.get(f"{url}/v1/usage/{request_id}").json()["node_id"]
        return (ttft if ttft is not None else float("nan")), node
    raise SystemExit("every try answered 503")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000, 1)


def sequential_round(tracker: TrackerThread, rule: str, requests: int, names: dict[str, str]) -> dict[str, Any]:
    use(tracker, rule)
    counter = iter(range(10**9))
    registry = tracker.tracker.registry
    warm = 0
    with httpx.Client(timeout=60) as http:
        # Until every node is measured (trusted), as on a tracker that ran a while; the strict minimum never
        # measures them all, so it stops at the limit.
        while warm < WARM_LIMIT and not all(e.speed.trusted for e in registry.all()):
            one(http, tracker.url, next(counter))
            warm += 1
        served = [one(http, tracker.url, next(counter)) for _ in range(requests)]
    by_id = {v: k for k, v in names.items()}
    shares = Counter(by_id.get(node, node) for _, node in served)
    ttfts = [t for t, _ in served]
    fair = requests / len(names)
    return {
        "served": {name: shares.get(name, 0) for name in names},
        "worst_share_off_a_fair_one": round(max(abs(shares.get(n, 0) - fair) / fair for n in names), 3),
        "ttft_p50_ms": pct(ttfts, 0.5),
        "ttft_p95_ms": pct(ttfts, 0.95),
        "warm_requests": warm,
    }


def rounds_of(tracker: TrackerThread, rules: list[str], rounds: int, requests: int, names: dict[str, str]) -> dict[str, Any]:
    """Rules alternated round by round (drift on a shared box falls on each alike); per rule every round."""
    results: dict[str, list[dict[str, Any]]] = {rule: [] for rule in rules}
    for r in range(rounds):
        for rule in rules if r % 2 == 0 else reversed(rules):
            outcome = sequential_round(tracker, rule, requests, names)
            print(f"  round {r + 1} {rule:15} {json.dumps(outcome)}", file=sys.stderr, flush=True)
            results[rule].append(outcome)
    return results


def newcomer_round(tracker: TrackerThread, work: Path, rule: str, clients: int, wrapper: Path, gguf: Path) -> dict[str, Any]:
    """Closed-loop load on the running nodes; a new equal node starts: seconds and requests until trusted."""
    use(tracker, rule)
    stop = threading.Event()
    sent = Counter[str]()

    def client(i: int) -> None:
        with httpx.Client(timeout=60) as http:
            n = i * 10**6
            while not stop.is_set():
                sent["requests"] += 1
                one(http, tracker.url, n := n + 1)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(3.0)  # the others measured and trusted under load first
    spec = {f"new-{rule}": ["--gguf", str(gguf), "--llama-server", str(wrapper), "--parallel", str(SLOTS)]}
    outcome: dict[str, Any] = {"rule": rule}
    try:
        with nodes_running(tracker, work, spec) as started:
            node_id = wait_routable(tracker, started)[f"new-{rule}"]
            healthy_at, requests_then = time.monotonic(), sent["requests"]
            while time.monotonic() - healthy_at < NEWCOMER_LIMIT_S:
                entry = tracker.tracker.registry.get(node_id)
                if entry is not None and entry.speed.trusted:
                    outcome |= {
                        "trusted_after_s": round(time.monotonic() - healthy_at, 1),
                        "requests_meanwhile": sent["requests"] - requests_then,
                    }
                    break
                time.sleep(0.05)
            else:
                entry = tracker.tracker.registry.get(node_id)
                outcome |= {"trusted_after_s": None, "streams_measured": entry.speed.samples if entry else None,
                            "requests_meanwhile": sent["requests"] - requests_then}  # fmt: skip
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    print(f"  newcomer {json.dumps(outcome)}", file=sys.stderr, flush=True)
    return outcome


# --- scenarios ------------------------------------------------------------------------------------------
def scenario_fake(args: argparse.Namespace, work: Path, tracker: TrackerThread) -> dict[str, Any]:
    gguf = write_tiny_model(work / "models" / f"{MODEL}.gguf")
    equal = fake_llama_wrapper(work / "bin-equal", FIRST_TOKEN_S)
    results: dict[str, Any] = {}
    serve = lambda wrapper: ["--gguf", str(gguf), "--llama-server", str(wrapper), "--parallel", str(SLOTS)]  # noqa: E731
    if args.scenario in ("all", "shares", "newcomer"):
        with nodes_running(tracker, work, {n: serve(equal) for n in ("a", "b", "c")}) as started:
            names = wait_routable(tracker, started)
            if args.scenario in ("all", "shares"):
                print("three equal nodes, sequential requests", file=sys.stderr)
                results["shares"] = rounds_of(tracker, list(RULES), args.rounds, args.requests, names)
            if args.scenario in ("all", "newcomer"):
                started["c"].close()  # two equal nodes under load; the newcomer is the third
                wait_gone(tracker, names["c"])
                print("a new equal node joins a busy network", file=sys.stderr)
                results["newcomer"] = [newcomer_round(tracker, work, rule, args.clients, equal, gguf) for rule in ("fair", "strict")]
    if args.scenario in ("all", "unequal"):
        slow = fake_llama_wrapper(work / "bin-slow", FIRST_TOKEN_S * args.slow_factor)
        with nodes_running(tracker, work, {"fast": serve(equal), "slow": serve(slow)}) as started:
            names = wait_routable(tracker, started)
            print(f"a fast and a slow node ({args.slow_factor}x its first-token delay), sequential requests", file=sys.stderr)
            results["unequal"] = rounds_of(tracker, ["strict", "fair"], args.rounds, args.requests, names)
    return results


def wait_gone(tracker: TrackerThread, node_id: str) -> None:
    tracker.tracker.registry.remove(node_id)  # deregistered at its stop; gone from the pick at once either way


def scenario_claims(args: argparse.Namespace, work: Path, tracker: TrackerThread) -> dict[str, Any]:
    """One real node on the model: what it claims, and what the tracker measures of its first streams."""
    model = Path(args.model).resolve()
    serve = ["--gguf", str(model), "--parallel", str(args.parallel), "--ctx-size", str(CLAIMS_CTX_PER_SLOT * args.parallel)]
    if args.llama_server:
        serve += ["--llama-server", args.llama_server]
    if args.n_gpu_layers is not None:
        serve += ["--n-gpu-layers", args.n_gpu_layers]
    with nodes_running(tracker, work, {"node": serve}) as started:
        node_id = wait_routable(tracker, started, timeout=600)["node"]
        entry = tracker.tracker.registry.get(node_id)
        assert entry is not None
        model_name = entry.announcement.model_id
        rng = random.Random(1)
        ttfts, ceilings = [], []
        with httpx.Client(timeout=300) as http:
            for n in range(args.requests):
                words = rng.choice(CLAIMS_PROMPT_WORDS)
                body = {"model": model_name, "messages": [{"role": "user", "content": f"{n}" + " the" * words}],
                        "max_tokens": 64, "stream": True, "ignore_eos": True}  # fmt: skip
                ceilings.append(prompt_ceiling(body))
                started_at = time.perf_counter()
                with http.stream("POST", tracker.url + "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200, response.read()
                    first = None
                    for chunk in response.iter_raw():
                        if first is None and b'"content":"' in chunk:
                            first = time.perf_counter() - started_at
                ttfts.append(first or float("nan"))
        time.sleep(0.5)
        speed = httpx.get(tracker.url + "/v1/nodes", timeout=5).json()[0]["speed"]
        health = httpx.get(started["node"].url + "/health", timeout=5).json()
    ratio = lambda a, b: round(a / b, 3) if a and b else None  # noqa: E731
    return {
        "model": str(model),
        "hardware": health.get("hardware"),
        "capability": health.get("capability"),
        "speed": speed,
        "claimed_over_measured": {
            "prefill": ratio(speed["claimed_prefill_tokens_per_s"], speed["measured_prefill_tokens_per_s"]),
            "decode": ratio(speed["claimed_decode_tokens_per_s"], speed["measured_decode_tokens_per_s"]),
        },
        "prefill_at_each_size": claim_at_each_size(health.get("capability"), ceilings, ttfts),
        "client_ttft_p50_ms": pct(ttfts, 0.5),
    }


def claim_at_each_size(capability: dict[str, Any] | None, ceilings: list[int], ttfts: list[float]) -> dict[str, Any] | None:
    """Each request's prefill as claimed at its own prompt size (the claim's points interpolated, as the tracker reads a
    claim for a prompt) beside what the client measured of it (its prompt ceiling over its TTFT): the summary's one
    figure sets the claim at the smallest size against the tracker's average over every size, which a fixed cost in
    the TTFT (a GPU's: milliseconds whatever the prompt) moves by the sizes' ratio."""
    if not capability or not capability.get("prefill_tokens_per_s"):
        return None
    points = [RatePoint(**p) for p in capability["prefill_tokens_per_s"]]
    rows = []
    for ceiling, ttft in zip(ceilings, ttfts):
        claimed = rate_at(points, ceiling)
        if claimed and math.isfinite(ttft) and ttft > 0:  # NaN: no content came
            rows.append({"ceiling": ceiling, "claimed": round(claimed), "measured": round(ceiling / ttft), "claimed_over_measured": round(claimed * ttft / ceiling, 3)})  # fmt: skip
    ratios = sorted(r["claimed_over_measured"] for r in rows)
    later = sorted(r["claimed_over_measured"] for r in rows[1:])  # the first stream of a size can be cold
    return {
        "median_claimed_over_measured": statistics.median(ratios) if ratios else None,
        "range": [ratios[0], ratios[-1]] if ratios else None,
        "within_30_percent": sum(1 / 1.3 <= r <= 1.3 for r in ratios),
        "median_after_the_first": statistics.median(later) if later else None,
        "requests": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", nargs="?", default="all", choices=["all", "shares", "unequal", "newcomer", "claims"])
    parser.add_argument("--rounds", type=int, default=2, help="rounds per rule, alternated (default 2)")
    parser.add_argument("--requests", type=int, default=60, help="counted requests a round (claims: requests in all; default 60)")
    parser.add_argument("--clients", type=int, default=2, help="newcomer: closed-loop clients on the network (default 2)")
    parser.add_argument("--slow-factor", type=float, default=5.0, help="unequal: the slow node's first-token delay over the fast one's")
    parser.add_argument("--model", help="claims: the GGUF the real node serves")
    parser.add_argument("--llama-server", help="claims: the llama-server binary (default: as the node finds it)")
    parser.add_argument("--n-gpu-layers", help="claims: passed to serve (0: the CPU)")
    parser.add_argument("--parallel", type=int, default=SLOTS, help="claims: the node's slots")
    parser.add_argument("--keep", action="store_true", help="keep the logs and state folder")
    args = parser.parse_args()
    if args.scenario == "claims" and not args.model:
        parser.error("claims needs --model PATH.gguf")
    work = Path(tempfile.mkdtemp(prefix="bench-fair-market-"))
    tracker = TrackerThread(work / "tracker")
    try:
        results = scenario_claims(args, work, tracker) if args.scenario == "claims" else scenario_fake(args, work, tracker)
        print(json.dumps(results, indent=1))
    finally:
        tracker.close()
        if args.keep:
            print(f"logs and state kept in {work}", file=sys.stderr)
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
