"""The node's automatic plan against hand-set llama-server flags, and the first request after ready.

For each configuration it starts a node (`meshnet-gguf serve`, the same code path users run),
waits for /health 200, and measures through the node's proxy:

- first request after ready: TTFT of one streamed chat (a ~60-token prompt, 8 tokens out),
  then the same shape `--steady` more times with other prompts (steady-state TTFT, median);
- decode tok/s: `--decode-requests` completions of 128 tokens with `ignore_eos`
  (llama-server's own `timings.predicted_per_second`, median);
- prefill tok/s: `--prefill-requests` completions of a ~1,500-token prompt and 1 token out
  (`timings.prompt_per_second`, median). Every prompt is distinct, so no prompt cache helps.

Configurations: `plan` (nothing set by hand), `plan-no-warmup` (MESHNET_WARMUP=false, the
first-request baseline), then the sweep points as `--llama-arg` overrides of the plan. With
`--cpu`, also `cpu` / `cpu-no-warmup` (--n-gpu-layers 0; TTFT only).

    python bench/gpu/plan_vs_flags.py --model M.gguf --out DIR [--budget-s 450]

Writes DIR/plan_vs_flags.json (and logs under DIR/logs). bench/gpu/run_plan_sweep.sh runs it on
the lent H200; locally, a small model and `--sweep none` checks the script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
DECODE_TOKENS = 256
PREFILL_CHARS = 1500  # the test models' byte-level vocabulary: about one token per character
CHAT_CHARS = 60
FIRST_MAX_TOKENS = 8

# name -> extra llama-server flags (each passed as --llama-arg=...)
SWEEP: dict[str, list[str]] = {
    "fa-off": ["-fa", "off"],
    "fa-on": ["-fa", "on"],
    "ub256": ["-ub", "256"],
    "ub1024": ["-ub", "1024"],
    "b4096-ub2048": ["-b", "4096", "-ub", "2048"],
    "ub2048-fa-on": ["-b", "2048", "-ub", "2048", "-fa", "on"],
    "threads-4": ["-t", "4"],
    "threads-16": ["-t", "16"],
    "ngl-20": ["-ngl", "20"],
}


def _text(rng: random.Random, chars: int) -> str:
    words, size = [], 0
    while size < chars:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


class NodeRun:
    def __init__(self, name: str, model: Path, port: int, work: Path, serve_args: list[str], env: dict[str, str]) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = work / "logs" / f"serve_{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, "-m", "meshnet_gguf", "serve", "--gguf", str(model), "--offline", "--port", str(port),
            "--state-dir", str(work / f"state-{name}"), "--drain-grace", "1", *serve_args,
        ]  # fmt: skip
        self.argv = argv
        for key, value in env.items():
            if key.endswith("_CACHE_PATH"):
                Path(value).mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env})

    def wait_ready(self) -> float | None:
        deadline = self.started + READY_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        return None

    def launched(self) -> str | None:
        for line in self.log_path.read_text(errors="replace").splitlines():
            if "launching " in line:
                return line.split("launching ", 1)[1]
        return None

    def warmup_line(self) -> str | None:
        lines = [l for l in self.log_path.read_text(errors="replace").splitlines() if "warm" in l and "supervisor" in l]
        return lines[-1] if lines else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def stream_ttft(client: httpx.Client, prompt: str, max_tokens: int) -> dict[str, float]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True, "temperature": 0}
    started = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for chunk in response.iter_raw():
            if first is None and b'"content":"' in chunk:
                first = time.perf_counter()
    done = time.perf_counter()
    return {"ttft_ms": ((first or done) - started) * 1e3, "total_ms": (done - started) * 1e3}


def completion_timings(client: httpx.Client, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "cache_prompt": False}
    response = client.post("/v1/completions", json=body)
    response.raise_for_status()
    timings = response.json().get("timings") or {}
    keep = ("prompt_n", "prompt_per_second", "predicted_n", "predicted_per_second")
    return {k: timings.get(k) for k in keep}


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v]
    return statistics.median(present) if present else None


def measure(run: NodeRun, rng: random.Random, args: argparse.Namespace, ttft_only: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"name": run.name}
    ready_s = run.wait_ready()
    result["ready_s"] = ready_s
    result["argv"] = run.launched()
    result["warmup_log"] = run.warmup_line()
    if ready_s is None:
        result["error"] = "not ready: " + "\n".join(run.log_path.read_text(errors="replace").splitlines()[-15:])
        return result
    with httpx.Client(base_url=run.url, timeout=REQUEST_TIMEOUT_S) as client:
        client.get("/health")  # the client's own connection set up before the first timed request
        first = stream_ttft(client, _text(rng, CHAT_CHARS), FIRST_MAX_TOKENS)
        steady = [stream_ttft(client, _text(rng, CHAT_CHARS), FIRST_MAX_TOKENS) for _ in range(2 * args.steady)]
        # Steady state: the later half (without a warm-up the next few requests are slow too).
        steady_ttft = statistics.median(s["ttft_ms"] for s in steady[args.steady :])
        result.update(
            first_ttft_ms=round(first["ttft_ms"], 2),
            first_total_ms=round(first["total_ms"], 2),
            steady_ttft_ms=round(steady_ttft, 2),
            steady_ttft_all_ms=[round(s["ttft_ms"], 2) for s in steady],
            first_over_steady=round(first["ttft_ms"] / steady_ttft, 2),
        )
        if not ttft_only:
            decode = [completion_timings(client, _text(rng, 40), DECODE_TOKENS) for _ in range(args.decode_requests)]
            prefill = [completion_timings(client, _text(rng, PREFILL_CHARS), 1) for _ in range(args.prefill_requests)]
            result.update(
                decode=decode,
                prefill=prefill,
                decode_tok_s=median([d["predicted_per_second"] for d in decode]),
                prefill_tok_s=median([p["prompt_per_second"] for p in prefill]),
            )
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/plan-sweep"))
    p.add_argument("--port", type=int, default=18180)
    p.add_argument("--budget-s", type=float, default=450.0, help="skip configurations that would start after this")
    p.add_argument("--sweep", default="all", help="'all', 'none' or comma-separated sweep point names")
    p.add_argument("--cpu", action="store_true", help="also cpu / cpu-no-warmup (TTFT only)")
    p.add_argument("--ttft-only", action="store_true", help="first-request TTFT only, no decode/prefill figures")
    p.add_argument("--steady", type=int, default=5)
    p.add_argument("--decode-requests", type=int, default=8)
    p.add_argument("--prefill-requests", type=int, default=6)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rng = random.Random(14)

    # NVIDIA's driver keeps built pipelines on disk: the first-request pair each get an empty
    # cache (a node's first start on a machine); the sweep shares one, so only the first pays.
    cold = lambda name: {"__GL_SHADER_DISK_CACHE_PATH": str(args.work / f"glcache-{name}")}  # noqa: E731
    shared = {"__GL_SHADER_DISK_CACHE_PATH": str(args.work / "glcache-shared")}
    configs: list[tuple[str, list[str], dict[str, str], bool]] = [
        ("plan-no-warmup", [], {"MESHNET_WARMUP": "false", **cold("a")}, True),
        ("plan-cold", [], cold("b"), True),
        ("plan", [], shared, False),
    ]
    names = list(SWEEP) if args.sweep == "all" else [] if args.sweep == "none" else args.sweep.split(",")
    configs += [(n, [f"--llama-arg={a}" for a in SWEEP[n]], shared, False) for n in names]
    configs.append(("plan-again", [], shared, False))  # drift over the run
    if args.cpu:
        configs += [
            ("cpu", ["--n-gpu-layers", "0"], {}, True),
            ("cpu-no-warmup", ["--n-gpu-layers", "0"], {"MESHNET_WARMUP": "false"}, True),
        ]
    results: list[dict[str, Any]] = []
    out_file = args.out / "plan_vs_flags.json"
    for i, (name, serve_args, env, ttft_only) in enumerate(configs):
        if time.monotonic() - started > args.budget_s:
            results.append({"name": name, "skipped": "time budget"})
            continue
        run = NodeRun(name, args.model, args.port + i, args.work, serve_args, env)
        try:
            result = measure(run, rng, args, ttft_only or args.ttft_only)
        except Exception as exc:  # one broken configuration must not lose the others' figures
            result = {"name": name, "error": repr(exc)}
        finally:
            run.stop()
        result["elapsed_s"] = round(time.monotonic() - started, 1)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("decode", "prefill")}), flush=True)
        out_file.write_text(json.dumps({"results": results}, indent=2))
    best = {key: max((r for r in results if r.get(key)), key=lambda r: r[key], default=None) for key in ("decode_tok_s", "prefill_tok_s")}
    # The plan's figure is the median of its two runs (start and end of the sweep).
    plans = [r for r in results if r["name"] in ("plan", "plan-again") and r.get("decode_tok_s")]
    plan = {key: median([r.get(key) for r in plans]) for key in best}
    summary = {
        key: {
            "plan": plan.get(key),
            "best": best[key][key] if best[key] else None,
            "best_config": best[key]["name"] if best[key] else None,
            "plan_over_best": round(plan[key] / best[key][key], 3) if plan.get(key) and best[key] else None,
        }
        for key in best
    }
    out_file.write_text(json.dumps({"summary": summary, "results": results}, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
