#!/usr/bin/env python3
"""What a meshed node's first token cannot go below on this machine: each step that must stand
before llama-server sees a routed request, measured alone (a diagnostic for issue 19's target).

    PYTHONPATH=src python bench/mesh_floor.py [--dir DIR] [--calls N] [--json OUT]

DIR is where the node's ledger would live (its filesystem is what the synced row pays for;
default: a fresh folder under the node's state directory). The steps:

- the route token check (`RouteVerifier.check_token`), and the Ed25519 verification inside it,
  with OpenSSL (`cryptography`) and with libsodium (PyNaCl, what the node uses);
- the body's hash against the route's (short chat and a ~1,500-token one);
- the ledger row the node writes before forwarding (`UsageLedger.open_request_sync`, WAL,
  synchronous=FULL), called directly, handed to the ledger's writer thread from an event loop, and
  as the node writes it (`open_request`: on the loop itself while such writes are quick);
- the same row unsynced (synchronous=NORMAL: what the durability costs);
- the disk alone: a 4 KiB `pwrite` + `fdatasync` into a preallocated file, the same with
  `O_DSYNC`, and an append + `fsync` that grows the file (what a journal of any design pays);
- after an idle gap (`--gap-ms`, default 15: a request's pause before the next, as in the
  mesh-path bench, where each routed request follows a ~13-15 ms one): the disk's sync and the
  node's row, the sync again with the CPU kept busy through the gap (a slower sync then is the
  disk's own wake-up, not the CPU's), and the route check with the row one after the other (what
  the node does) against the check on a thread beside the row (an overlap, measured, not built),
  and the check, hash and row of an ~8,000-token body (what of it grows with the prompt).

Back to back, each step finds everything warm; a routed request in the flow finds what an idle
machine left it, and the figures after a gap are the ones to hold its first token against.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.common.serial_worker import SerialWorker
from meshnet_gguf.common.settings import default_state_dir
from meshnet_gguf.common.sqlite_wal import CHECKPOINT_EVERY_CALLS
from meshnet_gguf.contract.protocol import ROUTE_HEADER, UsageRecord
from meshnet_gguf.contract.signing import HotVerifyKey, body_sha256, encode_token, tracker_issuer_for
from meshnet_gguf.mesh.ledger import UsageLedger
from meshnet_gguf.mesh.route_auth import RouteVerifier

NODE, MODEL, LAYERS, PATH = "node-floor", "floor-model", 22, "/v1/chat/completions"
SHORT_BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "stream": True}).encode()
# About 1,500 tokens of English, as the mesh-path bench's long prompt.
LONG_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 160}], "stream": True}
).encode()
# About 8,000 tokens: the longest prompt the meshed target must stay flat up to.
LONGEST_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 850}], "stream": True}
).encode()
BLOCK = 4096
T = TypeVar("T")
WARMUP_CALLS = 20
GAP_MS = 15.0
GAP_CALLS = 200
GAP_FLOWS = {
    "check": "route token check (whole)",
    "row": "ledger row as the node writes it",
    "serial": "route check, then the row (what the node does)",
    "overlap": "route check on a thread beside the row (not built)",
    "longest": "route check, ~8,000-token body's hash, then its row",
}


def timed(fn: Callable[[], object], calls: int) -> dict[str, float]:
    for _ in range(min(WARMUP_CALLS, calls)):
        fn()
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    return summary(samples)


def summary(samples_us: list[float]) -> dict[str, float]:
    samples_us.sort()
    return {
        "p50_us": statistics.median(samples_us),
        "p90_us": samples_us[int(len(samples_us) * 0.9)],
        "p99_us": samples_us[min(len(samples_us) - 1, int(len(samples_us) * 0.99))],
        "calls": len(samples_us),
    }


def route_steps(calls: int) -> dict[str, dict[str, float]]:
    key = Ed25519PrivateKey.generate()
    verifier = RouteVerifier(key.public_key(), node_id=NODE, model_id=MODEL, total_layers=LAYERS)
    now = int(time.time())
    claims: dict[str, Any] = {
        "iss": tracker_issuer_for(key.public_key()), "sub": NODE, "jti": "req-floor", "iat": now, "exp": now + 60,
        "path": PATH, "model": MODEL, "hops": [{"node_id": NODE, "first_layer": 0, "last_layer": LAYERS - 1}],
        "body_sha256": body_sha256(SHORT_BODY), "max_tokens": 512,
    }  # fmt: skip
    token = encode_token(claims, key)
    headers = {ROUTE_HEADER.lower(): token}
    signing_input, _, _ = token.encode().rpartition(b".")
    signature = key.sign(signing_input)
    public = key.public_key()
    hot = HotVerifyKey(public)
    long_sha = body_sha256(LONG_BODY)
    longest_sha = body_sha256(LONGEST_BODY)
    return {
        "ed25519 verify, OpenSSL (cryptography)": timed(lambda: public.verify(signature, signing_input), calls),
        "ed25519 verify, libsodium (PyNaCl; what the route gate uses)": timed(lambda: hot.verify(signature, signing_input), calls),
        "route token check (whole)": timed(lambda: verifier.check_token(headers, PATH), calls),
        "body hash check, short chat": timed(lambda: RouteVerifier.check_body(claims["body_sha256"], SHORT_BODY), calls),
        "body hash check, ~1,500 tokens": timed(lambda: RouteVerifier.check_body(long_sha, LONG_BODY), calls),
        "body hash check, ~8,000 tokens": timed(lambda: RouteVerifier.check_body(longest_sha, LONGEST_BODY), calls),
    }


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """On uvloop when it is installed, as uvicorn runs the node."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def ledger_steps(folder: Path, calls: int) -> dict[str, dict[str, float]]:
    ledger = UsageLedger(folder / "floor.sqlite3")
    serial = iter(range(10**9))

    def record() -> UsageRecord:
        return UsageRecord(
            request_id=f"req-{next(serial)}", route=PATH, model=MODEL, status=0, stream=True, prompt_tokens=0,
            cached_tokens=0, completion_tokens=0, finish_reason="unknown", started_at=time.time(), duration_s=0.0,
        )  # fmt: skip

    expires = time.time() + 60
    results = {
        "ledger row, synced, short body": timed(lambda: ledger.open_request_sync(record(), expires, SHORT_BODY), calls),
        "ledger row, synced, ~1,500-token body": timed(lambda: ledger.open_request_sync(record(), expires, LONG_BODY), calls),
        "ledger row, synced, ~8,000-token body": timed(lambda: ledger.open_request_sync(record(), expires, LONGEST_BODY), calls),
    }

    async def from_the_loop(through_the_thread: bool) -> dict[str, float]:
        samples = []
        for i in range(calls + WARMUP_CALLS):
            rec = record()
            t = time.perf_counter()
            if through_the_thread:
                await ledger._store.worker.run(ledger.open_request_sync, rec, expires, SHORT_BODY)
            else:
                await ledger.open_request(rec, expires, SHORT_BODY)
            if i >= WARMUP_CALLS:
                samples.append((time.perf_counter() - t) * 1e6)
        return summary(samples)

    async def hand_off_only() -> dict[str, float]:
        samples = []
        for i in range(calls + WARMUP_CALLS):
            t = time.perf_counter()
            await ledger._store.worker.run(int)  # the writer thread's hop with no work in it
            if i >= WARMUP_CALLS:
                samples.append((time.perf_counter() - t) * 1e6)
        return summary(samples)

    results["ledger row, synced, handed to the writer thread (event loop)"] = run_loop(from_the_loop(True))
    results["ledger row, synced, as the node writes it (on the loop when quick)"] = run_loop(from_the_loop(False))
    results["writer thread hop alone (event loop)"] = run_loop(hand_off_only())
    ledger._store.db.execute("PRAGMA synchronous=NORMAL")
    results["ledger row, NOT synced (what durability costs: the difference)"] = timed(
        lambda: ledger.open_request_sync(record(), expires, SHORT_BODY), calls
    )
    ledger.close()
    return results


