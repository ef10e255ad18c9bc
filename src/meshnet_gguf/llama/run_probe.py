"""Can this llama-server run this model on this machine? Asked in about a second, answered once.

A prebuilt llama.cpp binary is compiled for some CPU. On an older one it dies
with SIGILL the first time a kernel uses an instruction the CPU lacks, and
which kernels do depends on the model's weight types and on the CPU:

- the bundled wheel on AMD Zen 4 (AVX-512 but no AVX-VNNI): quantized models
  die, float ones run;
- the same wheel on a CPU with AVX2 but no AVX-512 (Ryzen desktops, Zen 2/3
  servers): every model dies, float ones too.

So the question is never "quantized or not" but "this binary, these weight
types, this CPU". The probe writes a tiny model holding the model's weight
types (one layer each; types the `gguf` package cannot write are stood in for
by Q8_0, whose integer dot-product kernels they share), starts the binary on
it, loads it, runs one completion, and while it is up asks whether it serves a
web UI. The answer is kept on disk per binary (path, size, mtime), CPU
(model name and flags) and weight types, so a second `serve` asks nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import httpx

from meshnet_gguf.common.atomic_file import write_atomically
from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.models.tiny_model import WRITABLE_TYPES, TinyModelSpec, write_tiny_model

log = logging.getLogger(__name__)

# The probe model loads in well under a second; a minute only catches a wedged binary.
PROBE_TIMEOUT_S = 60.0
PROBE_POLL_S = 0.05
PROBE_REQUEST_TIMEOUT_S = 10.0
# What a model whose weight types we cannot write is probed with: K- and I-quants run
# llama.cpp's integer dot products, which Q8_0 exercises with the same instructions.
QUANTIZED_STAND_IN = "Q8_0"
# What every probe holds besides the model's types: the norms and embeddings are F32.
ALWAYS_PROBED = ("F32",)
FLOAT_TYPES = ("F32", "F16", "BF16")
# What a binary that dies is probed for when no model is known yet (`doctor`, `worker`,
# `build-llama-server --if-needed`): the float and the quantized kernels of the demo.
DEFAULT_PROBE_TYPES = ("F16", "Q8_0")
# How a binary built for other instructions dies: an illegal instruction (or, on some kernels, a bus error).
CPU_DEATHS = frozenset({"SIGILL", "SIGBUS"})
PROBE_CACHE_FILE = "llama-probes.json"
# The cache is rewritten whole; a few hundred entries (binaries x CPUs x type sets) is years of use.
PROBE_CACHE_MAX_ENTRIES = 256
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class RunProbe:
    """What one probe of one binary on one set of weight types found."""

    runs: bool
    # Set when it died: the signal's name ("SIGILL") or "exit N".
    died_with: str | None = None
    # Whether llama-server served its web UI at `/` (None: not asked, it died first).
    web_ui: bool | None = None
    types: tuple[str, ...] = ()

    @property
    def illegal_instruction(self) -> bool:
        return self.died_with == "SIGILL"

    def problem(self, binary: BinaryInfo) -> str | None:
        """One sentence for a log, a plan note or a doctor finding; None when it runs."""
        if self.runs:
            return None
        kinds = ", ".join(t for t in self.types if t not in ALWAYS_PROBED) or ", ".join(self.types) or "float"
        if self.illegal_instruction:
            return (
                f"llama-server {binary.path} (llama.cpp {binary.build or 'build unknown'}) dies with SIGILL on this CPU "
                f"running {kinds} weights: it was compiled for instructions this processor lacks"
            )
        return f"llama-server {binary.path} cannot run a tiny {kinds} model here ({self.died_with})"


def probe_types(tensor_types: Iterable[str]) -> tuple[str, ...]:
    """The types a probe model holds to exercise the same kernels as a model with these weight types."""
    wanted = set(ALWAYS_PROBED)
    for name in tensor_types:
        wanted.add(name if name in WRITABLE_TYPES else QUANTIZED_STAND_IN)
    return tuple(sorted(wanted))


def model_weight_types(file_type: int | None, tensor_types: Iterable[int]) -> tuple[str, ...]:
    """The ggml type names of a model's tensors (from its header), for `probe_types`."""
    names = set()
    for value in tensor_types:
        try:
            names.add(gguf.GGMLQuantizationType(value).name)
        except ValueError:
            names.add(QUANTIZED_STAND_IN)  # a type this gguf package does not know is surely quantized
    if not names and file_type is not None:
        names.add(QUANTIZED_STAND_IN if file_type not in (0, 1, 32) else "F16")  # ALL_F32, MOSTLY_F16, MOSTLY_BF16
    return tuple(sorted(names))


