#!/usr/bin/env python3
"""Soak the relay path against restarts: kill the relay mid-stream, start it again, many times.

    .venv/bin/python bench/soak_relay_restarts.py --rounds 200

Starts `dev tracker`, `dev relay` and a node behind the relay (tiny generated F16 model, the
real llama-server), all on loopback. Each round streams a long answer through the tracker with
the official `openai` SDK, SIGKILLs the relay after a few chunks (a different count each round),
starts a relay on the same port, and times how long until a request goes through again. Exits 1
at the first round whose stream did not break off, or whose node was not back within
BACK_WITHIN_S; prints the slowest return otherwise.

Found with it: the node's pool of idle work connections could re-dial into a control session that
was already ending, so fast that the session never ended and the node never reconnected (1 round in
about 30 on a loaded 2-core machine). Run it with the machine loaded (other tests, a build) to find
races like that one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_mesh_path import ENROLMENT_SECRET, Service, wait_routable  # noqa: E402
from bench_proxy import Node  # noqa: E402

from meshnet_gguf.contract.protocol import WELL_KNOWN_PATH  # noqa: E402
from meshnet_gguf.models.tiny_model import write_tiny_model  # noqa: E402

BACK_WITHIN_S = 5.0
RETRY_EVERY_S = 0.1
REQUEST_TIMEOUT_S = 5.0
# 4,096 tokens a slot: the stream is still generating when the relay dies.
NODE_ARGS = ["--parallel", "2", "--ctx-size", "8192"]
MESSAGES = [{"role": "user", "content": "Say hello."}]
EXACT = {"extra_body": {"ignore_eos": True}}


def one_round(client: openai.OpenAI, quick: openai.OpenAI, model: str, relay: Service, cut_at: int) -> float:
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4000, stream=True, **EXACT)  # type: ignore[call-overload]
    seen = 0
    try:
        for _chunk in stream:
            seen += 1
            if seen == cut_at:
                os.kill(relay.proc.pid, signal.SIGKILL)
                relay.proc.wait(10)
        raise RuntimeError(f"the stream did not break off ({seen} chunks)")
    except openai.APIError:
        pass
    relay.restart()
    restarted = time.monotonic()
    while True:
        try:
            quick.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **EXACT)  # type: ignore[call-overload]
            return time.monotonic() - restarted
        except openai.APIError:
            if time.monotonic() - restarted > BACK_WITHIN_S:
                raise RuntimeError(f"the node was not back through the relay within {BACK_WITHIN_S} s") from None
            time.sleep(RETRY_EVERY_S)


async def amain(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="meshnet-relay-soak-"))
    model = write_tiny_model(work / "tiny.gguf")
    tracker = Service(work, "tracker", ["--state-dir", str(work / "tracker"), "--heartbeat-interval", "1",
                                        "--health-poll-interval", "1"], {"MESHNET_TRACKER_ENROLMENT_SECRET": ENROLMENT_SECRET})  # fmt: skip
    key = httpx.get(tracker.url + WELL_KNOWN_PATH, timeout=5, trust_env=False).json()["public_key"]
    relay = Service(work, "relay", ["--trust-tracker-key", key], {})
    node = Node("relay-soak", ["--gguf", str(model), *NODE_ARGS, "--tracker", tracker.url, "--tracker-public-key", key,
                               "--relay", relay.url], {"MESHNET_ENROLMENT_SECRET": ENROLMENT_SECRET})  # fmt: skip
    returns: list[float] = []
    try:
        await node.wait_ready()
        wait_routable(tracker, {model.stem})
        client = openai.OpenAI(base_url=tracker.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        quick = openai.OpenAI(base_url=tracker.url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        for n in range(args.rounds):
            try:
                returns.append(one_round(client, quick, model.stem, relay, cut_at=3 + n % 7))
            except RuntimeError as exc:
                print(f"round {n}: {exc}\n--- node log\n{node.log_tail()}\n--- relay log\n{relay.log_path.read_text()[-3000:]}")
                return 1
            if (n + 1) % 10 == 0:
                print(f"{n + 1} rounds, slowest return {max(returns):.2f} s", flush=True)
    finally:
        node.close()
        relay.close()
        tracker.close()
    print(f"{len(returns)} rounds: back through the relay in median {statistics.median(returns):.2f} s, slowest {max(returns):.2f} s")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    sys.exit(asyncio.run(amain(parser.parse_args())))


if __name__ == "__main__":
    main()
