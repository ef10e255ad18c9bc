"""Decide how llama-server runs this model on this box: a pure function from facts to argv and env.

Inputs are model facts (from the GGUF header or the catalog), the hardware
report, the node settings and what the binary's `--help` offers; nothing here
touches a file or a process, so every decision is testable from recorded
facts. The supervisor adds the binary path, host, port and API key.

Every planned option gives way to the operator: `--ctx-size`,
`--n-gpu-layers`, `--parallel`, and any llama-server option given through
`--llama-arg` replaces the plan's own choice for that option.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

from meshnet_gguf.config import NodeSettings
from meshnet_gguf.gguf_names import format_bytes
from meshnet_gguf.hardware import GiB, GpuInfo, HardwareReport, LlamaDevice

if TYPE_CHECKING:
    from meshnet_gguf.catalog import CatalogEntry, CatalogQuant
    from meshnet_gguf.gguf_info import GGUFInfo

# llama.cpp's compute buffers at the default micro-batch (512) measure 0.5-1.5 GiB
# for models up to ~300B parameters; 2 GiB covers them and the per-device scratch.
COMPUTE_OVERHEAD_BYTES = 2 * GiB
# The smallest context per slot worth serving: llama.cpp's own fitter stops at
# this (`--fit-ctx` default), and chat prompts with a system message need it.
MIN_CTX_PER_SLOT = 4096
# Planned context stops here even when memory allows more: few requests need
# longer, and KV cells and compute buffers beyond it only eat the headroom.
# `--ctx-size` raises it.
MAX_CTX_PER_SLOT = 65536
# llama.cpp pads the KV cache to this many cells.
CTX_GRANULARITY = 256
# llama.cpp's defaults, stated explicitly so the compute-buffer estimate above
# stays true whatever a future build defaults to.
BATCH_SIZE = 2048
UBATCH_SIZE = 512
# Used when a GGUF lacks the attention facts (non-transformer architectures).
FALLBACK_HEAD_DIM = 128
# One backend per GPU, most capable first: CUDA/Metal are the vendors' own;
# on AMD, Vulkan (RADV) decodes faster than ROCm on RDNA3/3.5 APUs like Strix Halo.
BACKEND_PREFERENCE = ("cuda", "metal", "vulkan", "rocm")

# Bytes per KV element for `--cache-type-k/-v` (block formats: bytes per block / 32 elements).
KV_TYPE_BYTES = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}
DEFAULT_KV_TYPE = "f16"

# llama-server options the plan sets, by every spelling the binary accepts.
_OPTION_SPELLINGS: dict[str, frozenset[str]] = {
    "model": frozenset({"-m", "--model"}),
    "ctx": frozenset({"-c", "--ctx-size"}),
    "gpu_layers": frozenset({"-ngl", "--gpu-layers", "--n-gpu-layers"}),
    "parallel": frozenset({"-np", "--parallel"}),
    "device": frozenset({"-dev", "--device"}),
    "load_mode": frozenset({"-lm", "--load-mode", "--mmap", "--no-mmap", "--mlock", "-dio", "--direct-io"}),
    "flash_attn": frozenset({"-fa", "--flash-attn"}),
    "batch": frozenset({"-b", "--batch-size"}),
    "ubatch": frozenset({"-ub", "--ubatch-size"}),
    "cache_type_k": frozenset({"-ctk", "--cache-type-k"}),
    "cache_type_v": frozenset({"-ctv", "--cache-type-v"}),
}


class BinaryCapabilities(Protocol):
    """What the plan needs to know of the binary; `binary.BinaryInfo` is one."""

    help_text: str

    def supports(self, flag: str) -> bool: ...


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs of a model, from its GGUF header or from catalog data."""

    name: str
    total_bytes: int  # all shards together
    block_count: int
    head_count_kv: int
    head_dim_k: int
    head_dim_v: int
    context_length: int
    path: Path | None = None  # the file llama-server loads (shard 1 of a split model)
    shard_count: int = 1
    # Facts the header lacked and that were guessed; the plan repeats them as reasons.
    guessed: tuple[str, ...] = ()

    @classmethod
    def from_gguf(cls, info: GGUFInfo, total_bytes: int, *, path: Path | None = None) -> ModelFacts:
        """Facts from shard 1's header; `total_bytes` covers every shard (`gguf_info.total_bytes`)."""
        guessed: list[str] = []

        def known(value: int | None, fallback: int, what: str) -> int:
            if value:
                return value
            guessed.append(f"{what} unknown: assumed {fallback}")
            return fallback

        head_dim_k = known(info.head_dim_k, FALLBACK_HEAD_DIM, "head size")
        return cls(
            name=info.name or Path(info.path).name,
            total_bytes=total_bytes,
            block_count=known(info.block_count, 1, "layer count"),
            head_count_kv=known(info.head_count_kv or info.head_count, 1, "KV head count"),
            head_dim_k=head_dim_k,
            head_dim_v=info.head_dim_v or head_dim_k,
            context_length=known(info.context_length, MIN_CTX_PER_SLOT, "training context"),
            path=path if path is not None else info.path,
            shard_count=info.split_count,
            guessed=tuple(guessed),
        )

    @classmethod
    def from_catalog(cls, entry: CatalogEntry, quant: str | CatalogQuant, *, path: Path | None = None) -> ModelFacts:
        """Facts from the catalog (its figures for the quant, its model shape), to plan before a download.

        `path` is where shard 1 will be once downloaded (it goes into `--model`).
        Raises ValueError when the entry has no such quant or no model shape.
        """
        chosen = entry.quant(quant) if isinstance(quant, str) else quant
        if chosen is None:
            raise ValueError(f"catalog entry {entry.id} has no quant {quant}; it offers {', '.join(q.name for q in entry.quants)}")
        if entry.shape is None:
            raise ValueError(f"catalog entry {entry.id} gives no model shape (layers, kv_heads, head_dim_k)")
        guessed: list[str] = []
        context = entry.context_length
        if not context:
            context = MIN_CTX_PER_SLOT
            guessed.append(f"training context unknown: assumed {context}")
        return cls(
            name=f"{entry.id}:{chosen.name}",
            total_bytes=chosen.total_bytes,
            block_count=entry.shape.layers,
            head_count_kv=entry.shape.kv_heads,
            head_dim_k=entry.shape.head_dim_k,
            head_dim_v=entry.shape.head_dim_v,
            context_length=context,
            path=path,
            shard_count=chosen.shards,
            guessed=tuple(guessed),
        )

    @property
    def offloadable_layers(self) -> int:
        """What `-ngl` counts: every repeating layer plus the output layer ("offloaded 3/3" for 2 blocks)."""
        return self.block_count + 1

    def kv_bytes_per_token(self, k_type: str = DEFAULT_KV_TYPE, v_type: str = DEFAULT_KV_TYPE) -> float:
        """Upper bound of the KV cache per context token over all layers.

        Sliding-window or compressed attention layers need less; counting every
        layer in full keeps the estimate on the safe side.
        """
        k = self.head_dim_k * KV_TYPE_BYTES.get(k_type, 2.0)
        v = self.head_dim_v * KV_TYPE_BYTES.get(v_type, 2.0)
        return self.block_count * self.head_count_kv * (k + v)