def cpu_fingerprint(cpuinfo: Path = CPUINFO) -> str:
    """This CPU as the kernels see it: its model name and instruction flags."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return "unknown"
    wanted = {"model name", "flags"}
    seen: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in wanted and key not in seen:
            seen[key] = " ".join(sorted(value.split())) if key == "flags" else value.strip()
    return hashlib.sha256(json.dumps(seen, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_path(env: Mapping[str, str] | None = None) -> Path:
    """`$XDG_CACHE_HOME/meshnet/llama-probes.json` (usually `~/.cache/meshnet/`)."""
    env = os.environ if env is None else env
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshnet" / PROBE_CACHE_FILE


class ProbeCache:
    """Probe answers on disk, keyed by binary, CPU and types. A lost or torn file only means probing again."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = default_cache_path() if path is None else path

    @staticmethod
    def key(binary: BinaryInfo, types: tuple[str, ...], cpu: str) -> str:
        try:
            stat = binary.path.stat()
            identity = f"{binary.path}|{stat.st_size}|{stat.st_mtime_ns}"
        except OSError:
            identity = str(binary.path)
        return f"{identity}|{cpu}|{','.join(types)}"

    def _read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> RunProbe | None:
        entry = self._read().get(key)
        if not isinstance(entry, dict):
            return None
        try:
            return RunProbe(
                runs=bool(entry["runs"]), died_with=entry.get("died_with"), web_ui=entry.get("web_ui"), types=tuple(entry.get("types", ()))
            )
        except (KeyError, TypeError):
            return None

    def put(self, key: str, probe: RunProbe) -> None:
        entries = self._read()
        entries.pop(key, None)
        entries[key] = asdict(probe)
        kept = dict(list(entries.items())[-PROBE_CACHE_MAX_ENTRIES:])
        try:
            write_atomically(self.path, json.dumps(kept, indent=1))
        except OSError as exc:  # a read-only home: the answer is still right, just not kept
            log.debug("cannot keep the probe's answer in %s: %s", self.path, exc)


def probe_run(binary: BinaryInfo, types: Iterable[str] = DEFAULT_PROBE_TYPES, *, cache: ProbeCache | None = None) -> RunProbe:
    """Whether `binary` runs a model with these weight types here: from the cache, else probed (about a second)."""
    wanted = probe_types(types)
    cache = ProbeCache() if cache is None else cache
    key = ProbeCache.key(binary, wanted, cpu_fingerprint())
    known = cache.get(key)
    if known is not None:
        return known
    started = time.monotonic()
    probe = _run_tiny_model(binary, wanted)
    log.debug("probed %s on %s in %.1f s: %s", binary.path, ",".join(wanted), time.monotonic() - started, probe)
    if not probe.runs and probe.died_with not in CPU_DEATHS:
        # It died of something else (a missing library, a stand-in that serves no model): not this CPU's
        # verdict. Launching says what is wrong, with the child's own output; nothing is kept.
        log.debug("the run probe of %s is inconclusive (%s); not refusing it", binary.path, probe.died_with)
        return RunProbe(runs=True, types=wanted)
    # Kept: a death by this CPU, or a model served (and `/` asked). A wedge or no start is asked again next time.
    if not probe.runs or probe.web_ui is not None:
        cache.put(key, probe)
    return probe


def probe_fresh(binary: BinaryInfo, types: Iterable[str] = DEFAULT_PROBE_TYPES) -> RunProbe:
    """One probe of a binary not yet installed (a fetched release), neither forgiven nor remembered: it must
    serve the tiny model, so a death of any kind, a start that fails or no answer in time refuses it."""
    wanted = probe_types(types)
    probe = _run_tiny_model(binary, wanted)
    if probe.runs and probe.web_ui is None:
        return RunProbe(runs=False, died_with=f"did not start or answer within {PROBE_TIMEOUT_S:.0f} s", types=wanted)
    return probe


def remember_probe(binary: BinaryInfo, types: Iterable[str], probe: RunProbe, *, cache: ProbeCache | None = None) -> None:
    """Keep a probe's answer for `binary` (a fresh binary probed before it was moved into place, same file)."""
    cache = ProbeCache() if cache is None else cache
    cache.put(ProbeCache.key(binary, probe_types(types), cpu_fingerprint()), probe)


def _run_tiny_model(binary: BinaryInfo, types: tuple[str, ...]) -> RunProbe:
    with tempfile.TemporaryDirectory(prefix="meshnet-run-probe-") as tmp:
        # The file type names its most demanding kind: a quantized one when there is one.
        main = next((t for t in types if t not in FLOAT_TYPES), types[-1])
        spec = TinyModelSpec(n_layers=max(2, len(types)), weight_type=main, layer_types=types)
        model = write_tiny_model(Path(tmp) / "probe.gguf", spec)
        port = free_local_port()
        argv = [str(binary.path), "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--parallel", "1"]
        try:
            proc = subprocess.Popen(argv, env=binary.environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as exc:  # no binary to probe (doctor planning without one): nothing to conclude
            log.debug("the run probe of %s could not start it: %s", binary.path, exc)
            return RunProbe(runs=True, types=types)
        try:
            return _watch(proc, f"http://127.0.0.1:{port}", types)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _died(proc: subprocess.Popen[bytes], types: tuple[str, ...], web_ui: bool | None = None) -> RunProbe:
    code = proc.returncode
    how = signal.Signals(-code).name if code < 0 and -code in signal.Signals._value2member_map_ else f"exit {code}"
    return RunProbe(runs=False, died_with=how, web_ui=web_ui, types=types)


def _watch(proc: subprocess.Popen[bytes], url: str, types: tuple[str, ...]) -> RunProbe:
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    with httpx.Client(timeout=PROBE_REQUEST_TIMEOUT_S) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return _died(proc, types)
            try:
                if client.get(url + "/health").status_code == 200:
                    # Warm-up ran at load; one real completion exercises the decode kernels too.
                    client.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2})
                    # llama-server serves its web UI only to clients that take gzip.
                    web_ui = client.get(url + "/", headers={"Accept-Encoding": "gzip"}).status_code == 200
                    time.sleep(PROBE_POLL_S)
                    if proc.poll() is not None:
                        return _died(proc, types, web_ui)
                    return RunProbe(runs=True, web_ui=web_ui, types=types)
            except httpx.HTTPError:
                pass
            time.sleep(PROBE_POLL_S)
    log.warning("the run probe of %s did not finish in %.0f s; assuming it runs", proc.args, PROBE_TIMEOUT_S)
    return RunProbe(runs=True, types=types)
