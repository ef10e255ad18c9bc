"""Which installed llama-server serves this model fastest here: each measured once, the answer kept.

    the operator's choice, or only one installed build runs the model ─► that one; nothing measured
    several ─► each one's figures from the cache, else its own launch measured once (the supervisor's:
               load, warm-up, speed probe, stopped) ─► the one with the least expected request time
    one that cannot be measured (its run dies, hangs or gives no timings) ─► today's order: the first
               that runs the model (one whose run died is passed over), said once in the log

**The score** is `expected_request_s`: the time a typical request takes from its prompt's arrival to
its last token, `TYPICAL_PROMPT_TOKENS / prefill + TYPICAL_ANSWER_TOKENS / decode`. Neither rate
alone decides what a client waits for: builds differ by different factors in each (a CUDA and a
Vulkan build of the same model differ 1.01x in prefill and 1.11x in decode on one card, 1.37x and
1.33x on another weight type), and a CPU build can decode near a small GPU yet prefill many times
slower. The rates are those the speed probe measured at its longest prompt: the nearest to a typical
one (its short prompts mostly time llama-server's per-request overhead).

The figures are the probe's own (`speed_probe.measure_speed`, through `Supervisor`), so a choice is
measured exactly as the node measures itself before `ready`. They are kept on disk per binary (path,
size, mtime, build), model (each file's path, size and mtime), box (CPU model and flags, the GPUs and
devices the binary sees) and the operator's llama-server options, so a second start measures nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from meshnet_gguf.common.atomic_file import write_atomically
from meshnet_gguf.contract.protocol import NodeCapability, NodeState
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.child import ChildFailed, ChildSpec
from meshnet_gguf.llama.run_probe import cpu_fingerprint, default_cache_path
from meshnet_gguf.llama.supervisor import Supervisor, SupervisorPolicy

log = logging.getLogger(__name__)

# A typical request, for the score: the prompt and answer lengths this project measures its long
# requests with (a chat with some history, an answer of a few paragraphs; bench/ and the tests).
TYPICAL_PROMPT_TOKENS = 1500
TYPICAL_ANSWER_TOKENS = 300
SPEED_CACHE_FILE = "llama-speeds.json"
# The cache is rewritten whole; a few hundred entries (binaries x models x boxes) is years of use.
SPEED_CACHE_MAX_ENTRIES = 256
# One candidate's whole measuring run: the load of a large model from a slow disk (minutes), its warm-up
# and the speed probe (its own 30 s bound). A load that prints nothing is cut sooner by the supervisor's
# load stall bound; this only ends a run wedged in a way that bound cannot see.
MEASURE_RUN_TIMEOUT_S = 900.0
# Kept in the cache for a run that gave no usable timings (an embedding model, a build without them):
# asking again at every start would cost a whole load for the same answer.
NO_FIGURES = "its measuring run gave no usable timings"
# Why a candidate has no figures in a dry run (`serve --dry-run`, `doctor`): serving measures it.
NOT_MEASURED_YET = "not measured yet"


class MeasureFailed(RuntimeError):
    """One candidate's measuring run did not give figures; the message says why, in a few words."""

    def __init__(self, message: str, *, died: bool = False, keep: bool = False) -> None:
        super().__init__(message)
        self.died = died  # the binary exited or crashed with this model: not one to fall back on
        self.keep = keep  # the same answer would come again: kept in the cache


def expected_request_s(capability: NodeCapability | None) -> float | None:
    """The score: seconds a typical request takes with these figures (lower is faster); None without figures."""
    if capability is None or not capability.prefill_tokens_per_s or not capability.decode_tokens_per_s:
        return None
    prefill = max(capability.prefill_tokens_per_s, key=lambda p: p.ctx_tokens).tokens_per_s
    decode = max(capability.decode_tokens_per_s, key=lambda p: p.ctx_tokens).tokens_per_s
    return TYPICAL_PROMPT_TOKENS / prefill + TYPICAL_ANSWER_TOKENS / decode


@dataclass(frozen=True)
class BinaryCandidate:
    """One installed llama-server that runs the model, with its launch for it here (`child`) and its cache key;
    `child` None: it could not be planned (`unplanned` says why)."""

    binary: BinaryInfo
    child: ChildSpec | None
    key: str
    policy: SupervisorPolicy | None = None
    unplanned: str | None = None


