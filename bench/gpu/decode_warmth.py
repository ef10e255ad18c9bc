#!/usr/bin/env python3
"""Does a fresh llama-server's decode rate depend on the stream's length, or on how many streams came before it?

    PYTHONPATH=src python3 bench/gpu/decode_warmth.py --llama-server BIN --model M.gguf [--device CUDA0|Vulkan0|none] [--pause-s 2]

The speed probe timed 16-token streams right after the warm-up, and an H100 node (Vulkan) claimed half the
decode rate it then delivered to 64-token streams (bench/RESULTS.md, "A fair market"). This starts one
llama-server as the node would (every layer offloaded, flash attention, 2 slots) and sends one streamed
request at a time, in a set order of answer lengths, then the same order again after a pause: each line is
llama-server's own `predicted_per_second` for that stream. A rate that climbs with the stream's rank at one
length is warm-up (kernels, clocks); one that climbs with the length at any rank is the stream's own
start-up cost. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import httpx

from meshnet_gguf.common.ports import free_local_port

ORDER = (16, 16, 16, 64, 16, 256, 64, 16, 256, 16, 64)
PROMPT_WORDS = 40
READY_TIMEOUT_S = 300.0


def stream_rate(http: httpx.Client, url: str, tokens: int, n: int) -> dict[str, float | int | None]:
    body = {"messages": [{"role": "user", "content": f"{n}" + " the" * PROMPT_WORDS}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "cache_prompt": False, "ignore_eos": True}  # fmt: skip
    timings = None
    started = time.perf_counter()
    with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if '"timings"' in line:
                timings = json.loads(line.partition("data:")[2]).get("timings")
    wall = time.perf_counter() - started
    return {"tokens": tokens, "decode": round(timings["predicted_per_second"], 1) if timings else None,
            "prefill": round(timings["prompt_per_second"], 1) if timings else None, "wall_ms": round(wall * 1000, 1)}  # fmt: skip


def with_retry(http: httpx.Client, url: str, tokens: int, n: int) -> dict[str, float | int | None]:
    try:
        return stream_rate(http, url, tokens, n)
    except httpx.TransportError as exc:  # once seen just after /health said ok: a dropped first connection
        print(f"stream {n} failed ({exc!r}); once more", file=sys.stderr)
        return stream_rate(http, url, tokens, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default=None, help="llama-server's --device (default: its own choice)")
    parser.add_argument("--log", help="llama-server's log to this file")
    parser.add_argument("--pause-s", type=float, default=2.0, help="idle between the two passes (clocks fall when idle)")
    args = parser.parse_args()
    port = free_local_port()
    argv = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-ngl", "99", "-fa", "on",
            "--parallel", "2", "--ctx-size", "8192", "--no-webui"]  # fmt: skip
    if args.device:
        argv += ["--device", args.device]
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(args.log, "w") if args.log else subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=120) as http:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                try:
                    if http.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or child.poll() is not None:
                    sys.exit(f"llama-server not ready (exit {child.poll()})")
                time.sleep(0.2)
            passes = []
            for p in range(2):
                if p:
                    time.sleep(args.pause_s)
                passes.append([with_retry(http, url, tokens, 100 * p + n) for n, tokens in enumerate(ORDER)])
    finally:
        child.terminate()
        child.wait(30)
    print(json.dumps({"argv": argv[1:], "passes": passes}, indent=1))
    for p, rows in enumerate(passes):
        print(f"pass {p}: " + "  ".join(f"{r['tokens']}:{r['decode']}" for r in rows), file=sys.stderr)


if __name__ == "__main__":
    main()
