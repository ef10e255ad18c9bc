"""Soak llama-server with distinct prompts and watch its RSS: does the host prompt cache grow, and stop?

llama-server keeps the KV state of finished prompts in host RAM (its "prompt
cache", `--cache-ram N` MiB, default 8192) so that a returning conversation
skips its prefill. Every distinct prompt adds its state until the limit. This
script shows it on a generated model whose KV cache is large per token (so a
few requests move RSS by tens of MB) and compares cache limits:

    .venv/bin/python bench/soak_prompt_cache.py                      # default, 0, and the plan's value
    .venv/bin/python bench/soak_prompt_cache.py --cache-ram 8192 --requests 40
    .venv/bin/python bench/soak_prompt_cache.py --minutes 10 --cache-ram plan

Run by hand (minutes on 2 cores); the CI test `tests/prepare/test_prompt_cache.py` runs
a short bounded version. Everything listens on 127.0.0.1 and is stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.llama.binary import find_llama_server
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model

# 2 layers x 16 KV heads x 64 dims x (K+V) x 2 bytes (f16) = 8 KiB of KV per token:
# a 1,500-token prompt leaves ~12 MB of state behind, while prefill stays cheap.
KV_HEAVY_MODEL = TinyModelSpec(n_layers=2, n_embd=1024, n_head=16, n_head_kv=16, n_ff=256, context_length=8192)
KV_BYTES_PER_TOKEN = 2 * 16 * 64 * 2 * 2
READY_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


@dataclass
class Sample:
    request: int
    elapsed_s: float
    rss_bytes: int


def start_server(model: Path, *, cache_ram: str | None, ctx: int, parallel: int, log_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    binary = find_llama_server(None)
    port = free_local_port()
    argv = [str(binary.path), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--ctx-size", str(ctx), "--parallel", str(parallel), "--device", "none", "-ngl", "0"]  # fmt: skip
    if cache_ram is not None:
        argv += ["--cache-ram", cache_ram]
    log = log_path.open("wb")
    child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=binary.environment(), start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"llama-server exited {child.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return child, port
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(child)
    raise RuntimeError(f"llama-server not ready within {READY_TIMEOUT_S} s; see {log_path}")


def stop_server(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def distinct_prompt(rng: random.Random, tokens: int) -> str:
    # The tiny model's vocabulary is the ASCII bytes: one character is one token.
    return "".join(rng.choice(string.ascii_letters) for _ in range(tokens))


def soak(port: int, pid: int, *, requests: int, minutes: float | None, prompt_tokens: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    process = psutil.Process(pid)
    samples = [Sample(0, 0.0, process.memory_info().rss)]
    started = time.monotonic()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=REQUEST_TIMEOUT_S) as client:
        n = 0
        while (minutes is None and n < requests) or (minutes is not None and time.monotonic() - started < minutes * 60):
            n += 1
            body = {"messages": [{"role": "user", "content": distinct_prompt(rng, prompt_tokens)}], "max_tokens": 4}
            client.post("/v1/chat/completions", json=body).raise_for_status()
            samples.append(Sample(n, time.monotonic() - started, process.memory_info().rss))
    return samples


def planned_cache_ram(model: Path, ctx: int, parallel: int, download_dir: Path) -> str:
    """What `serve --dry-run` sets `--cache-ram` to for this model on this machine."""
    from meshnet_gguf.common.settings import NodeSettings
    from meshnet_gguf.prepare.pipeline import prepare_launch

    settings = NodeSettings(gguf=str(model), ctx_size=ctx, parallel=parallel, n_gpu_layers="0", download_dir=download_dir)
    args = list(prepare_launch(settings, dry_run=True).child.args)
    return args[args.index("--cache-ram") + 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-ram", action="append", help="MiB, 'default' (the binary's own) or 'plan'; repeatable")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--minutes", type=float, default=None, help="soak for this long instead of --requests")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the samples here")
    args = parser.parse_args()
    limits = args.cache_ram or ["default", "0", "plan"]
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="meshnet-soak-") as tmp:
        model = write_tiny_model(Path(tmp) / "kv-heavy.gguf", KV_HEAVY_MODEL)
        state = KV_BYTES_PER_TOKEN * args.prompt_tokens
        print(f"model: {model.stat().st_size / 1e6:.0f} MB, ~{state / 2**20:.1f} MiB of KV state per {args.prompt_tokens}-token prompt")
        for limit in limits:
            if limit == "plan":
                value: str | None = planned_cache_ram(model, args.ctx, args.parallel, Path(tmp) / "models")
            else:
                value = None if limit == "default" else limit
            child, port = start_server(model, cache_ram=value, ctx=args.ctx, parallel=args.parallel, log_path=Path(tmp) / f"{limit}.log")
            try:
                samples = soak(port, child.pid, requests=args.requests, minutes=args.minutes, prompt_tokens=args.prompt_tokens, seed=1)
            finally:
                stop_server(child)
            base = samples[0].rss_bytes
            label = f"--cache-ram {value}" if value is not None else "--cache-ram not set (binary default)"
            print(f"\n{label} ({limit}): RSS after load {base / 2**20:.0f} MiB")
            for s in samples[1:]:
                if s.request % max(1, len(samples) // 12) == 0 or s is samples[-1]:
                    print(
                        f"  request {s.request:4d}  {s.elapsed_s:7.1f} s  RSS {s.rss_bytes / 2**20:7.1f} MiB  (+{(s.rss_bytes - base) / 2**20:.1f})"
                    )
            results[limit] = [s.__dict__ for s in samples]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
