"""Load progress from llama-server's real log lines and real I/O counters.

The fixtures under fixtures/llama_logs are the bundled llama-server's own
output (paths and ports blanked): the tiny test model at the default
verbosity and at `-lv 4`, a 5-shard split, and the demo gemma model with
`--load-mode none` (those two logs end where that load was cut short).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.load_progress import (
    TENSORS_END,
    TENSORS_START,
    LoadProgressReader,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "llama_logs"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _replay(name: str, reader: LoadProgressReader) -> list[tuple[str, float | None]]:
    seen: list[tuple[str, float | None]] = []
    for line in (FIXTURES / name).read_text().splitlines():
        progress = reader.feed(line)
        if progress is not None:
            seen.append((progress.phase, progress.fraction))
    return seen


def _fractions_never_fall(seen: list[tuple[str, float | None]]) -> bool:
    known = [f for _, f in seen if f is not None]
    return known == sorted(known)


def test_default_verbosity_shows_phases_and_finishes_at_one() -> None:
    reader = LoadProgressReader()
    seen = _replay("tiny_default.log", reader)
    assert [phase for phase, _ in seen] == ["metadata", "context", "slots", "ready"]
    # Nothing measurable before the tensors are in: no made-up number.
    assert seen[0][1] is None
    assert reader.done and reader.current.fraction == 1.0
    assert _fractions_never_fall(seen)


def test_verbose_log_gives_tensor_count_size_and_buffers() -> None:
    reader = LoadProgressReader()
    seen = _replay("gemma_lv4_none.log", reader)
    phases = [phase for phase, _ in seen]
    for phase in ("metadata", "fitting", "tensors", "context", "warmup"):
        assert phase in phases
    assert _fractions_never_fall(seen)
    progress = reader.current
    assert progress.phase == "warmup"
    assert not reader.done
    # The honest GPU signal: which buffers the weights went to (here the CPU).
    assert "CPU model buffer size" not in progress.detail
    assert "CPU 222.51 MiB" in progress.detail
    assert "19/19 layers offloaded" in progress.detail


def test_tensor_phase_reports_bytes_against_the_size_from_the_log() -> None:
    clock = FakeClock()
    reader = LoadProgressReader(clock=clock)
    reader.observe_io(read_chars=6 * 2**20, mapped_bytes=61 * 2**20)  # baseline: libraries mapped
    for line in (FIXTURES / "gemma_lv4_none.log").read_text().splitlines():
        reader.feed(line)
        if "load_tensors: loading model tensors" in line:
            break
    progress = reader.current
    assert progress.phase == "tensors"
    assert "236 tensors" in progress.detail
    assert "235.2 MiB" in progress.detail  # print_info: file size = 235.16 MiB

    clock.now += 12
    moved = reader.observe_io(read_chars=(6 + 120) * 2**20, mapped_bytes=61 * 2**20)
    assert moved is not None
    expected = TENSORS_START + (120 / 235.16) * (TENSORS_END - TENSORS_START)
    assert moved.fraction == pytest.approx(expected, abs=0.01)
    assert "120.0 MiB of 235.2 MiB" in moved.detail
    assert moved.describe().endswith(", 12 s")
    assert f"{expected * 100:.0f}%" in moved.describe()

    # Counters that overshoot the file never claim the next phase has begun.
    reader.observe_io(read_chars=10 * 2**30, mapped_bytes=0)
    assert reader.current.fraction is not None and reader.current.fraction < TENSORS_END


def test_mapped_bytes_count_for_mmap_loads() -> None:
    reader = LoadProgressReader(model_bytes=100 * 2**20)
    reader.observe_io(read_chars=0, mapped_bytes=60 * 2**20)
    reader.feed("0.00.9 I load_tensors: loading model tensors, this can take a while... (load_mode = mmap)")
    progress = reader.observe_io(read_chars=2**20, mapped_bytes=110 * 2**20)
    assert progress is not None and progress.fraction is not None
    assert progress.fraction == pytest.approx(TENSORS_START + 0.5 * (TENSORS_END - TENSORS_START), abs=0.01)


def test_late_lines_do_not_move_backwards_and_dots_count() -> None:
    reader = LoadProgressReader()
    reader.feed("llama_model_load: load_tensors: loading model tensors, this can take a while...")
    assert reader.feed("." * 50) is not None
    half = reader.current.fraction
    assert half == pytest.approx(TENSORS_START + 0.5 * (TENSORS_END - TENSORS_START))
    reader.feed("I cmn init: llama threadpool init, n_threads = 2")
    reader.feed("I srv load_model: loading model '/models/x.gguf'")  # a stray repeat
    assert reader.current.phase == "context"
    assert reader.current.fraction is not None and reader.current.fraction > half


def test_unrelated_lines_are_not_progress() -> None:
    reader = LoadProgressReader()
    assert reader.feed("0.00.027 W srv  llama_server: CORS is set to allow all origins") is None
    assert reader.current.phase == "starting"


def test_split_model_log() -> None:
    reader = LoadProgressReader()
    seen = _replay("split_lv4_none.log", reader)
    assert reader.done
    assert _fractions_never_fall(seen)


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="this system exposes no per-process I/O counters")
def test_observe_process_reads_real_counters(tmp_path: Path) -> None:
    """read() of a file by a live process shows up as progress of the tensor phase."""
    size = 8 * 2**20
    blob = tmp_path / "weights.bin"
    blob.write_bytes(os.urandom(size))
    script = "import sys; sys.stdin.readline(); open(sys.argv[1], 'rb').read(); print('done', flush=True); sys.stdin.readline()"
    child = subprocess.Popen([sys.executable, "-c", script, blob], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        reader = LoadProgressReader(model_bytes=size)
        reader.observe_process(child.pid)  # baseline
        reader.feed("load_tensors: loading model tensors, this can take a while... (load_mode = none)")
        assert reader.current.fraction is None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        progress = reader.observe_process(child.pid)
        assert progress is not None
        assert progress.fraction == pytest.approx(TENSORS_END - 0.01, abs=0.001)
        assert "8.0 MiB of 8.0 MiB" in progress.detail
    finally:
        child.kill()
        child.wait()


def test_observe_process_of_a_gone_process_is_none() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    assert LoadProgressReader(model_bytes=1).observe_process(child.pid) is None


@pytest.mark.real_llama
def test_real_llama_server_load_is_tracked_to_ready(real_llama: BinaryInfo, tiny_gguf: Path) -> None:
    binary, model = real_llama, tiny_gguf
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    child = subprocess.Popen(
        [str(binary.path), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-lv", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=binary.environment(),
        text=True,
        errors="replace",
    )
    assert child.stdout is not None
    reader = LoadProgressReader()
    phases: list[str] = []
    try:
        reader.observe_process(child.pid)
        for line in child.stdout:
            if (progress := reader.feed(line)) is not None:
                phases.append(progress.phase)
            if reader.done:
                break
    finally:
        child.terminate()
        child.wait(timeout=30)
    assert reader.done, "llama-server never said the model was loaded"
    assert reader.current.fraction == 1.0
    assert phases[0] == "metadata" and phases[-1] == "ready"
    assert "tensors" in phases
