#!/usr/bin/env python3
"""A meshed node's steps before it forwards a routed request, each timed alone (no sockets, no ledger):
the route token's check (signature, claims), the body's hash against the signed one, the route's
claim in the replay cache, and the usage record the ledger row is built from; then the token check's
own parts by cProfile (what of it is libsodium's signature check, the floor).

    PYTHONPATH=src python bench/route_gate_steps.py [--requests N]

What the whole path costs, these steps included, is `request_cost.py`'s "before forwarding".
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.contract.protocol import ROUTE_HEADER
from meshnet_gguf.contract.signing import body_sha256, encode_token, tracker_issuer_for
from meshnet_gguf.mesh.meshed_mode import RouteGate
from meshnet_gguf.serving.meter import RequestMeter

PATH = "/v1/chat/completions"
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 32}).encode()


def route_token(key: Ed25519PrivateKey, i: int, now: int) -> str:
    claims = {
        "iss": tracker_issuer_for(key.public_key()), "sub": "node-1", "jti": f"req-{i}", "iat": now, "exp": now + 55,
        "path": PATH, "model": "m", "hops": [{"node_id": "node-1", "first_layer": 0, "last_layer": 1}],
        "body_sha256": body_sha256(BODY), "max_tokens": 32,
    }  # fmt: skip
    return encode_token(claims, key)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    key = Ed25519PrivateKey.generate()
    gate = RouteGate("node-1", "m", 2, key.public_key())
    now = int(time.time())
    tokens = [route_token(key, i, now) for i in range(args.requests)]
    steps: dict[str, list[float]] = {"route token check": [], "body hash": [], "claim": [], "usage record": []}
    for token in tokens:
        t0 = time.perf_counter()
        grant = gate.check_token({ROUTE_HEADER.lower(): token}, PATH)
        t1 = time.perf_counter()
        gate.check_body(grant, BODY)
        t2 = time.perf_counter()
        gate.claim(grant)
        t3 = time.perf_counter()
        meter = RequestMeter(request_id=grant.request_id or "", path=PATH, stream=True, started_at=time.time(), started=t3)
        t4 = time.perf_counter()
        meter.usage_record("m")
        t5 = time.perf_counter()
        for name, took in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t5 - t4), strict=True):
            steps[name].append(took)
    for name, took in steps.items():
        print(f"{name:<18} p50 {statistics.median(took) * 1e6:7.1f} µs")
    verifier = gate._ready_verifier()  # the token check's parts, profiled
    profile = cProfile.Profile()
    profile.enable()
    for token in tokens:
        verifier._decode(token)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(6)


if __name__ == "__main__":
    main()
