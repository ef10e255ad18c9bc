"""The build's progress: stage, percent from ninja's [n/N], elapsed and expected time; in place on a terminal, a few lines in a log."""

from __future__ import annotations

import io

from meshnet_gguf.llama.build_progress import (
    MEASURED_BUILD_S,
    MIN_EXPECTED_BUILD_S,
    ProgressBar,
    expected_build_seconds,
    step_of,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _ninja_lines(total: int) -> list[str]:
    return [f"[{n}/{total}] Building CXX object ggml/src/file{n}.cpp.o" for n in range(1, total + 1)]


def test_ninja_and_make_steps_are_read_and_other_lines_are_not() -> None:
    assert step_of("[96/213] Building CXX object src/llama.cpp.o") == (96, 213)
    assert step_of("[ 45%] Building CXX object src/llama.cpp.o") == (45, 100)
    assert step_of("-- Configuring done") is None and step_of("warning: [96/213] in a message") is None


def test_a_log_gets_a_line_per_stage_and_per_tenth_with_the_times() -> None:
    out, clock = io.StringIO(), Clock()
    bar = ProgressBar(420.0, stream=out, interactive=False, clock=clock)
    bar.stage("configuring")
    clock.now = 12.0
    bar.stage("compiling")
    for line in _ninja_lines(200):
        clock.now += 1.0
        bar.line(line)
    bar.finish("built llama-server")
    lines = out.getvalue().splitlines()
    assert lines[0] == "building llama-server: configuring  0:00 of ~7:00"
    assert lines[1] == "building llama-server: compiling  0:12 of ~7:00"
    compiling = [line for line in lines if "%" in line]
    assert len(compiling) == 11  # 0 %, 10 %, ... 100 %: a log stays short
    assert compiling[5] == "building llama-server: compiling  [##########..........]  50% (100/200)  1:52 of ~7:00"
    assert lines[-1] == "built llama-server"


def test_past_the_expected_time_the_expected_time_follows_the_clock() -> None:
    out, clock = io.StringIO(), Clock()
    bar = ProgressBar(60.0, stream=out, interactive=False, clock=clock)
    clock.now = 90.0
    bar.stage("compiling")
    assert out.getvalue().strip().endswith("1:30 of ~1:30")


def test_a_terminal_gets_one_line_redrawn_in_place() -> None:
    out, clock = io.StringIO(), Clock()
    bar = ProgressBar(420.0, stream=out, interactive=True, clock=clock)
    bar.stage("compiling")
    for line in _ninja_lines(50):
        clock.now += 0.5
        bar.line(line)
    bar.finish("built")
    text = out.getvalue()
    assert "\n" not in text.removesuffix("built\n")  # every redraw returns to the start of the same line
    assert text.count("\r\033[K") > 10 and "100% (50/50)" in text


def test_the_expected_time_is_the_last_build_else_the_measured_one_scaled_to_the_cores() -> None:
    assert expected_build_seconds(previous_s=300.0) == 300.0
    assert expected_build_seconds(cores=2) == MEASURED_BUILD_S
    assert expected_build_seconds(cores=4) == MEASURED_BUILD_S / 2
    assert expected_build_seconds(cores=64) == MIN_EXPECTED_BUILD_S