def ctx_floor(model: ModelFacts, parallel: int) -> int:
    """The least total context worth launching with: every slot gets `MIN_CTX_PER_SLOT` (or the model's whole context)."""
    return parallel * min(model.context_length, MIN_CTX_PER_SLOT)


def memory_need_bytes(weights_bytes: int, kv_bytes_per_token: float, ctx_size: int) -> int:
    """What a model needs to run anywhere: weights + KV cache for `ctx_size` tokens + compute buffers."""
    return int(weights_bytes + kv_bytes_per_token * ctx_size + COMPUTE_OVERHEAD_BYTES)


@dataclass(frozen=True)
class LaunchPlan:
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
    gpu_bytes: int  # estimated use of the GPU budget
    host_bytes: int  # estimated use of RAM outside the GPU budget
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    def command_line(self, binary: str = "llama-server") -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return " ".join(x for x in (env, shlex.join([binary, *self.argv])) if x)

    def describe(self) -> str:
        if self.cpu_only:
            where = "CPU only"
        else:
            layers = f"{self.gpu_layers}/{self.total_layers} layers" if isinstance(self.gpu_layers, int) else "layers: auto"
            where = f"{self.backend} on {self.device or 'the default device'}, {layers}"
        lines = [
            f"plan: {where}; context {self.ctx_size} tokens over {self.parallel} slots; "
            f"{self.load_mode}; flash attention {self.flash_attn}; batch {self.batch_size}/{self.ubatch_size}",
            f"memory: ~{format_bytes(self.gpu_bytes)} on the GPU, ~{format_bytes(self.host_bytes)} in RAM"
            + ("" if self.fits else " (DOES NOT FIT)"),
        ]
        lines += [f"  - {r}" for r in self.reasons]
        lines += [f"  ! {w}" for w in self.warnings]
        lines.append(f"argv: {self.command_line()}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- operator arguments


@dataclass
class _OperatorArgs:
    """Which planned options the operator set through `--llama-arg`, and the values the plan must know."""

    given: set[str] = field(default_factory=set)
    values: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, args: Sequence[str]) -> _OperatorArgs:
        found = cls()
        for i, arg in enumerate(args):
            flag, eq, inline = arg.partition("=")
            for option, spellings in _OPTION_SPELLINGS.items():
                if flag in spellings:
                    found.given.add(option)
                    following = args[i + 1] if i + 1 < len(args) else ""
                    # Switches (--no-mmap, an old build's bare -fa) take no value.
                    found.values[option] = inline if eq else ("" if following.startswith("-") else following)
        return found


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


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class _Placement:
    """Bytes per memory pool for one choice of GPU layers: fixed bytes plus bytes per context token."""

    host_budget: float
    host_fixed: float
    host_per_token: float
    gpu_budget: float = 0.0
    gpu_fixed: float = 0.0
    gpu_per_token: float = 0.0
    # Unified memory: the GPU's use beyond its carve-out comes out of the same RAM as the CPU's share.
    unified_carve_out: float | None = None

    def _limits(self) -> list[tuple[float, float]]:
        """(room left after fixed bytes, bytes per token) for every pool that must hold."""
        limits = [(self.host_budget - self.host_fixed, self.host_per_token)]
        if self.gpu_fixed or self.gpu_per_token:
            limits.append((self.gpu_budget - self.gpu_fixed, self.gpu_per_token))
            if self.unified_carve_out is not None:
                limits.append(
                    (
                        self.host_budget + self.unified_carve_out - self.host_fixed - self.gpu_fixed,
                        self.host_per_token + self.gpu_per_token,
                    )
                )
        return limits

    def max_ctx(self) -> float:
        best = math.inf
        for room, per_token in self._limits():
            if room < 0:
                return 0.0
            if per_token > 0:
                best = min(best, room / per_token)
        return best

    def fits(self, ctx: int) -> bool:
        return all(room >= per_token * ctx for room, per_token in self._limits())

    def gpu_fits(self, ctx: int) -> bool:
        return self.gpu_fixed + self.gpu_per_token * ctx <= self.gpu_budget

    def gpu_bytes(self, ctx: int) -> int:
        return int(self.gpu_fixed + self.gpu_per_token * ctx)

    def host_bytes(self, ctx: int) -> int:
        return int(self.host_fixed + self.host_per_token * ctx)