@dataclass(frozen=True)
class Measured:
    """What is known of one candidate's speed: its figures, or why there are none."""

    binary: BinaryInfo
    capability: NodeCapability | None = None
    cached: bool = False  # the figures came from an earlier start
    why_not: str | None = None  # set when there are no figures
    died: bool = False

    @property
    def expected_s(self) -> float | None:
        return expected_request_s(self.capability)

    def figures(self) -> str:
        if self.capability is None:
            return self.why_not or "not measured"
        prefill = max(self.capability.prefill_tokens_per_s, key=lambda p: p.ctx_tokens)
        decode = max(self.capability.decode_tokens_per_s, key=lambda p: p.ctx_tokens)
        return (
            f"prefill {prefill.tokens_per_s:,.0f} tokens/s, decode {decode.tokens_per_s:,.1f} tokens/s (at {prefill.ctx_tokens} "
            f"tokens), a typical request {self.expected_s:.3g} s{' (measured at an earlier start)' if self.cached else ''}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.binary.path),
            "source": self.binary.source,
            "build": self.binary.build,
            "capability": self.capability.model_dump(mode="json") if self.capability is not None else None,
            "expected_request_s": round(self.expected_s, 4) if self.expected_s is not None else None,
            "cached": self.cached,
            "not_measured": self.why_not,
        }


