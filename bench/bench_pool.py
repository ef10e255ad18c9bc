#!/usr/bin/env python3
"""What a LAN pool costs per token: llama-server with its layers on ggml-rpc-server workers (loopback)
against the same model on one llama-server; decode and prefill at concurrency 1 and 4; greedy output
compared token by token; and, through a node, the first request after ready against steady ones.

    PYTHONPATH=src .venv/bin/python bench/bench_pool.py --model-spec 8,512,1408,8,4 --json /tmp/pool.json

Locally (CPU): two workers lending `CPU`; "single" is llama-server alone on the CPU. On a GPU box
(bench/gpu/run_pool.sh): one worker `-d Vulkan0 -c` and `--local-device Vulkan0`, so the pooled run
splits between the local GPU and the worker, and "single" is llama-server alone on Vulkan0.
The model is a random-weight llama of the shape given (`n_layers,n_embd,n_ff,n_head,n_head_kv`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from meshnet_gguf.common.ports import free_local_port, free_local_port_pair
from meshnet_gguf.llama.binary import BinaryInfo, find_llama_server
from meshnet_gguf.llama.rpc_worker import find_rpc_server
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model

START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0
PREFILL_TOKENS = 1500  # ~1,500-token prompts, as in the measurement that found the cold worker
PREFILL_WORDS_FOR_NODE = 300  # about PREFILL_TOKENS with the generated model's byte-level vocabulary
DECODE_TOKENS = 128
GREEDY_TOKENS = 64
ROUNDS = 3


def spawn(argv: list[str], binary: BinaryInfo, log: Path) -> subprocess.Popen[bytes]:
    handle = log.open("wb")
    return subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=binary.environment(), start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_log(log: Path, marker: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if marker in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise SystemExit(f"{log.name} exited:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)
    raise SystemExit(f"{log.name}: no {marker!r} after {START_TIMEOUT_S} s")


def wait_health(url: str, proc: subprocess.Popen[bytes], log: Path, what: str = "llama-server", timeout_s: float = START_TIMEOUT_S) -> None:
    """Until `url`/health answers 200; exits the bench, with `log`'s tail, when `what` died or never got there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{what} not ready after {timeout_s:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")


def long_prompt(url: str, tokens: int = PREFILL_TOKENS, salt: int = 0) -> str:
    """About `tokens` tokens of text for this model (its tokenizer decides how many words that is)."""
    text = " ".join(f"word{(i + salt) % 97}" for i in range(tokens))
    ids = httpx.post(url + "/tokenize", json={"content": text}, timeout=30).json()["tokens"][:tokens]
    return httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()["content"]


def complete(url: str, prompt: str, n_predict: int) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True, "cache_prompt": False, "return_tokens": True}
    answer = httpx.post(url + "/completion", json=body, timeout=REQUEST_TIMEOUT_S)
    answer.raise_for_status()
    return answer.json()


def concurrent(url: str, prompt: str, n_predict: int, clients: int) -> tuple[float, list[dict[str, Any]]]:
    """Wall time for `clients` requests at once, and their answers."""
    answers: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        # Each client's prompt differs, so no slot reuses another's cache.
        result = complete(url, f"{i} {prompt}", n_predict)
        with lock:
            answers.append(result)

    started = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - started, answers


def measure(url: str) -> dict[str, Any]:
    """Decode and prefill tokens/s at c=1 and c=4 (medians of ROUNDS), and the greedy tokens."""
    prompt = long_prompt(url)
    figures: dict[str, Any] = {}
    complete(url, "warm up", 8)
    for clients in (1, 4):
        decode, prefill = [], []
        for _ in range(ROUNDS):
            wall, answers = concurrent(url, "Once upon a time", DECODE_TOKENS, clients)
            decode.append(sum(a["timings"]["predicted_n"] for a in answers) / wall)
            wall, answers = concurrent(url, prompt, 1, clients)
            prefill.append(sum(a["timings"]["prompt_n"] for a in answers) / wall)
        figures[f"decode_tok_s_c{clients}"] = round(statistics.median(decode), 1)
        figures[f"prefill_tok_s_c{clients}"] = round(statistics.median(prefill), 1)
    greedy = complete(url, "The quick brown fox", GREEDY_TOKENS)
    figures["greedy_tokens"] = greedy.get("tokens") or []
    figures["greedy_text"] = greedy.get("content", "")
    return figures