def disk_steps(folder: Path, calls: int) -> dict[str, dict[str, float]]:
    block = os.urandom(BLOCK)
    slots = calls + WARMUP_CALLS
    results: dict[str, dict[str, float]] = {}

    prealloc = folder / "prealloc.bin"
    fd = os.open(prealloc, os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"\0" * BLOCK * slots)
    os.fsync(fd)
    offsets = iter(range(0, BLOCK * slots * 4, BLOCK))
    results["4 KiB pwrite + fdatasync, preallocated"] = timed(
        lambda: (os.pwrite(fd, block, next(offsets) % (BLOCK * slots)), os.fdatasync(fd)), calls
    )
    os.close(fd)

    fd = os.open(prealloc, os.O_RDWR | os.O_DSYNC)
    offsets = iter(range(0, BLOCK * slots * 4, BLOCK))
    results["4 KiB pwrite with O_DSYNC, preallocated"] = timed(lambda: os.pwrite(fd, block, next(offsets) % (BLOCK * slots)), calls)
    os.close(fd)

    fd = os.open(folder / "append.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    results["4 KiB append + fsync (the file grows)"] = timed(lambda: (os.write(fd, block), os.fsync(fd)), calls)
    os.close(fd)
    return results


def after_gap_steps(folder: Path, calls: int, gap_s: float) -> dict[str, dict[str, float]]:
    """Each step once per idle gap: sleeping through it (the CPU idles too) unless said otherwise."""
    label = f"after a {gap_s * 1000:.0f} ms idle gap"
    block = os.urandom(BLOCK)
    fd = os.open(folder / "gap.bin", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"\0" * BLOCK * 16)
    os.fsync(fd)

    def disk_after_gap(spin: bool) -> dict[str, float]:
        samples = []
        for i in range(calls + WARMUP_CALLS):
            if spin:
                until = time.perf_counter() + gap_s
                while time.perf_counter() < until:
                    pass
            else:
                time.sleep(gap_s)
            t = time.perf_counter()
            os.pwrite(fd, block, BLOCK * (i % 16))
            os.fdatasync(fd)
            if i >= WARMUP_CALLS:
                samples.append((time.perf_counter() - t) * 1e6)
        return summary(samples)

    results = {
        f"4 KiB pwrite + fdatasync, {label}": disk_after_gap(spin=False),
        f"4 KiB pwrite + fdatasync, {label} with the CPU kept busy": disk_after_gap(spin=True),
    }
    os.close(fd)

    ledger = UsageLedger(folder / "gap.sqlite3")
    key = Ed25519PrivateKey.generate()
    verifier = RouteVerifier(key.public_key(), node_id=NODE, model_id=MODEL, total_layers=LAYERS)
    check_thread = SerialWorker("route-check")
    serial = iter(range(10**9))
    longest_sha = body_sha256(LONGEST_BODY)

    def record() -> UsageRecord:
        return UsageRecord(request_id=f"gap-{next(serial)}", route=PATH, model=MODEL, status=0, stream=True, started_at=time.time())

    async def flows() -> dict[str, list[float]]:
        # The four take turns, call by call, so whatever the machine drifts through hits each alike.
        samples: dict[str, list[float]] = {how: [] for how in GAP_FLOWS}
        started = time.time()
        for i in range(calls + WARMUP_CALLS):
            if i == 0 or time.time() - started > 30:  # a route lives at most 60 s
                started = time.time()
                now = int(started)
                headers = {ROUTE_HEADER.lower(): encode_token({
                    "iss": tracker_issuer_for(key.public_key()), "sub": NODE, "jti": "req-gap", "iat": now, "exp": now + 60,
                    "path": PATH, "model": MODEL, "hops": [{"node_id": NODE, "first_layer": 0, "last_layer": LAYERS - 1}],
                    "body_sha256": body_sha256(SHORT_BODY),
                }, key)}  # fmt: skip
            for how in GAP_FLOWS:
                await asyncio.sleep(gap_s)
                rec = record()
                t = time.perf_counter()
                if how == "check":
                    verifier.check_token(headers, PATH)
                elif how == "row":
                    await ledger.open_request(rec, now + 60, SHORT_BODY)
                elif how == "serial":
                    verifier.check_token(headers, PATH)
                    await ledger.open_request(rec, now + 60, SHORT_BODY)
                elif how == "longest":  # what grows with the prompt: the hash, and the body kept in the row
                    verifier.check_token(headers, PATH)
                    RouteVerifier.check_body(longest_sha, LONGEST_BODY)
                    await ledger.open_request(rec, now + 60, LONGEST_BODY)
                else:
                    checked = asyncio.ensure_future(check_thread.run(verifier.check_token, headers, PATH))
                    await ledger.open_request(rec, now + 60, SHORT_BODY)
                    await checked
                if i >= WARMUP_CALLS:
                    samples[how].append((time.perf_counter() - t) * 1e6)
        return samples

    async def fill_the_log() -> None:
        # The node's log in its steady state: grown to its full size once and restarted by a
        # checkpoint, so each commit overwrites it rather than growing the file (a costlier sync).
        for _ in range(2 * CHECKPOINT_EVERY_CALLS + 1):
            await ledger.open_request(record(), time.time() + 60, SHORT_BODY)
        await ledger._store.checkpoints.settle()

    run_loop(fill_the_log())
    for how, samples in run_loop(flows()).items():
        results[f"{GAP_FLOWS[how]}, {label}"] = summary(samples)
    check_thread.stop()
    ledger.close()
    return results


def filesystem_of(folder: Path) -> str:
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            parts = line.split()
            if len(parts) > 2 and str(folder).startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], f"{parts[2]} (on {parts[0]})"
    return kind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="where the ledger would live (default: under the node's state dir)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--gap-ms", type=float, default=GAP_MS, help="the idle gap before each call of the last steps")
    parser.add_argument("--gap-calls", type=int, default=GAP_CALLS, help="calls of each step after a gap")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    base = args.dir or default_state_dir()
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mesh-floor-", dir=base) as tmp:
        folder = Path(tmp)
        results = {
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "filesystem": filesystem_of(folder.resolve()),
            "steps": {
                **route_steps(args.calls),
                **ledger_steps(folder, args.calls),
                **disk_steps(folder, args.calls),
                **after_gap_steps(folder, args.gap_calls, args.gap_ms / 1000),
            },  # fmt: skip
        }
    print(f"{results['machine']}; ledger filesystem: {results['filesystem']}")
    print(f"{'step':<96} {'p50 µs':>9} {'p90 µs':>9} {'p99 µs':>9}")
    for name, s in results["steps"].items():
        print(f"{name:<96} {s['p50_us']:>9.1f} {s['p90_us']:>9.1f} {s['p99_us']:>9.1f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