def _placement(model: ModelFacts, hw: HardwareReport, gpu: GpuInfo | None, gpu_layers: int, kv_per_token: float) -> _Placement:
    if gpu is None or gpu_layers == 0:
        return _Placement(hw.host_budget_bytes, model.total_bytes + COMPUTE_OVERHEAD_BYTES, kv_per_token)
    layer_bytes = model.total_bytes / model.offloadable_layers
    kv_layers_on_gpu = min(gpu_layers, model.block_count)
    kv_per_layer = kv_per_token / model.block_count
    return _Placement(
        host_budget=hw.host_budget_bytes,
        host_fixed=model.total_bytes - gpu_layers * layer_bytes,
        host_per_token=(model.block_count - kv_layers_on_gpu) * kv_per_layer,
        gpu_budget=gpu.budget_bytes,
        gpu_fixed=COMPUTE_OVERHEAD_BYTES + gpu_layers * layer_bytes,
        gpu_per_token=kv_layers_on_gpu * kv_per_layer,
        unified_carve_out=gpu.dedicated_bytes if gpu.unified else None,
    )


def _most_layers(model: ModelFacts, hw: HardwareReport, gpu: GpuInfo, kv_per_token: float, floor: int) -> int:
    """The most layers the GPU holds with room for their share of `floor` tokens of context.

    Only the GPU's budget decides: when the rest does not fit in RAM either,
    the model does not fit at all, which the plan reports separately.
    """
    for layers in range(model.offloadable_layers, 0, -1):
        if _placement(model, hw, gpu, layers, kv_per_token).gpu_fits(floor):
            return layers
    return 0


