"""How far llama-server has got loading its model, from its log and its I/O counters.

A 100 GB model takes minutes to load; an operator (and systemd's STATUS line)
should see movement, not silence. llama-server (b10434) prints no progress
dots, so the log gives phases only:

- default verbosity: `load_model: loading model '...'`, then nothing until
  `llama threadpool init` (tensors are in memory by then), `load_model:
  initializing, n_slots = ...`, `llama_server: model loaded`;
- `-lv 4` adds `loaded meta data with K key-value pairs and N tensors`,
  `print_info: file size = X MiB`, `load_tensors: loading model tensors`,
  the buffer-size lines, `llama_context: constructing`, `warming up`.

The bytes come from the child's counters (`observe_io`): with
`--load-mode none` the model is read with read(), which `read_chars` counts;
with mmap the pages show up as file-backed resident memory (`shared`). The
larger of the two, against the model's size, is the fraction of the tensor
phase done. The fraction is None while nothing measurable is known, and never
goes backwards.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from meshnet_gguf.common.units import format_binary_bytes
from meshnet_gguf.models.gguf_names import sibling_shards

# Share of the whole load given to each phase, so one number can rise
# steadily: reading tensors dominates any big load; the rest is short.
TENSORS_START = 0.05
TENSORS_END = 0.90
_PHASE_FLOOR = {
    "context": 0.92,
    "warmup": 0.95,
    "slots": 0.98,
    "ready": 1.0,
}
# Byte counters overshoot a little (metadata is read twice, libraries are
# mapped); stay below the next phase until the log says it began.
_TENSOR_CAP = TENSORS_END - 0.01

_MIB = 1024 * 1024
_UNITS = {"KiB": 1024, "MiB": _MIB, "GiB": 1024 * _MIB, "TiB": 1024 * 1024 * _MIB}

_META = re.compile(r"loaded meta data with (\d+) key-value pairs and (\d+) tensors")
_FILE_SIZE = re.compile(r"print_info: file size\s*=\s*([\d.]+) (KiB|MiB|GiB|TiB)")
_BUFFER = re.compile(r"(\S+) model buffer size\s*=\s*([\d.]+) (KiB|MiB|GiB|TiB)")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_DOTS = re.compile(r"^\.+$")

# (pattern, phase, human description). Checked in order; first match wins.
# Older llama.cpp builds spell a few of these `llm_load_*`.
_PHASES: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"(load_model|main): loading model"), "metadata", "reading model metadata"),
    (re.compile(r"fitting params to device memory"), "fitting", "fitting the model to device memory"),
    (re.compile(r"(load_tensors|llm_load_tensors): loading model tensors"), "tensors", "loading tensors"),
    (re.compile(r"llama_context: constructing llama_context|llama threadpool init"), "context", "creating context"),
    (re.compile(r"warming up the model"), "warmup", "warming up"),
    (re.compile(r"load_model: initializing, n_slots"), "slots", "initializing slots"),
    (re.compile(r"llama_server: model loaded|main: model loaded"), "ready", "model loaded"),
)
_PHASE_ORDER = ["starting", "metadata", "fitting", "tensors", "context", "warmup", "slots", "ready"]


@dataclass(frozen=True)
class LoadProgress:
    """One view of the load. `fraction` is 0..1 of the whole load, None while unknown."""

    fraction: float | None
    phase: str
    detail: str
    elapsed_s: float = 0.0

    def describe(self) -> str:
        """One line for a console or systemd's STATUS: `loading tensors 43% (...), 12 s`."""
        percent = f" {self.fraction * 100:.0f}%" if self.fraction is not None else ""
        return f"{self.detail}{percent}, {self.elapsed_s:.0f} s"


def model_file_bytes(first_shard: Path) -> int | None:
    """Bytes llama-server will read for this model: every shard of a split, or the one file."""
    try:
        return sum(shard.stat().st_size for shard in sibling_shards(first_shard))
    except OSError:
        return None


