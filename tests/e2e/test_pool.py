"""A pool on one machine: two `meshnet-gguf worker` processes on loopback and a node that splits the
tiny model over both (the F32 model runs on any CPU), and a node refused because a worker is away."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.rpc_status import STATUS_PATH
from meshnet_gguf.mesh.identity import NodeIdentity
from support.node_process import NodeProcess

pytestmark = [pytest.mark.real_llama, pytest.mark.slow]
WORKER_START_S = 20.0


class WorkerProcess:
    """`meshnet-gguf worker` on a loopback port, lending the CPU, stopped by pid at the end."""

    def __init__(self, workdir: Path, node_key: str) -> None:
        self.port = free_local_port()
        self.log_path = workdir / f"worker-{self.port}.log"
        argv = [
            sys.executable, "-m", "meshnet_gguf", "worker", "--host", "127.0.0.1", "--port", str(self.port),
            "--node-key", node_key, "--device", "CPU", "--cache-dir", str(workdir / f"cache-{self.port}"), "--cache-limit", "1G",
        ]  # fmt: skip
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_listening(self) -> None:
        deadline = time.monotonic() + WORKER_START_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                # Unauthenticated: 401 is enough to know the status endpoint is up; the banner comes with the server.
                if httpx.get(f"http://127.0.0.1:{self.port + 1}{STATUS_PATH}", timeout=1).status_code == 401 and (
                    "Starting RPC server" in self.log_path.read_text(errors="replace")
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"worker not up after {WORKER_START_S} s:\n{self.log_path.read_text()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[[str], WorkerProcess]]:
    workers: list[WorkerProcess] = []

    def start(node_key: str) -> WorkerProcess:
        worker = WorkerProcess(tmp_path, node_key)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.close()


def test_the_tiny_model_is_split_across_two_loopback_workers(  # type: ignore[no-untyped-def]
    real_llama: BinaryInfo, tiny_gguf: Path, start_node, start_worker, tmp_path: Path
) -> None:
    key = NodeIdentity.load_or_create(tmp_path / "state").public_key_text
    first, second = start_worker(key), start_worker(key)
    first.wait_listening()
    second.wait_listening()
    node: NodeProcess = start_node(
        "--gguf", str(tiny_gguf), "--pool-worker", f"{first.endpoint}=3G", "--pool-worker", f"{second.endpoint}=3G",
        "--llama-arg=-lv", "--llama-arg=4", env={"MESHNET_LOG_LEVEL": "DEBUG"},  # llama-server's load lines are DEBUG
    )  # fmt: skip
    node.wait_ready()
    log = node.log_text()
    # Buffer names number devices per server, so they are read by endpoint: model weights on both workers.
    for worker in (first, second):
        assert re.search(rf"RPC\d+\[{re.escape(worker.endpoint)}\] model buffer size", log), log[-4000:]
    assert f"--rpc {first.endpoint},{second.endpoint}" in log and "--cache-ram 0" in log
    answer = httpx.post(
        node.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
        timeout=30,
    )
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1


def test_a_worker_away_at_start_is_named_and_the_node_does_not_start(  # type: ignore[no-untyped-def]
    real_llama: BinaryInfo, tiny_gguf: Path, start_node, start_worker, tmp_path: Path
) -> None:
    key = NodeIdentity.load_or_create(tmp_path / "state").public_key_text
    present = start_worker(key)
    present.wait_listening()
    away = f"127.0.0.1:{free_local_port()}"
    node: NodeProcess = start_node("--gguf", str(tiny_gguf), "--pool-worker", present.endpoint, "--pool-worker", away)
    assert node.wait_exit() == 2
    log = node.log_text()
    assert f"pool worker {away} is not reachable" in log and "not starting" in log
    assert node.llama_pid() is None  # llama-server was never launched


def test_a_worker_started_for_another_node_refuses_this_ones_status_check(  # type: ignore[no-untyped-def]
    real_llama: BinaryInfo, tiny_gguf: Path, start_node, start_worker, tmp_path: Path
) -> None:
    stranger = NodeIdentity.load_or_create(tmp_path / "other-node").public_key_text
    worker = start_worker(stranger)
    worker.wait_listening()
    node: NodeProcess = start_node("--gguf", str(tiny_gguf), "--pool-worker", worker.endpoint)
    assert node.wait_exit() == 2
    assert f"pool worker {worker.endpoint} refused this node's status token" in node.log_text()