def run_llama(binary: BinaryInfo, model: Path, args: list[str], workdir: Path, name: str) -> dict[str, Any]:
    port = free_local_port()
    log = workdir / f"{name}.log"
    argv = [str(binary.path), "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--parallel", "4",
            "--ctx-size", "16384", "--cache-ram", "0", *args]  # fmt: skip
    print(f"[{name}] {' '.join(argv[1:])}", flush=True)
    proc = spawn(argv, binary, log)
    try:
        started = time.monotonic()
        wait_health(f"http://127.0.0.1:{port}", proc, log)
        load_s = time.monotonic() - started
        first = time.monotonic()
        complete(f"http://127.0.0.1:{port}", long_prompt(f"http://127.0.0.1:{port}", salt=1), 1)
        first_s = time.monotonic() - first
        figures = measure(f"http://127.0.0.1:{port}")
        figures.update(load_s=round(load_s, 2), first_prefill_s=round(first_s, 3), argv=" ".join(argv[1:]))
        return figures
    finally:
        stop(proc)


def node_first_vs_steady(model: Path, endpoints: list[str], workdir: Path) -> dict[str, Any]:
    """Through `meshnet-gguf serve --pool-worker`: the first long prompt after ready, against the steady median."""
    port = free_local_port()
    log = workdir / "node.log"
    argv = [sys.executable, "-m", "meshnet_gguf", "serve", "--gguf", str(model), "--port", str(port),
            "--state-dir", str(workdir / "state"), "--offline", "--ctx-size", "16384",
            *[a for e in endpoints for a in ("--pool-worker", e)]]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc, log, "node")
        times = []
        for i in range(4):
            # The node's own llama-server is private: the prompt is cut by words, about the same length.
            prompt = f"{i} " + " ".join(f"word{(i + j) % 97}" for j in range(PREFILL_WORDS_FOR_NODE))
            started = time.monotonic()
            answer = httpx.post(
                url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=REQUEST_TIMEOUT_S
            )
            answer.raise_for_status()
            times.append(time.monotonic() - started)
        steady = statistics.median(times[1:])
        return {"first_s": round(times[0], 3), "steady_s": round(steady, 3), "ratio": round(times[0] / steady, 2)}
    finally:
        stop(proc)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="A GGUF to use instead of generating one")
    parser.add_argument("--model-spec", default="8,512,1408,8,4", help="n_layers,n_embd,n_ff,n_head,n_head_kv (random weights)")
    parser.add_argument("--weight-type", default="F16")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-device", default="CPU", help="ggml-rpc-server -d (CPU here, Vulkan0 on a GPU box)")
    parser.add_argument("--worker-cache", action="store_true", help="ggml-rpc-server -c (tensor cache)")
    parser.add_argument("--local-device", default=None, help="A local device in the pooled run too (e.g. Vulkan0)")
    parser.add_argument("--single-args", default="-ngl 0", help="llama-server's device flags for the single run")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-node", action="store_true", help="Skip the first-after-ready measurement through a node")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--llama-server", type=Path)
    args = parser.parse_args()

    binary = find_llama_server(args.llama_server)
    rpc = find_rpc_server(binary)
    workdir = Path(tempfile.mkdtemp(prefix="bench-pool-"))
    if args.model is not None:
        model = args.model
    else:
        n_layers, n_embd, n_ff, n_head, n_head_kv = map(int, args.model_spec.split(","))
        spec = TinyModelSpec(n_layers=n_layers, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                             name="pool-bench", weight_type=args.weight_type, context_length=16384)  # fmt: skip
        model = write_tiny_model(workdir / "pool-bench.gguf", spec)
    print(f"model {model} ({model.stat().st_size / 1e6:.0f} MB); llama-server {binary.describe()}", flush=True)
    threads = ["-t", str(args.threads)] if args.threads else []

    results: dict[str, Any] = {"model": str(model), "model_bytes": model.stat().st_size, "llama_server": binary.describe()}
    results["single"] = run_llama(binary, model, [*args.single_args.split(), *threads], workdir, "single")

    workers, endpoints = [], []
    try:
        for i in range(args.workers):
            port = free_local_port()
            cache = ["-c"] if args.worker_cache else []
            argv = [
                shutil.which("stdbuf") or "stdbuf",
                "-oL",
                str(rpc.path),
                "-H",
                "127.0.0.1",
                "-p",
                str(port),
                "-d",
                args.worker_device,
                *threads,
                *cache,
            ]
            log = workdir / f"worker{i}.log"
            env_binary = BinaryInfo(rpc.path, rpc.source, rpc.version, rpc.build, "", rpc.library_dirs)
            proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**env_binary.environment(), "LLAMA_CACHE": str(workdir / f"cache{i}")})  # fmt: skip
            workers.append(proc)
            wait_log(log, "Starting RPC server", proc)
            endpoints.append(f"127.0.0.1:{port}")
        devices = [f"RPC{i}" for i in range(args.workers)] + ([args.local_device] if args.local_device else [])
        pooled = [
            "--rpc",
            ",".join(endpoints),
            "--device",
            ",".join(devices),
            "--tensor-split",
            ",".join("1" for _ in devices),
            "-ngl",
            "999",
            *threads,
        ]
        results["pooled"] = run_llama(binary, model, pooled, workdir, "pooled")
    finally:
        for proc in workers:
            stop(proc)
    if not args.no_node:
        results["node_first_vs_steady"] = node_first_through_workers(model, args, workdir)

    single, pooled_fig = results["single"], results["pooled"]
    same = single["greedy_tokens"] == pooled_fig["greedy_tokens"] and single["greedy_text"] == pooled_fig["greedy_text"]
    first_diff = next((i for i, (a, b) in enumerate(zip(single["greedy_tokens"], pooled_fig["greedy_tokens"])) if a != b), None)
    results["greedy_identical"] = same
    results["greedy_first_difference"] = first_diff
    print("\nrun      decode c1  decode c4  prefill c1  prefill c4  (tok/s)  load s  first 1.5k prefill s")
    for name in ("single", "pooled"):
        f = results[name]
        print(f"{name:8} {f['decode_tok_s_c1']:9} {f['decode_tok_s_c4']:10} {f['prefill_tok_s_c1']:11} {f['prefill_tok_s_c4']:11}"
              f"  {'':7} {f['load_s']:6} {f['first_prefill_s']:8}")  # fmt: skip
    for key in ("decode_tok_s_c1", "decode_tok_s_c4"):
        s, p = single[key], pooled_fig[key]
        print(f"{key}: pooled costs {1000 / p - 1000 / s:+.3f} ms per token ({p / s:.2f}x of single)")
    print(f"greedy output identical token for token: {same}" + ("" if same else f" (first difference at token {first_diff})"))
    if "node_first_vs_steady" in results:
        n = results["node_first_vs_steady"]
        print(f"through the node: first long prompt after ready {n['first_s']} s, steady {n['steady_s']} s ({n['ratio']}x)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def node_first_through_workers(model: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Two `meshnet-gguf worker`s and a node pooling them: the first long prompt after ready vs steady."""
    from meshnet_gguf.mesh.identity import NodeIdentity

    key = NodeIdentity.load_or_create(workdir / "state").public_key_text
    procs, endpoints = [], []
    try:
        for i in range(args.workers):
            port = free_local_port_pair()
            log = workdir / f"mworker{i}.log"
            argv = [sys.executable, "-m", "meshnet_gguf", "worker", "--host", "127.0.0.1", "--port", str(port), "--node-key", key,
                    "--device", args.worker_device, "--cache-dir", str(workdir / f"mcache{i}"), "--cache-limit", "4G"]  # fmt: skip
            proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(proc)
            wait_log(log, "Starting RPC server", proc)  # type: ignore[arg-type]
            while httpx.get(f"http://127.0.0.1:{port + 1}/status", timeout=2).status_code != 401:  # status endpoint up
                time.sleep(0.1)
            endpoints.append(f"127.0.0.1:{port}")
        return node_first_vs_steady(model, endpoints, workdir)
    finally:
        for proc in procs:
            stop(proc)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