class LoadProgressReader:
    """Feed it every child log line (and, when you can, the child's I/O counters)."""

    def __init__(self, model_bytes: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started = clock()
        self._model_bytes = model_bytes if model_bytes and model_bytes > 0 else None
        self._phase = "starting"
        self._description = "starting llama-server"
        self._fraction: float | None = None
        self._tensors: int | None = None
        self._loaded_bytes = 0
        self._io_baseline: tuple[int, int] | None = None
        self._gpu_buffers: list[str] = []
        self._offloaded: str | None = None

    @property
    def current(self) -> LoadProgress:
        return LoadProgress(self._fraction, self._phase, self._detail(), self._clock() - self._started)

    @property
    def done(self) -> bool:
        return self._phase == "ready"

    def feed(self, line: str) -> LoadProgress | None:
        """Take one log line; returns the new progress when it moved, else None."""
        before = self._key()
        text = line.strip()
        if _DOTS.match(text):
            # Builds that print a dot per percent of tensors loaded.
            self._enter("tensors")
            self._set_tensor_share(len(text) / 100)
        elif (meta := _META.search(text)) is not None:
            self._tensors = int(meta.group(2))
        elif (size := _FILE_SIZE.search(text)) is not None and self._model_bytes is None:
            self._model_bytes = int(float(size.group(1)) * _UNITS[size.group(2)])
        elif (buffer := _BUFFER.search(text)) is not None:
            self._gpu_buffers.append(f"{buffer.group(1)} {buffer.group(2)} {buffer.group(3)}")
        elif (offloaded := _OFFLOADED.search(text)) is not None:
            self._offloaded = f"{offloaded.group(1)}/{offloaded.group(2)} layers offloaded"
        else:
            for pattern, phase, description in _PHASES:
                if pattern.search(text):
                    self._enter(phase, description)
                    break
        return self.current if self._key() != before else None

    def observe_io(self, read_chars: int, mapped_bytes: int) -> LoadProgress | None:
        """Take the child's cumulative read() bytes and file-backed resident bytes.

        The first observation is the baseline (shared libraries are mapped
        before the model is), so call this from the moment the child starts.
        """
        before = self._key()
        if self._io_baseline is None:
            self._io_baseline = (read_chars, mapped_bytes)
        loaded = max(read_chars - self._io_baseline[0], mapped_bytes - self._io_baseline[1], 0)
        self._loaded_bytes = max(self._loaded_bytes, loaded)
        if self._phase == "tensors" and self._model_bytes:
            self._set_tensor_share(self._loaded_bytes / self._model_bytes)
        return self.current if self._key() != before else None

    def observe_process(self, pid: int) -> LoadProgress | None:
        """`observe_io` from a live process's counters (Linux). None when it cannot be read."""
        try:
            process = psutil.Process(pid)
            with process.oneshot():
                read_chars = int(getattr(process.io_counters(), "read_chars", 0))
                mapped = int(getattr(process.memory_info(), "shared", 0))
        except (psutil.Error, AttributeError, NotImplementedError):
            return None
        return self.observe_io(read_chars, mapped)

    # --- internals -----------------------------------------------------------

    def _key(self) -> tuple[str, float | None, int | None, int]:
        # Progress "moves" when the phase, the shown percent or the facts change; not on every byte.
        shown = round(self._fraction, 2) if self._fraction is not None else None
        return (self._phase, shown, self._tensors, len(self._gpu_buffers))

    def _enter(self, phase: str, description: str | None = None) -> None:
        if _PHASE_ORDER.index(phase) < _PHASE_ORDER.index(self._phase):
            return  # a late or repeated line never moves the load backwards
        if phase != self._phase:
            self._phase = phase
            self._description = description or phase
        floor = _PHASE_FLOOR.get(phase)
        if floor is not None:
            self._raise_fraction(floor)
        elif phase == "tensors" and self._model_bytes and self._loaded_bytes:
            self._set_tensor_share(self._loaded_bytes / self._model_bytes)

    def _set_tensor_share(self, share: float) -> None:
        share = min(max(share, 0.0), 1.0)
        self._raise_fraction(min(TENSORS_START + share * (TENSORS_END - TENSORS_START), _TENSOR_CAP))

    def _raise_fraction(self, value: float) -> None:
        if self._fraction is None or value > self._fraction:
            self._fraction = value

    def _detail(self) -> str:
        parts: list[str] = []
        if self._phase == "tensors":
            if self._model_bytes and self._loaded_bytes:
                loaded = min(self._loaded_bytes, self._model_bytes)
                parts.append(f"{format_binary_bytes(loaded)} of {format_binary_bytes(self._model_bytes)}")
            elif self._model_bytes:
                parts.append(format_binary_bytes(self._model_bytes))
            if self._tensors:
                parts.append(f"{self._tensors} tensors")
        if self._offloaded and self._phase != "starting":
            parts.append(self._offloaded)
        if self._gpu_buffers and self._phase != "tensors":
            parts.append("buffers: " + ", ".join(self._gpu_buffers))
        return self._description + (f" ({'; '.join(parts)})" if parts else "")
