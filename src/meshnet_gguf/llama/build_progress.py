"""What a llama-server build shows while it runs: the stage, the percent, the time spent and the time to expect.

The build's tools talk a lot (cmake, ninja, npm); an operator wants to know
where it is and how long is left. `BuildProgress` is what the build reports to
(a stage begins; a tool printed a line), and `ProgressBar` draws it: on a
terminal one line redrawn in place,

    building llama-server: compiling  [#########...........]  45% (96/213)  2:10 of ~6:30

and elsewhere (the journal, a pipe, a test) a plain line at each stage and each
tenth of the way, so a log stays short. The percent comes from ninja's `[n/N]`
(or make's `[ NN%]`); the expected time from the last build on this machine,
else from the measured figure scaled to this machine's cores.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from typing import Protocol, TextIO

# bench/RESULTS.md, "Building llama-server": the whole CPU build (source fetched, web UI,
# llama-server and ggml-rpc-server) on 2 cores. Scaled by cores for other machines.
MEASURED_BUILD_S = 620.0
MEASURED_CORES = 2
# Compiling does not speed up past a point (linking, the web UI's bundler are serial).
MIN_EXPECTED_BUILD_S = 120.0
BAR_WIDTH = 20
# A terminal is redrawn at most this often; a log gets a line per stage and per this many percent.
REDRAW_INTERVAL_S = 0.2
LOG_EVERY_PERCENT = 10
_NINJA_STEP = re.compile(r"^\[(?P<done>\d+)/(?P<total>\d+)\]")
_MAKE_PERCENT = re.compile(r"^\[\s*(?P<percent>\d+)%\]")


class BuildProgress(Protocol):
    """What a build reports while it runs."""

    def stage(self, name: str) -> None:
        """A stage begins: "fetching the source", "configuring", "compiling", "checking", "installing"."""

    def line(self, text: str) -> None:
        """One line of a tool's output (kept for a failure's message; parsed for the percent)."""


class QuietProgress:
    """Reports to nobody (a library call that wants only the result)."""

    def stage(self, name: str) -> None:
        pass

    def line(self, text: str) -> None:
        pass


def expected_build_seconds(previous_s: float | None = None, cores: int | None = None) -> float:
    """How long a build should take here: the last one's time, else the measured one scaled to these cores."""
    if previous_s:
        return previous_s
    cores = cores or os.cpu_count() or 1
    return max(MIN_EXPECTED_BUILD_S, MEASURED_BUILD_S * MEASURED_CORES / cores)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}:{seconds % 60:02d}"


def step_of(line: str) -> tuple[int, int] | None:
    """(done, total) from a ninja line `[96/213] Building ...`, or from make's `[ 45%]` as (45, 100)."""
    if match := _NINJA_STEP.match(line):
        return int(match["done"]), int(match["total"])
    if match := _MAKE_PERCENT.match(line):
        return int(match["percent"]), 100
    return None


class ProgressBar:
    """Draws a build's progress on `stream`: redrawn in place on a terminal, a line now and then elsewhere."""

    def __init__(
        self,
        expected_s: float,
        *,
        stream: TextIO | None = None,
        interactive: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        what: str = "llama-server",
    ) -> None:
        self._stream = sys.stderr if stream is None else stream
        self._interactive = self._stream.isatty() if interactive is None else interactive
        self._clock = clock
        self._started = clock()
        self._expected_s = expected_s
        self._what = what
        self._stage = "starting"
        self._step: tuple[int, int] | None = None
        self._last_draw = float("-inf")
        self._last_logged_percent = -LOG_EVERY_PERCENT

    def stage(self, name: str) -> None:
        self._stage = name
        self._step = None
        self._last_logged_percent = -LOG_EVERY_PERCENT
        self._draw(force=True)

    def line(self, text: str) -> None:
        step = step_of(text)
        if step is None:
            return
        self._step = step
        self._draw()

    def finish(self, message: str) -> None:
        if self._interactive:
            self._stream.write("\r\033[K")
        self._stream.write(f"{message}\n")
        self._stream.flush()

    @property
    def percent(self) -> int | None:
        if self._step is None or self._step[1] == 0:
            return None
        return min(100, self._step[0] * 100 // self._step[1])

    def render(self) -> str:
        elapsed = self._clock() - self._started
        parts = [f"building {self._what}: {self._stage}"]
        percent = self.percent
        if percent is not None:
            filled = percent * BAR_WIDTH // 100
            assert self._step is not None
            count = f" ({self._step[0]}/{self._step[1]})" if self._step[1] != 100 else ""
            parts.append(f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {percent:3d}%{count}")
        parts.append(f"{format_duration(elapsed)} of ~{format_duration(max(self._expected_s, elapsed))}")
        return "  ".join(parts)

    def _draw(self, *, force: bool = False) -> None:
        now = self._clock()
        if self._interactive:
            if force or now - self._last_draw >= REDRAW_INTERVAL_S:
                self._stream.write("\r\033[K" + self.render())
                self._stream.flush()
                self._last_draw = now
            return
        percent = self.percent
        if not force and (percent is None or percent < self._last_logged_percent + LOG_EVERY_PERCENT):
            return
        if percent is not None:
            self._last_logged_percent = percent - percent % LOG_EVERY_PERCENT
        self._stream.write(self.render() + "\n")
        self._stream.flush()
