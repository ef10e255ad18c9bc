"""Run a real node (`python -m meshnet_gguf serve ...`) as a child process for tests.

The node is started in its own session so a test can signal exactly it; its
llama-server dies with it (parent-death signal) and, as a fallback, is ended
through the node's pidfile (pid + start time), never by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from meshnet_gguf.common.ports import free_local_port as free_port
from meshnet_gguf.llama.child import PIDFILE_NAME, reap_stale_child

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
POLL_S = 0.05


class NodeProcess:
    def __init__(self, args: Sequence[str], *, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.state_dir = workdir / "state"
        self.log_path = workdir / f"node-{self.port}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, **(env or {})}
        argv = [
            sys.executable, "-m", "meshnet_gguf", "serve", "--port", str(self.port),
            "--state-dir", str(self.state_dir), "--download-dir", str(workdir / "models"), *args,
        ]  # fmt: skip
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)

    def health(self) -> httpx.Response | None:
        try:
            return httpx.get(self.url + "/health", timeout=2.0)
        except httpx.HTTPError:
            return None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict:
        return self.wait_state("ready", timeout)

    def wait_state(self, state: str, timeout: float = READY_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"node exited with {self.proc.returncode} waiting for {state}:\n{self.log_text()[-3000:]}")
            response = self.health()
            if response is not None:
                last = response.json()
                if last.get("state") == state:
                    return last
            time.sleep(POLL_S)
        raise AssertionError(f"node not {state!r} after {timeout} s (last health {last}):\n{self.log_text()[-3000:]}")

    def llama_pid(self) -> int | None:
        pidfile = self.state_dir / PIDFILE_NAME
        try:
            import json

            return int(json.loads(pidfile.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait_exit(self, timeout: float = STOP_TIMEOUT_S) -> int:
        return self.proc.wait(timeout=timeout)

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        reap_stale_child(self.state_dir / PIDFILE_NAME)
        self._log.close()


# What the `start_node` fixture (tests/conftest.py) gives a test: start_node(*serve_args, env=..., workdir=...).
StartNode = Callable[..., NodeProcess]
