"""Step 8 of the pipeline: serve with the fastest installed llama-server that runs the model.

    the operator's choice, a build still to make, a pool ─► the launch as planned; nothing measured
    the other installed llama-servers that run the model (`runnable.every_runnable_installed`)
      ─► none: the launch as planned ("the only one"); nothing measured
      ─► each planned for the same model files on the hardware it sees ─► `llama/speed_choice` decides

Each candidate gets its own plan (a CPU build sees no GPU, a build's flags differ), for the model
steps 4 and 5 chose, so the figures compare the same files. The choice's figures are measured by
`llama/speed_choice` with the node's own supervisor, warm-up and speed probe; this module only plans
the candidates and keys their figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.hardware.report import HardwareReport
from meshnet_gguf.llama.binary import BINARY_ENV_VAR, BinaryInfo, chosen_by_operator
from meshnet_gguf.llama.child import ChildSpec
from meshnet_gguf.llama.runnable import RunnableBinary, every_runnable_installed
from meshnet_gguf.llama.speed_choice import BinaryCandidate, BinaryChoice, Measured, choose_fastest, speed_key, unmeasured
from meshnet_gguf.llama.speed_probe import DEFAULT_SPEED_PROBE
from meshnet_gguf.llama.supervisor import SupervisorPolicy
from meshnet_gguf.llama.warmup import warmup_for


class _Planned(Protocol):
    """What this step reads of a launch (`pipeline.PreparedLaunch`) and sets on it."""

    binary: BinaryInfo
    hardware: HardwareReport | None
    model_path: Path
    child: ChildSpec
    notes: list[str]
    binary_choice: BinaryChoice | None

    @property
    def cpu_only(self) -> bool: ...

    @property
    def model_files(self) -> Sequence[Path]: ...


PreparedLaunch = TypeVar("PreparedLaunch", bound=_Planned)
# Settings read $MESHNET_LLAMA_SERVER into `llama_server` as they read --llama-server: one is as good as the other.
OPERATORS_CHOICE = f"the operator's choice (--llama-server or ${BINARY_ENV_VAR}): nothing measured"
ONLY_ONE = "the only installed llama-server that runs this model: nothing to measure"
MEASURING_OFF = "not measured: measure_speed is off (MESHNET_MEASURE_SPEED)"
NOT_PLANNED = "not measured: no plan with it here"


def fastest_launch(
    launch: PreparedLaunch,
    settings: NodeSettings,
    runnable: RunnableBinary,
    *,
    plan_for: Callable[[RunnableBinary, HardwareReport], PreparedLaunch],
    hardware_for: Callable[[BinaryInfo], HardwareReport],
    measure: bool,
) -> PreparedLaunch:
    """`launch` (planned with today's first choice, `runnable`) or the launch of a faster installed llama-server;
    either way with `binary_choice` saying which and why. `plan_for` plans another for the same model files."""
    why = _nothing_to_measure(settings, runnable)
    if why is not None:
        launch.binary_choice = unmeasured(launch.binary, why)
        return launch
    others = [other for other in every_runnable_installed(runnable.probe.types) if other.binary.path != launch.binary.path]
    if not others:
        launch.binary_choice = unmeasured(launch.binary, ONLY_ONE)
        return launch
    if not settings.measure_speed:  # nothing measured, so nothing planned either: no start-up time spent
        off = tuple(Measured(binary, why_not=MEASURING_OFF) for binary in (launch.binary, *(o.binary for o in others)))
        launch.binary_choice = BinaryChoice(launch.binary, f"the first in order that runs this model; {MEASURING_OFF}", off)
        return launch
    launches: list[PreparedLaunch | None] = [launch]
    candidates = [_candidate(launch, settings, launch.binary, launch.hardware)]
    for other in others:
        hardware = hardware_for(other.binary)
        try:
            planned: PreparedLaunch | None = plan_for(other, hardware)
        except RuntimeError as exc:  # NodeSetupError, DoesNotFit: its plan here refuses the model
            planned, unplanned = None, f"{NOT_PLANNED} ({str(exc).splitlines()[0]})"
        else:
            unplanned = None
        launches.append(planned)
        candidates.append(_candidate(planned, settings, other.binary, hardware, unplanned))
    # A dry run's model may not be downloaded yet: nothing to run then, only the figures kept.
    index, choice = choose_fastest(candidates, measure=measure and all(path.is_file() for path in launch.model_files))
    chosen = launches[index] or launch
    chosen.binary_choice = choice
    if chosen is not launch:
        # What steps 1 to 7 noted of the model (download, fit) holds for every candidate's launch.
        chosen.notes[:0] = [note for note in launch.notes if note not in chosen.notes]
    return chosen


def _nothing_to_measure(settings: NodeSettings, runnable: RunnableBinary) -> str | None:
    if chosen_by_operator(settings.llama_server):
        return OPERATORS_CHOICE
    if runnable.build_needed:
        return "serving builds one for this machine first: nothing measured"
    if settings.pool_workers:
        return "with --pool-worker the first in order that runs this model (the workers were checked against its RPC protocol): nothing measured"
    return None


def _candidate(
    launch: PreparedLaunch | None,
    settings: NodeSettings,
    binary: BinaryInfo,
    hardware: HardwareReport | None,
    unplanned: str | None = None,
) -> BinaryCandidate:
    """One candidate: its launch for the model (as the supervisor runs it, with the speed probe on) and its cache key."""
    devices: list[str] = []
    if hardware is not None:
        devices += [f"gpu {gpu.vendor} {gpu.name} {gpu.memory_total_bytes}" for gpu in hardware.gpus]
        devices += [f"device {d.name} {d.description} {d.total_bytes}" for d in hardware.llama_devices or ()]
    options = {
        "parallel": settings.parallel, "ctx_size": settings.ctx_size, "n_gpu_layers": settings.n_gpu_layers,
        "llama_args": list(settings.llama_args), "warmup": settings.warmup,
    }  # fmt: skip
    if launch is None:
        return BinaryCandidate(binary, None, speed_key(binary, (), devices, options), unplanned=unplanned)
    policy = SupervisorPolicy.from_settings(settings, warmup_for(launch.cpu_only) if settings.warmup else None, DEFAULT_SPEED_PROBE)
    return BinaryCandidate(binary, launch.child, speed_key(binary, launch.model_files, devices, options), policy)


__all__ = ["MEASURING_OFF", "ONLY_ONE", "OPERATORS_CHOICE", "fastest_launch"]
