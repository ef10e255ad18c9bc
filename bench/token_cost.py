#!/usr/bin/env python3
"""The node's CPU per request and per streamed token, over real sockets, split apart.

    PYTHONPATH=src python bench/token_cost.py [--rounds N] [--concurrency C] [--delay-ms D] [--json OUT]

A standalone node (`meshnet-gguf serve`, the production process) in front of the fake
llama-server (`tests/support/fake_llama_server.py` under uvloop), which writes every token as
its own socket write `--delay-ms` apart, as llama-server does while decoding. The node is
pinned to CPU 0, the stub and this client to the others. Rounds of C concurrent streams of
32 tokens alternate with rounds of 512-token streams; the node's CPU (user + system, psutil)
over each kind gives a line, CPU = a + b x tokens, and so:

- **per request** (a): admission, the upstream connection, the usage record and log line;
- **per token** (b): one read from llama-server, the meter, one chunked write to the client.

That split is what the issue's "CPU per 1,000 streamed tokens" mixes: a 32-token stream's
per-request share alone is a / 32 per token. What a meshed node adds per request is
`request_cost.py`'s (the route check and the ledger's rows, without sockets).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_proxy import CHAT_PATH, Conn, chat_body, pin, stub_node  # noqa: E402

SHORT_TOKENS, LONG_TOKENS = 32, 512


async def one_round(conns: list[Conn], tokens: int) -> int:
    streams = await asyncio.gather(*(c.request("POST", CHAT_PATH, chat_body(tokens)) for c in conns))
    bad = [s for s in streams if not s.ok or s.n_content != tokens]
    if bad:
        raise RuntimeError(f"a stream went wrong: status {bad[0].status}, {bad[0].n_content} tokens, {bad[0].error}")
    return sum(s.n_content for s in streams)


async def profile(pid: int, conns: list[Conn], out: Path, tokens: int) -> None:
    """py-spy's collapsed stacks of the node over streams of `tokens` tokens, to `out`."""
    spy = Path(sys.executable).with_name("py-spy")
    recorder = subprocess.Popen([str(spy), "record", "--pid", str(pid), "--format", "raw", "--rate", "500", "-o", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        await asyncio.sleep(1.0)  # py-spy attaches
        for _ in range(6 * LONG_TOKENS // tokens):
            await one_round(conns, tokens)
    finally:
        recorder.send_signal(2)  # SIGINT: py-spy writes what it has and exits
        recorder.wait(timeout=30)


async def measure(args: argparse.Namespace) -> dict[str, object]:
    env = {"FAKE_LLAMA_TOKENS": str(LONG_TOKENS), "FAKE_LLAMA_TOKEN_DELAY_S": str(args.delay_ms / 1000)}
    node = stub_node("token-cost", "raw", env)
    try:
        await node.wait_ready()
        others = set(range(1, os.cpu_count() or 2)) or {0}
        pin(node.proc.pid, {0})
        pin(node.llama.pid, others)  # type: ignore[union-attr]
        os.sched_setaffinity(0, others)
        conns = [Conn(node.port) for _ in range(args.concurrency)]
        for tokens in (SHORT_TOKENS, LONG_TOKENS):  # warm both
            await one_round(conns, tokens)
        if args.py_spy:
            await profile(node.proc.pid, conns, args.py_spy, args.py_spy_tokens)
        cpu = {SHORT_TOKENS: 0.0, LONG_TOKENS: 0.0}
        streamed = {SHORT_TOKENS: 0, LONG_TOKENS: 0}
        per_round: dict[int, list[float]] = {SHORT_TOKENS: [], LONG_TOKENS: []}
        for _ in range(args.rounds):
            for tokens in (SHORT_TOKENS, LONG_TOKENS):
                before = node.cpu_s()
                streamed[tokens] += await one_round(conns, tokens)
                spent = node.cpu_s() - before
                cpu[tokens] += spent
                per_round[tokens].append(spent / args.concurrency)
        requests = args.rounds * args.concurrency
        short, long = cpu[SHORT_TOKENS] / requests, cpu[LONG_TOKENS] / requests
        per_token = (long - short) / (LONG_TOKENS - SHORT_TOKENS)
        per_request = short - per_token * SHORT_TOKENS
        return {
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "concurrency": args.concurrency,
            "requests_each": requests,
            "token_delay_ms": args.delay_ms,
            "cpu_ms_per_request_short": short * 1e3,
            "cpu_ms_per_request_long": long * 1e3,
            "cpu_ms_per_1k_tokens_short": cpu[SHORT_TOKENS] * 1e6 / streamed[SHORT_TOKENS],
            "cpu_ms_per_1k_tokens_long": cpu[LONG_TOKENS] * 1e6 / streamed[LONG_TOKENS],
            "fit_ms_per_request": per_request * 1e3,
            "fit_us_per_token": per_token * 1e6,
            "spread_short_ms": [round(min(per_round[SHORT_TOKENS]) * 1e3, 2), round(statistics.median(per_round[SHORT_TOKENS]) * 1e3, 2)],
            "spread_long_ms": [round(min(per_round[LONG_TOKENS]) * 1e3, 2), round(statistics.median(per_round[LONG_TOKENS]) * 1e3, 2)],
        }
    finally:
        node.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--delay-ms", type=float, default=1.0, help="pause between the stub's token writes")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--py-spy", type=Path, metavar="OUT", help="also profile the node (py-spy's collapsed stacks)")
    parser.add_argument("--py-spy-tokens", type=int, default=LONG_TOKENS, help="tokens per stream while profiling")
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    print(
        f"{result['machine']}; c={args.concurrency}, {result['requests_each']} streams of {SHORT_TOKENS} and of {LONG_TOKENS} tokens\n"
        f"  node CPU per request: {result['cpu_ms_per_request_short']:.2f} ms ({SHORT_TOKENS} tokens), "
        f"{result['cpu_ms_per_request_long']:.2f} ms ({LONG_TOKENS})\n"
        f"  per 1,000 streamed tokens: {result['cpu_ms_per_1k_tokens_short']:.1f} ms ({SHORT_TOKENS}-token streams), "
        f"{result['cpu_ms_per_1k_tokens_long']:.1f} ms ({LONG_TOKENS})\n"
        f"  split: {result['fit_ms_per_request']:.3f} ms a request + {result['fit_us_per_token']:.1f} µs a token"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
