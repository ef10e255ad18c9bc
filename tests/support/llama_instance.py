"""A real llama-server on one model and one backend, for the proof-of-model tests and bench.

`cpu` runs on the CPU backend only (`--device none`); `vulkan` offloads every layer to `device`
(Vulkan0 by default), here lavapipe (llvmpipe), which ggml lists only with `GGML_VK_VISIBLE_DEVICES=0`.
A GPU is named the same way: `Backend("vulkan", device="Vulkan0", vk_visible_devices=None)` leaves
ggml's own device list alone (a real GPU is listed without the variable), `device="CUDA0"` for a CUDA build.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.llama.binary import BinaryInfo

READY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Backend:
    name: str  # "cpu" or "vulkan"
    threads: int = 1
    batch: int = 512  # -b and -ub: how many prompt tokens one step computes
    device: str = "Vulkan0"  # the offload device of a non-cpu backend, as llama-server --list-devices names it
    # GGML_VK_VISIBLE_DEVICES for a non-cpu backend: "0" lists lavapipe; None leaves the variable unset.
    vk_visible_devices: str | None = "0"

    def argv(self) -> list[str]:
        device = ["--device", self.device, "-ngl", "99"] if self.name != "cpu" else ["--device", "none", "-ngl", "0"]
        return [*device, "-t", str(self.threads), "-b", str(self.batch), "-ub", str(self.batch)]

    def env(self, binary: BinaryInfo) -> dict[str, str]:
        env = binary.environment()
        if self.name != "cpu" and self.vk_visible_devices is not None:
            env["GGML_VK_VISIBLE_DEVICES"] = self.vk_visible_devices
        return env


def vulkan_listed(binary: BinaryInfo, backend: Backend | None = None) -> bool:
    """Whether this llama-server lists `backend`'s device (lavapipe's Vulkan0 by default) in its environment."""
    backend = backend or Backend("vulkan")
    out = subprocess.run([str(binary.path), "--list-devices"], check=False, env=backend.env(binary),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    return backend.device in out.stdout + out.stderr


@contextmanager
def llama_instance(binary: BinaryInfo, model: Path, backend: Backend, log: Path) -> Iterator[str]:
    """llama-server on `model` and `backend` at a loopback URL, niced (a shared 2-core box); stopped after."""
    port = free_local_port()
    argv = ["nice", "-n", "19", str(binary.path), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-c", "2048", "-np", "1", "--no-warmup", *backend.argv()]  # fmt: skip
    with log.open("wb") as out:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=backend.env(binary), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if child.poll() is not None:
                raise RuntimeError(f"llama-server exited {child.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not ready in {READY_TIMEOUT_S} s: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
