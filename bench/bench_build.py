"""How long building llama-server for this machine takes, stage by stage (`serve`'s one-time build).

    .venv/bin/python bench/bench_build.py [--source SDIST] [--jobs N] [--portable] [--no-web-ui]

Runs the node's own build (`llama.source_build.build_llama_server`, the run probe
before install) into a temporary install folder, and prints wall time per stage
and the CPU time of the whole. Without `--source` it fetches the sdist with pip
first, as a fresh box does; run it on an otherwise idle machine (the 2-core
figure in bench/RESULTS.md is what `build_progress.MEASURED_BUILD_S` says).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from meshnet_gguf.llama.binary import probe_binary
from meshnet_gguf.llama.run_probe import ProbeCache, probe_run
from meshnet_gguf.llama.source_build import build_llama_server


class StageClock:
    """Wall time per stage, and ninja's step count."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.stages: list[tuple[str, float]] = []
        self.steps = 0

    def stage(self, name: str) -> None:
        self.stages.append((name, time.monotonic()))
        print(f"[{time.monotonic() - self.started:7.1f} s] {name}", flush=True)

    def line(self, text: str) -> None:
        if text.startswith("["):
            self.steps += 1

    def report(self, end: float) -> list[str]:
        rows = []
        for (name, at), (_, until) in zip(self.stages, [*self.stages[1:], ("end", end)]):
            rows.append(f"  {name:<60} {until - at:8.1f} s")
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help="an sdist or folder (default: fetched with pip, timed)")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--portable", action="store_true")
    parser.add_argument("--no-web-ui", action="store_true", help="build as a box without npm does")
    args = parser.parse_args()
    clock = StageClock()
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-build-") as tmp:
        cache = ProbeCache(Path(tmp) / "probes.json")
        started = time.monotonic()
        result = build_llama_server(
            install_root=Path(tmp) / "install", source=args.source, jobs=args.jobs, portable=args.portable, progress=clock,
            web_ui=False if args.no_web_ui else None,
            notes=lambda line: print(f"note: {line}", flush=True), check_runs=lambda b: probe_run(b, cache=cache).runs,
        )  # fmt: skip
        end = time.monotonic()
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        probe = probe_run(probe_binary(result.binary, "bench"), cache=cache)
        print()
        print(f"built {result.describe()}; web UI: {probe.web_ui}; ninja steps: {clock.steps}")
        print(f"cores: {os.cpu_count()}, jobs: {args.jobs or os.cpu_count()}, load average at end: {os.getloadavg()[0]:.1f}")
        print(f"wall: {end - started:.1f} s; CPU of the tools: {children.ru_utime + children.ru_stime:.0f} s")
        print("\n".join(clock.report(end)))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
