"""Decide how llama-server runs this model on this box: a pure function from facts to argv and env.

Inputs are model facts (from the GGUF header or the catalog), the hardware
report, the operator's choices and what the binary's `--help` offers; nothing
here touches a file or a process, so every decision is testable from recorded
facts. The memory figures come from `prepare.memory`. The supervisor adds the
binary path, host, port and API key.

Every planned option gives way to the operator: `--ctx-size`,
`--n-gpu-layers`, `--parallel`, and any llama-server option given through
`--llama-arg` replaces the plan's own choice for that option.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.hardware.report import GpuInfo, HardwareReport
from meshnet_gguf.hardware.sources import LlamaDevice
from meshnet_gguf.prepare.memory import (
    DEFAULT_KV_TYPE,
    MIN_CTX_PER_SLOT,
    PROMPT_CACHE_MAX_BYTES,
    PROMPT_CACHE_UNIT_BYTES,
    MemoryUse,
    ModelFacts,
    Placement,
    ctx_floor,
    memory_need_bytes,
    most_layers,
    placement,
    prompt_cache_bytes,
)

# Planned context stops here even when memory allows more: few requests need
# longer, and KV cells and compute buffers beyond it only eat the headroom.
# `--ctx-size` raises it.
MAX_CTX_PER_SLOT = 65536
# llama.cpp pads the KV cache to this many cells.
CTX_GRANULARITY = 256
# llama.cpp's defaults, stated explicitly so the compute-buffer estimate
# (`prepare.memory.COMPUTE_OVERHEAD_BYTES`) stays true whatever a future build defaults to.
BATCH_SIZE = 2048
UBATCH_SIZE = 512
# One backend per GPU, most capable first: CUDA/Metal are the vendors' own;
# on AMD, Vulkan (RADV) decodes faster than ROCm on RDNA3/3.5 APUs like Strix Halo.
BACKEND_PREFERENCE = ("cuda", "metal", "vulkan", "rocm")

# Every llama-server option the node reads or sets, by every spelling the binary
# accepts; the first spelling is the one the plan writes. The one list of them:
# `--llama-arg` is read against it once (`OperatorChoices`), and `_argv` writes from it.
OPTION_SPELLINGS: dict[str, tuple[str, ...]] = {
    "model": ("--model", "-m"),
    "alias": ("--alias", "-a"),
    "ctx": ("--ctx-size", "-c"),
    "gpu_layers": ("--n-gpu-layers", "--gpu-layers", "-ngl"),
    "parallel": ("--parallel", "-np"),
    "device": ("--device", "-dev"),
    "load_mode": ("--load-mode", "--no-mmap", "-lm", "--mmap", "--mlock", "-dio", "--direct-io"),
    "flash_attn": ("--flash-attn", "-fa"),
    "batch": ("--batch-size", "-b"),
    "ubatch": ("--ubatch-size", "-ub"),
    "cache_type_k": ("--cache-type-k", "-ctk"),
    "cache_type_v": ("--cache-type-v", "-ctv"),
    "cache_ram": ("--cache-ram", "-cram"),
}
# `--cache-ram -1`: llama.cpp's spelling of "no limit".
UNLIMITED_CACHE_RAM = -1


class BinaryCapabilities(Protocol):
    """What the plan needs to know of the binary; `binary.BinaryInfo` is one."""

    @property
    def help_text(self) -> str: ...

    def supports(self, flag: str) -> bool: ...


class OperatorChoiceError(ValueError):
    """A `--llama-arg` or node flag the plan cannot use as given; the message says which."""


@dataclass(frozen=True)
class OperatorChoices:
    """What the operator asked of llama-server: the node's own flags and `--llama-arg`, read once.

    `given` names the planned options the operator set through `--llama-arg`
    (the plan then leaves them to the operator's own spelling, later in argv);
    `values` holds what the plan must know of them.
    """

    parallel: int
    ctx_size: int | None = None
    n_gpu_layers: str | None = None
    llama_args: tuple[str, ...] = ()
    given: frozenset[str] = frozenset()
    values: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def read(
        cls, *, parallel: int, ctx_size: int | None = None, n_gpu_layers: str | None = None, llama_args: Sequence[str] = ()
    ) -> OperatorChoices:
        """Read `--llama-arg` against `OPTION_SPELLINGS`. `--llama-arg --parallel N` sets the node's slots
        too: the proxy admits as many requests as llama-server has slots. Raises OperatorChoiceError."""
        given: set[str] = set()
        values: dict[str, str] = {}
        args = list(llama_args)
        for i, arg in enumerate(args):
            flag, eq, inline = arg.partition("=")
            for option, spellings in OPTION_SPELLINGS.items():
                if flag in spellings:
                    given.add(option)
                    following = args[i + 1] if i + 1 < len(args) else ""
                    # Switches (--no-mmap, an old build's bare -fa) take no value; "-1" is a value, not an option.
                    is_value = not following.startswith("-") or following.lstrip("-").isdigit()
                    values[option] = inline if eq else (following if is_value else "")
        if "parallel" in values:
            parallel = _whole_number(values["parallel"], "--llama-arg --parallel", least=1)
        if "cache_ram" in values:
            _whole_number(values["cache_ram"], "--llama-arg --cache-ram", least=UNLIMITED_CACHE_RAM)
        return cls(parallel, ctx_size, n_gpu_layers, tuple(args), frozenset(given), values)

    @property
    def alias(self) -> str | None:
        """The name the operator gave llama-server (`--alias`): clients must then use it too."""
        return self.values.get("alias") or None


def _whole_number(value: str, what: str, *, least: int) -> int:
    try:
        number = int(value)
    except ValueError as exc:
        raise OperatorChoiceError(f"{what} {value!r}: not a whole number") from exc
    if number < least:
        raise OperatorChoiceError(f"{what} must be at least {least}")
    return number


@dataclass(frozen=True)
class LaunchPlan:
    """How llama-server runs the model: its arguments, environment, and the memory they take."""

    argv: tuple[str, ...]  # llama-server arguments, without the binary, host, port and API key
    env: Mapping[str, str]  # additions to the binary's environment
    backend: str  # vulkan | cuda | rocm | metal | cpu
    device: str | None  # llama-server device name, e.g. "Vulkan0"
    gpu_layers: int | str  # layers on the GPU, or "auto" when llama.cpp is left to decide
    total_layers: int
    ctx_size: int
    parallel: int
    load_mode: str  # "mmap" | "no-mmap"
    flash_attn: str  # on | off | auto
    batch_size: int
    ubatch_size: int
    cpu_only: bool
    fits: bool  # whether the estimate says the model fits at all
    memory: MemoryUse  # every allocation, by kind and pool
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def gpu_bytes(self) -> int:
        """Estimated use of the GPU budget."""
        return self.memory.gpu_bytes

    @property
    def host_bytes(self) -> int:
        """Estimated use of RAM outside the GPU budget, the prompt cache included."""
        return self.memory.host_bytes

    def command_line(self, binary: str = "llama-server") -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return " ".join(x for x in (env, shlex.join([binary, *self.argv])) if x)

    def describe(self, *, with_argv: bool = True) -> str:
        if self.cpu_only:
            where = "CPU only"
        else:
            layers = f"{self.gpu_layers}/{self.total_layers} layers" if isinstance(self.gpu_layers, int) else "layers: auto"
            where = f"{self.backend} on {self.device or 'the default device'}, {layers}"
        lines = [
            f"plan: {where}; context {self.ctx_size} tokens over {self.parallel} slots; "
            f"{self.load_mode}; flash attention {self.flash_attn}; batch {self.batch_size}/{self.ubatch_size}",
            f"memory: {self.memory.summary()}" + ("" if self.fits else " (DOES NOT FIT)"),
            f"  = {self.memory.describe()}",
        ]
        lines += [f"  - {r}" for r in self.reasons]
        lines += [f"  ! {w}" for w in self.warnings]
        if with_argv:
            lines.append(f"argv: {self.command_line()}")
        return "\n".join(lines)


def _flag(binary: BinaryCapabilities, *spellings: str) -> str | None:
    return next((s for s in spellings if binary.supports(s)), None)


def _flash_attn_takes_value(binary: BinaryCapabilities) -> bool:
    """Builds since 2025 take `on|off|auto`; older ones had a bare on-switch."""
    for line in binary.help_text.splitlines():
        if "--flash-attn" in line:
            return "auto" in line
    return False


def _parse_gpu_layers(value: str | None) -> int | str | None:
    if value is None or value.strip() == "":
        return None
    value = value.strip().lower()
    if value in ("all", "auto"):
        return value
    try:
        return max(0, int(value))
    except ValueError as exc:
        raise ValueError(f"--n-gpu-layers must be 'all', 'auto' or a number, not {value!r}") from exc


def _pick_device(gpu: GpuInfo) -> LlamaDevice | None:
    if not gpu.llama_devices:
        return None
    rank = {b: i for i, b in enumerate(BACKEND_PREFERENCE)}
    return min(gpu.llama_devices, key=lambda d: rank.get(d.backend, len(rank)))


def _device_gpu(hw: HardwareReport, name: str) -> GpuInfo | None:
    return next((g for g in hw.gpus for d in g.llama_devices if d.name == name), None)


# --------------------------------------------------------------------------- the plan


@dataclass
class _Notes:
    reasons: list[str]
    warnings: list[str]


def _choose_gpu(
    model: ModelFacts,
    hw: HardwareReport,
    operator: OperatorChoices,
    requested: int | str | None,
    kv_per_token: float,
    floor: int,
    notes: _Notes,
) -> tuple[GpuInfo | None, LlamaDevice | None]:
    if "device" in operator.given:
        wanted = operator.values["device"].split(",")[0]
        if wanted.lower() == "none":
            notes.reasons.append("CPU only: --device none set by --llama-arg")
            return None, None
        gpu = _device_gpu(hw, wanted)
        if gpu is None:
            notes.warnings.append(f"device {wanted} (set by --llama-arg) is not in llama-server's device list")
            return None, None
        notes.reasons.append(f"device {wanted} set by --llama-arg")
        return gpu, next(d for d in gpu.llama_devices if d.name == wanted)
    if requested == 0:
        notes.reasons.append("CPU only: --n-gpu-layers 0")
        return None, None
    candidates = hw.usable_gpus()
    if not candidates and requested is not None:
        candidates = hw.usable_gpus(include_software=True)
        if candidates:
            notes.warnings.append(
                f"offloading to {candidates[0].name}, a software renderer, because --n-gpu-layers asked for it: "
                "slower than the CPU backend, useful for tests only"
            )
    if not candidates:
        notes.reasons.append(_why_cpu_only(hw))
        return None, None
    gpu = candidates[0]
    if requested is None:
        # The preferred GPU may be too small where another holds the whole model
        # (a Strix Halo with a small eGPU): whole beats split.
        whole = [g for g in candidates if most_layers(model, hw.host_budget_bytes, g, kv_per_token, floor) == model.offloadable_layers]
        if whole and whole[0] is not gpu:
            notes.reasons.append(f"{whole[0].name} holds the whole model, {gpu.name} would not")
            gpu = whole[0]
    return gpu, _pick_device(gpu)


def _choose_layers(
    model: ModelFacts, hw: HardwareReport, gpu: GpuInfo, requested: int | str | None, kv_per_token: float, floor: int, notes: _Notes
) -> int:
    total = model.offloadable_layers
    if requested == "all":
        notes.reasons.append(f"all {total} layers on the GPU: set by --n-gpu-layers")
        return total
    if isinstance(requested, int):
        layers = min(requested, total)
        notes.reasons.append(f"{layers}/{total} layers on the GPU: set by --n-gpu-layers")
        return layers
    layers = most_layers(model, hw.host_budget_bytes, gpu, kv_per_token, floor)
    need = format_bytes(memory_need_bytes(model.total_bytes, kv_per_token, floor))
    budget = f"the GPU budget is {format_bytes(gpu.budget_bytes)} ({gpu.budget_basis})"
    if requested == "auto":
        notes.reasons.append("--n-gpu-layers auto: llama.cpp fits the layers itself; the plan's estimate assumes all")
        return total
    if layers == total:
        notes.reasons.append(f"all {total} layers on {gpu.name}: the model needs ~{need} with {floor} tokens of context; {budget}")
    elif layers > 0:
        notes.reasons.append(
            f"{layers}/{total} layers on {gpu.name}: the model needs ~{need} with {floor} tokens of context; "
            f"{budget}; the other layers run on the CPU"
        )
    else:
        notes.reasons.append(f"CPU only: not one layer fits on {gpu.name}; {budget}")
    return layers


def _choose_ctx(model: ModelFacts, operator: OperatorChoices, where: Placement, kv_per_token: float, notes: _Notes) -> int:
    parallel = operator.parallel
    if operator.ctx_size is not None:
        notes.reasons.append(f"context {operator.ctx_size} set by --ctx-size")
        return operator.ctx_size
    if "ctx" in operator.given:
        ctx = int(operator.values["ctx"] or 0)
        notes.reasons.append(f"context {ctx} set by --llama-arg")
        return ctx
    cap = parallel * min(model.context_length, MAX_CTX_PER_SLOT)
    step = CTX_GRANULARITY * parallel
    # Never 0: to llama-server that means the model's whole training context.
    ctx = max(step, int(min(where.max_ctx(), cap) // step) * step)
    kv = f"KV cache ~{kv_per_token / 1024:.0f} KiB per token"
    floor = ctx_floor(model, parallel)
    if not where.fits(ctx):
        # Nothing fits: plan (and argv) the least worth launching with, the context the quant
        # advisor rates quants at, so every figure printed is the one a forced launch runs.
        notes.reasons.append(
            f"context {floor} = {parallel} slots x {floor // parallel} tokens, the least planned per slot: "
            f"memory does not hold the model even with {ctx} tokens ({kv})"
        )
        return floor
    if ctx >= cap:
        notes.reasons.append(f"context {ctx} = {parallel} slots x {ctx // parallel} tokens, the most planned per slot ({kv})")
    else:
        notes.reasons.append(f"context {ctx} = {parallel} slots x {ctx // parallel} tokens: what memory leaves after the weights ({kv})")
    if ctx < floor:
        notes.warnings.append(
            f"only {ctx // parallel} tokens of context per slot fit (less than {MIN_CTX_PER_SLOT}): "
            "choose a smaller quant, fewer --parallel slots, or set --ctx-size"
        )
    return ctx


def _choose_load_mode(gpu: GpuInfo | None, operator: OperatorChoices, binary: BinaryCapabilities, notes: _Notes) -> str:
    if "load_mode" in operator.given:
        return "set by --llama-arg"
    if gpu is None or not gpu.unified:
        return "mmap"
    # With mmap the file's pages stay in the page cache while the GPU's GTT
    # buffers hold a copy: on unified memory that is the same RAM counted twice.
    why = "on unified memory the page cache would hold the weights a second time"
    if binary.supports("--load-mode"):
        notes.reasons.append(f"no mmap (--load-mode none): {why}")
        return "no-mmap"
    if binary.supports("--no-mmap"):
        notes.reasons.append(f"no mmap (--no-mmap): {why}")
        return "no-mmap"
    notes.warnings.append(f"this llama-server cannot turn mmap off; {why}")
    return "mmap"


def _choose_flash_attn(cpu_only: bool, operator: OperatorChoices, binary: BinaryCapabilities, notes: _Notes) -> str:
    if "flash_attn" in operator.given:
        return operator.values["flash_attn"] or "on"
    if not binary.supports("--flash-attn"):
        return "off"
    if _flash_attn_takes_value(binary):
        # "on" would force it even where a device lacks the kernel (ops then fall back to the CPU).
        notes.reasons.append("flash attention auto: llama.cpp turns it on wherever the device supports it")
        return "auto"
    if cpu_only:
        return "off"
    notes.reasons.append("flash attention on: less KV memory traffic on the GPU")
    return "on"


def plan_launch(model: ModelFacts, hw: HardwareReport, operator: OperatorChoices, binary: BinaryCapabilities) -> LaunchPlan:
    """Plan llama-server's arguments for `model` on `hw`. Pure: the same facts give the same plan."""
    notes = _Notes(reasons=[f"model facts: {g}" for g in model.guessed], warnings=[])
    # `--llama-arg -ngl N` counts as asking, so the memory estimate follows it too.
    requested = _parse_gpu_layers(operator.n_gpu_layers if operator.n_gpu_layers is not None else operator.values.get("gpu_layers"))
    kv_per_token = model.kv_bytes_per_token(
        (operator.values.get("cache_type_k") or DEFAULT_KV_TYPE).lower(),
        (operator.values.get("cache_type_v") or DEFAULT_KV_TYPE).lower(),
    )
    floor = ctx_floor(model, operator.parallel)

    gpu, device = _choose_gpu(model, hw, operator, requested, kv_per_token, floor, notes)
    gpu_layers = _choose_layers(model, hw, gpu, requested, kv_per_token, floor, notes) if gpu else 0
    if gpu_layers == 0:
        gpu, device = None, None
    cpu_only = gpu is None
    where = placement(model, hw.host_budget_bytes, gpu, gpu_layers, kv_per_token)
    ctx_size = _choose_ctx(model, operator, where, kv_per_token, notes)
    # `--ctx-size 0` means the model's training context, shared by all slots.
    effective_ctx = ctx_size or model.context_length
    fits = where.fits(effective_ctx)
    if not fits:
        notes.warnings.append(
            f"the model does not fit: ~{format_bytes(where.use(effective_ctx).need_bytes)} needed with {effective_ctx} "
            f"tokens of context, {hw.capacity().describe()}"
        )
    cache_ram = _choose_prompt_cache(where, effective_ctx, kv_per_token, operator, binary, notes)
    load_mode = _choose_load_mode(gpu, operator, binary, notes)
    flash_attn = _choose_flash_attn(cpu_only, operator, binary, notes)
    if device is not None and "device" not in operator.given and _flag(binary, *OPTION_SPELLINGS["device"]) is None:
        notes.warnings.append("this llama-server has no --device option; it may spread layers over every device it sees")
    if gpu is not None and device is None:
        notes.warnings.append("llama-server's device list is unknown; it will choose devices itself")

    env: dict[str, str] = {}
    if device is not None:
        # Device numbers mean what they meant in the environment the devices were listed under.
        env.update(hw.llama_devices_env)
    argv = _argv(
        model,
        binary,
        operator,
        device_arg=device.name if device else ("none" if cpu_only and hw.llama_devices else None),
        gpu_layers="auto" if requested == "auto" and not cpu_only else str(gpu_layers),
        ctx_size=ctx_size,
        load_mode=load_mode,
        flash_attn=flash_attn,
        cache_ram_mib=cache_ram // PROMPT_CACHE_UNIT_BYTES if cache_ram is not None else None,
    )
    if device is not None:
        backend = device.backend
    elif gpu is not None:
        backend = next((b for b in BACKEND_PREFERENCE if b in gpu.backends), "gpu")
    else:
        backend = "cpu"
    return LaunchPlan(
        argv=tuple(argv),
        env=env,
        backend=backend,
        device=device.name if device else None,
        gpu_layers="auto" if requested == "auto" and not cpu_only else gpu_layers,
        total_layers=model.offloadable_layers,
        ctx_size=ctx_size,
        parallel=operator.parallel,
        load_mode=load_mode,
        flash_attn=flash_attn,
        batch_size=BATCH_SIZE,
        ubatch_size=UBATCH_SIZE,
        cpu_only=cpu_only,
        fits=fits,
        memory=where.use(effective_ctx, prompt_cache=_counted_cache(cache_ram, operator)),
        reasons=tuple(notes.reasons),
        warnings=tuple(notes.warnings),
    )


def _choose_prompt_cache(
    where: Placement, ctx: int, kv_per_token: float, operator: OperatorChoices, binary: BinaryCapabilities, notes: _Notes
) -> int | None:
    """The prompt cache's limit in bytes for `--cache-ram`, or None when the plan does not set it.

    llama.cpp's default (8 GiB) is outside any plan: under traffic it fills with
    the KV states of finished prompts, hours after a clean start. The plan gives
    it `prepare.memory.prompt_cache_bytes`: what is left, at most one more context.
    """
    if "cache_ram" in operator.given:
        if int(operator.values["cache_ram"]) == UNLIMITED_CACHE_RAM:
            notes.warnings.append(
                "--cache-ram -1 (set by --llama-arg): the prompt cache has no limit, so llama-server's RAM grows "
                f"with traffic; counted as {format_bytes(PROMPT_CACHE_MAX_BYTES)}"
            )
        return None
    if _flag(binary, *OPTION_SPELLINGS["cache_ram"]) is None:
        return None  # builds before the option keep no prompt cache in RAM
    cache = prompt_cache_bytes(where, ctx, kv_per_token)
    if cache:
        notes.reasons.append(
            f"prompt cache {format_bytes(cache)} (--cache-ram): finished prompts' KV states kept in RAM, "
            "at most one more context's worth and only RAM the model leaves free"
        )
    else:
        notes.reasons.append("no prompt cache (--cache-ram 0): the model and its context leave no RAM for one")
    return cache


def _counted_cache(planned: int | None, operator: OperatorChoices) -> int:
    """The prompt cache's bytes as the memory model counts them: planned, or the operator's limit."""
    if planned is not None:
        return planned
    if "cache_ram" in operator.given:
        mib = int(operator.values["cache_ram"])
        return PROMPT_CACHE_MAX_BYTES if mib == UNLIMITED_CACHE_RAM else mib * PROMPT_CACHE_UNIT_BYTES
    return 0


def _why_cpu_only(hw: HardwareReport) -> str:
    real = [g for g in hw.gpus if g.kind != "software"]
    if real:
        names = ", ".join(g.name for g in real)
        return f"CPU only: llama-server lists no device for {names} (see the hardware notes)"
    software = [g for g in hw.gpus if g.kind == "software"]
    if software:
        return f"CPU only: the only GPU device is {software[0].name}, a software renderer (set --n-gpu-layers to offload to it anyway)"
    return "CPU only: this machine has no GPU"


def _argv(
    model: ModelFacts,
    binary: BinaryCapabilities,
    operator: OperatorChoices,
    *,
    device_arg: str | None,
    gpu_layers: str,
    ctx_size: int,
    load_mode: str,
    flash_attn: str,
    cache_ram_mib: int | None,
) -> list[str]:
    argv: list[str] = []

    def add(option: str, *values: str, spelling: str | None = None) -> None:
        if option in operator.given:
            return  # the operator's own spelling, later in argv, decides
        flag = spelling if spelling is not None else _flag(binary, *OPTION_SPELLINGS[option])
        if flag:
            argv.extend([flag, *values])

    if model.path is not None:
        add("model", str(model.path))
    if device_arg is not None:
        # Explicit even for one GPU: a build with two backends lists one GPU twice
        # (Vulkan0 and ROCm0) and would otherwise split the layers over both.
        add("device", device_arg)
    add("gpu_layers", gpu_layers)
    add("ctx", str(ctx_size))
    add("parallel", str(operator.parallel))
    if load_mode == "no-mmap":
        if binary.supports("--load-mode"):
            add("load_mode", "none", spelling="--load-mode")
        else:
            add("load_mode", spelling="--no-mmap")
    if _flash_attn_takes_value(binary):
        add("flash_attn", flash_attn)
    elif flash_attn == "on":
        add("flash_attn")
    add("batch", str(BATCH_SIZE))
    add("ubatch", str(UBATCH_SIZE))
    if cache_ram_mib is not None:
        add("cache_ram", str(cache_ram_mib))
    argv.extend(operator.llama_args)
    return argv
