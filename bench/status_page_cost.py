"""What the node's page costs a node: /status.json polled as the page polls it, beside /health.

Starts `serve` with the fake llama-server (no model work), fills the last-requests list,
then times N sequential GETs of each path from one keep-alive client and prints the
median and p95 latency and the body size. Run by hand:

    PYTHONPATH=src:tests python bench/status_page_cost.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from meshnet_gguf.models.tiny_model import write_tiny_model  # noqa: E402
from support.node_process import NodeProcess  # noqa: E402

ROUNDS = 500
FAKE_LLAMA = Path(__file__).resolve().parents[1] / "tests" / "support" / "fake_llama_server.py"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = write_tiny_model(work / "tiny.gguf")
        wrapper = work / "llama-server"
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_LLAMA}" "$@"\n')
        wrapper.chmod(0o755)
        node = NodeProcess(["--gguf", str(model), "--llama-server", str(wrapper)], workdir=work)
        try:
            node.wait_ready()
            with httpx.Client(base_url=node.url, timeout=10) as client:
                for _ in range(20):  # a full last-requests list
                    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
                for path in ("/health", "/status.json"):
                    times = []
                    for _ in range(ROUNDS):
                        start = time.perf_counter()
                        body = client.get(path).content
                        times.append(time.perf_counter() - start)
                    times.sort()
                    print(
                        f"{path:13} median {statistics.median(times) * 1000:.2f} ms  "
                        f"p95 {times[int(len(times) * 0.95)] * 1000:.2f} ms  body {len(body)} bytes"
                    )
        finally:
            node.close()


if __name__ == "__main__":
    main()
