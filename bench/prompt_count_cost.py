#!/usr/bin/env python3
"""What counting the prompt before generation costs: the node's front with and without its
`/apply-template` + `/tokenize` calls, interleaved, against the real llama-server on a tiny model.

    .venv/bin/python bench/prompt_count_cost.py --requests 300

Prints the median and p90 request time (non-streamed chat, 1 output token; streamed completion,
time to first token) for each variant. Everything listens on 127.0.0.1 and is stopped by PID.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import anyio.from_thread
import httpx

from meshnet_gguf.llama.binary import find_llama_server
from meshnet_gguf.models.tiny_model import write_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.billing_harness import LlamaChild, serve_front  # noqa: E402

CHAT = {
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, how are you?" * 4}],
    "max_tokens": 1,
}
COMPLETION = {"prompt": "Hello there, how are you?" * 4, "max_tokens": 2, "stream": True}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    model = write_tiny_model(Path(tempfile.mkdtemp(prefix="meshnet-count-")) / "tiny.gguf")
    child = LlamaChild(find_llama_server(None, env={}), model, slots=2)
    times: dict[str, list[float]] = {}
    try:
        with anyio.from_thread.start_blocking_portal() as portal, portal.wrap_async_context_manager(serve_front(child.url)) as front:
            counter = front.app._counter._count_prompt

            async def no_count(*_: object) -> int:
                return 0

            with httpx.Client(base_url=front.url, timeout=30) as client:
                for i in range(args.requests * 2):
                    counting = i % 2 == 0
                    front.app._counter._count_prompt = counter if counting else no_count  # type: ignore[method-assign]
                    label = "with count" if counting else "without"
                    started = time.perf_counter()
                    client.post("/v1/chat/completions", json=CHAT).raise_for_status()
                    times.setdefault(f"chat, whole answer, {label}", []).append(time.perf_counter() - started)
                    started = time.perf_counter()
                    with client.stream("POST", "/v1/completions", json=COMPLETION) as response:
                        for chunk in response.iter_bytes():
                            if b'"text":"' in chunk:
                                break
                    times.setdefault(f"completion stream TTFT, {label}", []).append(time.perf_counter() - started)
    finally:
        child.close()
    for name, values in sorted(times.items()):
        values.sort()
        print(
            f"{name}: p50 {statistics.median(values) * 1000:.2f} ms, p90 {values[int(len(values) * 0.9)] * 1000:.2f} ms (n={len(values)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