# --------------------------------------------------------------------------- the plan


@dataclass
class _Notes:
    reasons: list[str]
    warnings: list[str]


def _choose_gpu(
    model: ModelFacts,
    hw: HardwareReport,
    operator: _OperatorArgs,
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
        whole = [g for g in candidates if _most_layers(model, hw, g, kv_per_token, floor) == model.offloadable_layers]
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
    layers = _most_layers(model, hw, gpu, kv_per_token, floor)
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


def _choose_ctx(
    model: ModelFacts, settings: NodeSettings, operator: _OperatorArgs, placement: _Placement, kv_per_token: float, notes: _Notes
) -> int:
    parallel = settings.parallel
    if settings.ctx_size is not None:
        notes.reasons.append(f"context {settings.ctx_size} set by --ctx-size")
        return settings.ctx_size
    if "ctx" in operator.given:
        ctx = int(operator.values["ctx"] or 0)
        notes.reasons.append(f"context {ctx} set by --llama-arg")
        return ctx
    cap = parallel * min(model.context_length, MAX_CTX_PER_SLOT)
    step = CTX_GRANULARITY * parallel
    # Never 0: to llama-server that means the model's whole training context.
    ctx = max(step, int(min(placement.max_ctx(), cap) // step) * step)
    kv = f"KV cache ~{kv_per_token / 1024:.0f} KiB per token"
    if ctx >= cap:
        notes.reasons.append(f"context {ctx} = {parallel} slots x {ctx // parallel} tokens, the most planned per slot ({kv})")
    else:
        notes.reasons.append(
            f"context {ctx} = {parallel} slots x {ctx // parallel} tokens: what memory leaves after the weights ({kv})"
        )
    if ctx < ctx_floor(model, parallel):
        notes.warnings.append(
            f"only {ctx // parallel} tokens of context per slot fit (less than {MIN_CTX_PER_SLOT}): "
            "choose a smaller quant, fewer --parallel slots, or set --ctx-size"
        )
    return ctx


def _choose_load_mode(gpu: GpuInfo | None, operator: _OperatorArgs, binary: BinaryCapabilities, notes: _Notes) -> str:
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


def _choose_flash_attn(cpu_only: bool, operator: _OperatorArgs, binary: BinaryCapabilities, notes: _Notes) -> str:
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


def plan_launch(model: ModelFacts, hw: HardwareReport, settings: NodeSettings, binary: BinaryCapabilities) -> LaunchPlan:
    """Plan llama-server's arguments for `model` on `hw`. Pure: the same facts give the same plan."""
    notes = _Notes(reasons=[f"model facts: {g}" for g in model.guessed], warnings=[])
    operator = _OperatorArgs.parse(settings.llama_args)
    # `--llama-arg -ngl N` counts as asking, so the memory estimate follows it too.
    requested = _parse_gpu_layers(
        settings.n_gpu_layers if settings.n_gpu_layers is not None else operator.values.get("gpu_layers")
    )
    kv_per_token = model.kv_bytes_per_token(
        operator.values.get("cache_type_k", DEFAULT_KV_TYPE).lower(),
        operator.values.get("cache_type_v", DEFAULT_KV_TYPE).lower(),
    )
    floor = ctx_floor(model, settings.parallel)

    gpu, device = _choose_gpu(model, hw, operator, requested, kv_per_token, floor, notes)
    gpu_layers = _choose_layers(model, hw, gpu, requested, kv_per_token, floor, notes) if gpu else 0
    if gpu_layers == 0:
        gpu, device = None, None
    cpu_only = gpu is None
    placement = _placement(model, hw, gpu, gpu_layers, kv_per_token)
    ctx_size = _choose_ctx(model, settings, operator, placement, kv_per_token, notes)
    # `--ctx-size 0` means the model's training context, shared by all slots.
    effective_ctx = ctx_size or model.context_length
    fits = placement.fits(effective_ctx)
    if not fits:
        total = placement.gpu_bytes(effective_ctx) + placement.host_bytes(effective_ctx)
        notes.warnings.append(
            f"the model does not fit: ~{format_bytes(total)} needed with {effective_ctx} tokens of context, "
            f"{hw.capacity().describe()}"
        )
    load_mode = _choose_load_mode(gpu, operator, binary, notes)
    flash_attn = _choose_flash_attn(cpu_only, operator, binary, notes)
    if device is not None and "device" not in operator.given and _flag(binary, "--device", "-dev") is None:
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
        settings,
        device_arg=device.name if device else ("none" if cpu_only and hw.llama_devices else None),
        gpu_layers="auto" if requested == "auto" and not cpu_only else str(gpu_layers),
        ctx_size=ctx_size,
        load_mode=load_mode,
        flash_attn=flash_attn,
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
        parallel=settings.parallel,
        load_mode=load_mode,
        flash_attn=flash_attn,
        batch_size=BATCH_SIZE,
        ubatch_size=UBATCH_SIZE,
        cpu_only=cpu_only,
        fits=fits,
        gpu_bytes=placement.gpu_bytes(effective_ctx),
        host_bytes=placement.host_bytes(effective_ctx),
        reasons=tuple(notes.reasons),
        warnings=tuple(notes.warnings),
    )


def _why_cpu_only(hw: HardwareReport) -> str:
    real = [g for g in hw.gpus if g.kind != "software"]
    if real:
        names = ", ".join(g.name for g in real)
        return f"CPU only: llama-server lists no device for {names} (see the hardware notes)"
    software = [g for g in hw.gpus if g.kind == "software"]
    if software:
        return (
            f"CPU only: the only GPU device is {software[0].name}, a software renderer "
            "(set --n-gpu-layers to offload to it anyway)"
        )
    return "CPU only: this machine has no GPU"


def _argv(
    model: ModelFacts,
    binary: BinaryCapabilities,
    operator: _OperatorArgs,
    settings: NodeSettings,
    *,
    device_arg: str | None,
    gpu_layers: str,
    ctx_size: int,
    load_mode: str,
    flash_attn: str,
) -> list[str]:
    argv: list[str] = []

    def add(option: str, *values: str, spellings: tuple[str, ...]) -> None:
        if option in operator.given:
            return  # the operator's own spelling, later in argv, decides
        flag = _flag(binary, *spellings)
        if flag:
            argv.extend([flag, *values])

    if model.path is not None:
        add("model", str(model.path), spellings=("--model", "-m"))
    if device_arg is not None:
        # Explicit even for one GPU: a build with two backends lists one GPU twice
        # (Vulkan0 and ROCm0) and would otherwise split the layers over both.
        add("device", device_arg, spellings=("--device", "-dev"))
    add("gpu_layers", gpu_layers, spellings=("--n-gpu-layers", "--gpu-layers", "-ngl"))
    add("ctx", str(ctx_size), spellings=("--ctx-size", "-c"))
    add("parallel", str(settings.parallel), spellings=("--parallel", "-np"))
    if load_mode == "no-mmap":
        if binary.supports("--load-mode"):
            add("load_mode", "none", spellings=("--load-mode",))
        else:
            add("load_mode", spellings=("--no-mmap",))
    if _flash_attn_takes_value(binary):
        add("flash_attn", flash_attn, spellings=("--flash-attn", "-fa"))
    elif flash_attn == "on":
        add("flash_attn", spellings=("--flash-attn", "-fa"))
    add("batch", str(BATCH_SIZE), spellings=("--batch-size", "-b"))
    add("ubatch", str(UBATCH_SIZE), spellings=("--ubatch-size", "-ub"))
    argv.extend(settings.llama_args)
    return argv