@dataclass(frozen=True)
class BinaryChoice:
    """Which llama-server serves, how it was chosen, and what was measured of each installed one."""

    chosen: BinaryInfo
    how: str  # one sentence: "fastest of 2 measured", "the operator's (--llama-server): nothing measured", ...
    measured: tuple[Measured, ...] = ()
    by_measurement: bool = False

    def lines(self) -> list[str]:
        """For `serve --dry-run`, `doctor` and the log: the choice, then every candidate with its figures."""
        lines = [f"{self.chosen.path}: {self.how}"]
        for entry in self.measured:
            mark = "*" if entry.binary.path == self.chosen.path else "-"
            build = f", llama.cpp {entry.binary.build}" if entry.binary.build else ""
            lines.append(f"  {mark} {entry.binary.path} ({entry.binary.source}{build}): {entry.figures()}")
        return lines

    def describe(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict[str, Any]:
        """For /status.json and `doctor --json`."""
        return {
            "chosen": str(self.chosen.path),
            "how": self.how,
            "by_measurement": self.by_measurement,
            "score": f"expected seconds of a typical request: {TYPICAL_PROMPT_TOKENS} prompt tokens / prefill + "
            f"{TYPICAL_ANSWER_TOKENS} answer tokens / decode (lower is faster)",
            "candidates": [entry.to_dict() for entry in self.measured],
        }


def unmeasured(binary: BinaryInfo, how: str) -> BinaryChoice:
    """A choice nothing was measured for (the operator's, the only one, a pool's): `how` says why."""
    return BinaryChoice(binary, how)


# --------------------------------------------------------------------------- the cache


def speed_key(binary: BinaryInfo, model_files: Iterable[Path], devices: Iterable[str], options: Mapping[str, object]) -> str:
    """The cache key of one candidate's figures: binary, model files, box (CPU and the devices it sees) and options."""

    def identity(path: Path) -> str:
        try:
            stat = path.stat()
        except OSError:
            return str(path)
        return f"{path}|{stat.st_size}|{stat.st_mtime_ns}"

    parts = {
        "binary": f"{identity(binary.path)}|{binary.build}",
        "model": [identity(path) for path in model_files],
        "box": [cpu_fingerprint(), *sorted(devices)],
        "options": {k: options[k] for k in sorted(options)},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def default_speed_cache_path(env: Mapping[str, str] | None = None) -> Path:
    """Beside the run probe's answers: `$XDG_CACHE_HOME/meshnet/llama-speeds.json`."""
    return default_cache_path(env).with_name(SPEED_CACHE_FILE)


class SpeedCache:
    """Measured figures on disk, by `speed_key`. A lost or torn file only means measuring again."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = default_speed_cache_path() if path is None else path

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> NodeCapability | str | None:
        """The figures, the reason kept for a run without them, or None when nothing is known."""
        entry = self._read().get(key)
        if not isinstance(entry, dict):
            return None
        if isinstance(entry.get("no_figures"), str):
            return entry["no_figures"]
        try:
            return NodeCapability.model_validate(entry.get("capability"))
        except ValueError:
            return None

    def put(self, key: str, answer: NodeCapability | str) -> None:
        entries = self._read()
        entries.pop(key, None)
        entries[key] = {"no_figures": answer} if isinstance(answer, str) else {"capability": answer.model_dump(mode="json")}
        kept = dict(list(entries.items())[-SPEED_CACHE_MAX_ENTRIES:])
        try:
            write_atomically(self.path, json.dumps(kept, indent=1))
        except OSError as exc:  # a read-only home: the figures are still right, just not kept
            log.debug("cannot keep the measured speeds in %s: %s", self.path, exc)


# --------------------------------------------------------------------------- measuring one launch


class _ReadyOrEnded:
    """A supervisor listener: tells when the child reached `ready` (measured) or gave up."""

    def __init__(self) -> None:
        self.settled = anyio.Event()

    def child_line(self, line: str) -> None:
        pass

    def child_state(self, state: NodeState, detail: str | None, pid: int | None) -> None:
        if state in ("ready", "failed", "stopped"):
            self.settled.set()


async def measure_launch(child: ChildSpec, policy: SupervisorPolicy, timeout_s: float = MEASURE_RUN_TIMEOUT_S) -> NodeCapability:
    """Run `child` as the node would (the supervisor: load, warm-up, speed probe), stop it once it is ready,
    and return its figures. Its own folder for the socket and pidfile, so a node that runs meanwhile is not
    touched; the child is stopped by its process group whatever happens (the supervisor's own cleanup)."""
    if policy.speed_probe is None:
        raise ValueError("measuring a launch needs the speed probe in its policy")
    with tempfile.TemporaryDirectory(prefix="meshnet-measure-") as folder:
        watch = _ReadyOrEnded()
        supervisor = Supervisor(child, policy, state_dir=Path(folder), listeners=[watch])
        failure: BaseException | None = None
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                nonlocal failure
                try:
                    await supervisor.run()
                except ChildFailed as exc:
                    failure = exc
                finally:
                    watch.settled.set()

            tg.start_soon(run)
            with anyio.move_on_after(timeout_s) as bound:
                await watch.settled.wait()
            ready = supervisor.state == "ready"
            capability = supervisor.capability
            await supervisor.stop()  # the supervisor's loop ends the child: SIGTERM to its group, then SIGKILL
    if bound.cancelled_caught:
        raise MeasureFailed(f"its measuring run did not finish in {timeout_s:.0f} s")
    if failure is not None or not ready:
        reason = str(failure).splitlines()[0] if failure is not None else f"it ended ({supervisor.detail or supervisor.state})"
        raise MeasureFailed(f"its measuring run failed: {reason}", died=True)
    if capability is None:
        raise MeasureFailed(NO_FIGURES, keep=True)
    return capability


# --------------------------------------------------------------------------- the choice


def choose_fastest(
    candidates: Sequence[BinaryCandidate],
    *,
    measure: bool,
    cache: SpeedCache | None = None,
    timeout_s: float = MEASURE_RUN_TIMEOUT_S,
) -> tuple[int, BinaryChoice]:
    """The index of the candidate to serve with (in today's order: `candidates[0]` is the fallback) and the
    choice as it is shown. Figures come from the cache, else (with `measure`) from one measuring run each."""
    assert candidates, "a choice needs at least one candidate"
    cache = SpeedCache() if cache is None else cache
    found = [_figures_of(candidate, cache, measure=measure, timeout_s=timeout_s) for candidate in candidates]
    scored = [(entry.expected_s, i) for i, entry in enumerate(found) if entry.expected_s is not None]
    if len(scored) == len(found):
        best = min(scored)[1]  # a tie keeps today's order
        how = f"the fastest of {len(found)} installed llama-servers that run this model, by a typical request's expected time"
        return best, BinaryChoice(candidates[best].binary, how, tuple(found), by_measurement=True)
    fallback = next((i for i, entry in enumerate(found) if not entry.died), 0)
    if not measure:
        how = "the first in order for now: serving measures each installed one once, then serves with the fastest"
    else:
        how = "the first in order that runs this model: not every installed one could be measured"
        missing = "; ".join(f"{entry.binary.path}: {entry.why_not}" for entry in found if entry.expected_s is None)
        log.warning("llama-server %s chosen by order, not speed: %s (%s)", candidates[fallback].binary.path, how, missing)
    return fallback, BinaryChoice(candidates[fallback].binary, how, tuple(found))


def _figures_of(candidate: BinaryCandidate, cache: SpeedCache, *, measure: bool, timeout_s: float) -> Measured:
    binary = candidate.binary
    if candidate.child is None or candidate.policy is None:
        return Measured(binary, why_not=candidate.unplanned or "it could not be planned")
    known = cache.get(candidate.key)
    if isinstance(known, NodeCapability):
        return Measured(binary, known, cached=True)
    if isinstance(known, str):
        return Measured(binary, why_not=f"{known} (at an earlier start)", cached=True)
    if not measure:
        return Measured(binary, why_not=NOT_MEASURED_YET)
    log.info("measuring %s with this model, once (the figures are kept in %s)", binary.describe(), cache.path)
    try:
        capability = anyio.run(measure_launch, candidate.child, candidate.policy, timeout_s)
    except MeasureFailed as exc:
        if exc.keep:
            cache.put(candidate.key, str(exc))
        return Measured(binary, why_not=str(exc), died=exc.died)
    cache.put(candidate.key, capability)
    entry = Measured(binary, capability)
    log.info("%s: %s", binary.path, entry.figures())
    return entry


__all__ = [
    "MEASURE_RUN_TIMEOUT_S",
    "NOT_MEASURED_YET",
    "TYPICAL_ANSWER_TOKENS",
    "TYPICAL_PROMPT_TOKENS",
    "BinaryCandidate",
    "BinaryChoice",
    "MeasureFailed",
    "Measured",
    "SpeedCache",
    "choose_fastest",
    "expected_request_s",
    "measure_launch",
    "speed_key",
    "unmeasured",
]
