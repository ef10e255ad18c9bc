#!/usr/bin/env python3
"""What the tracker's choice of a node costs it per request: `registry.serves` then `registry.pick`, on the registry
alone (no HTTP), with nodes of one model each and with nodes of several models.

    .venv/bin/python bench/bench_tracker_pick.py                 # 10 nodes, best of 3 rounds of 20,000 picks
    .venv/bin/python bench/bench_tracker_pick.py --nodes 50 --rounds 5

Each node is online, healthy, claims the same speed and has 4 slots; "several models" gives every node the
same first model and three more (one loaded, two loadable), and picks one of the loadable ones, so the cold
load is counted (the other models have no speed figure yet: a node's claim is its first model's, so they rank by
cold load and load alone, the cheaper path). Prints microseconds per request (serves + pick), the best round.
"""

from __future__ import annotations

import argparse
import time
from ipaddress import ip_address

from meshnet_gguf.contract.protocol import AnnouncedModel, NodeAnnouncement, NodeCapability, RatePoint
from meshnet_gguf.reference.tracker.node_address import NodeTarget
from meshnet_gguf.reference.tracker.registry import NodeRegistry

FIRST_PORT = 1000
CLAIM = NodeCapability(
    prefill_tokens_per_s=[RatePoint(ctx_tokens=256, tokens_per_s=1000)], decode_tokens_per_s=[RatePoint(ctx_tokens=256, tokens_per_s=50)]
)
SEVERAL = [
    AnnouncedModel(model_id="demo:Q4_K_M", aliases=["demo", "demo.gguf"]),
    AnnouncedModel(model_id="tiny", state="loaded"),
    AnnouncedModel(model_id="small", state="loadable", expected_load_s=0.5),
    AnnouncedModel(model_id="mid", state="loadable", expected_load_s=2.0),
]


def registry_of(nodes: int, several: bool) -> NodeRegistry:
    registry = NodeRegistry(ttl_s=1e9)
    for i in range(nodes):
        port = FIRST_PORT + i
        announcement = NodeAnnouncement(
            node_id=f"n{i}", public_key="k", advertised_url=f"http://127.0.0.1:{port}", model_id="demo:Q4_K_M",
            model_aliases=["demo", "demo.gguf"], first_layer=0, last_layer=1, total_layers=2, slots=4, node_version="bench",
            state="online", capability=CLAIM, models=SEVERAL if several else [],
        )  # fmt: skip
        target = NodeTarget(url=announcement.advertised_url, scheme="http", host="127.0.0.1", port=port, base_path="",
                            address=ip_address("127.0.0.1"))  # fmt: skip
        entry, _ = registry.register(announcement, target)
        entry.healthy = True
    return registry


def per_request_us(registry: NodeRegistry, model: str, picks: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(picks):
            registry.serves(model)
            registry.pick(model)
        best = min(best, (time.perf_counter() - started) / picks)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--picks", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    one = per_request_us(registry_of(args.nodes, several=False), "demo", args.picks, args.rounds)
    several = per_request_us(registry_of(args.nodes, several=True), "small", args.picks, args.rounds)
    print(f"{args.nodes} nodes, one model each:   {one:.1f} us a request (serves + pick)")
    print(f"{args.nodes} nodes, four models each: {several:.1f} us a request (a loadable model, its cold load counted)")


if __name__ == "__main__":
    main()
