"""What llama-server allocates for a model, in host RAM and on the GPU: the one set of memory figures.

The launch plan, the quant advisor, `doctor` and `models` all count with this
module, so they print the same figures for the same model and context. Every
allocation llama-server makes is counted here or named as covered elsewhere:

| allocation | size | where | set by |
|---|---|---|---|
| weights | the GGUF's tensor bytes | GPU for offloaded layers, else RAM | `--n-gpu-layers`, `--device` |
| KV cache | bytes per token x `--ctx-size` (all slots) | beside its layer | `--ctx-size`, `--cache-type-k/-v` |
| compute buffers | `COMPUTE_OVERHEAD_BYTES` | the main device (RAM when CPU only) | `--batch-size`, `--ubatch-size` |
| prompt cache | up to `--cache-ram` MiB (llama.cpp's default: 8 GiB) | RAM | `--cache-ram` |
| binary, host copies of outputs, logits | tens to hundreds of MB | RAM | inside `hardware.SYSTEM_RESERVE_BYTES` |

The prompt cache keeps the KV state of finished prompts in RAM so that a
returning conversation skips its prefill; each distinct prompt adds its state
until the limit (measured: `bench/soak_prompt_cache.py`). Left at llama.cpp's
default, it grows by up to 8 GiB under traffic, hours after a clean start.

Pure: no file, process or clock is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshnet_gguf.common.units import GiB, MiB, format_bytes
from meshnet_gguf.hardware.report import GpuInfo

if TYPE_CHECKING:
    from meshnet_gguf.models.catalog import CatalogEntry, CatalogQuant
    from meshnet_gguf.models.gguf_info import GGUFInfo

# llama.cpp's compute buffers at the default micro-batch (512) measure 0.5-1.5 GiB
# for models up to ~300B parameters; 2 GiB covers them and the per-device scratch.
COMPUTE_OVERHEAD_BYTES = 2 * GiB
# The smallest context per slot worth serving: llama.cpp's own fitter stops at
# this (`--fit-ctx` default), and chat prompts with a system message need it.
MIN_CTX_PER_SLOT = 4096
# Used when a GGUF lacks the attention facts (non-transformer architectures).
FALLBACK_HEAD_DIM = 128
# llama.cpp's own `--cache-ram` default, the most the plan ever gives the prompt cache:
# beyond it a cache hit saves a prefill that is rarely worth the RAM.
PROMPT_CACHE_MAX_BYTES = 8192 * MiB
# `--cache-ram` counts MiB.
PROMPT_CACHE_UNIT_BYTES = MiB

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


@dataclass(frozen=True)
class ModelFacts:
    """What the memory model needs of a model, from its GGUF header or from catalog data."""

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
    """The least a model needs anywhere: weights + KV cache for `ctx_size` tokens + compute buffers.

    The prompt cache is not in it: the plan gives the cache only what is left
    once these fit (`prompt_cache_bytes`), so it never decides whether a model fits.
    """
    return int(weights_bytes + kv_bytes_per_token * ctx_size + COMPUTE_OVERHEAD_BYTES)


@dataclass(frozen=True)
class MemoryUse:
    """Every allocation of one planned llama-server, by kind and by pool."""

    weights_gpu: int
    weights_host: int
    kv_gpu: int
    kv_host: int
    compute_gpu: int
    compute_host: int
    prompt_cache: int  # RAM; what `--cache-ram` allows
    ctx_size: int

    @property
    def gpu_bytes(self) -> int:
        return self.weights_gpu + self.kv_gpu + self.compute_gpu

    @property
    def host_bytes(self) -> int:
        return self.weights_host + self.kv_host + self.compute_host + self.prompt_cache

    @property
    def total_bytes(self) -> int:
        return self.gpu_bytes + self.host_bytes

    @property
    def need_bytes(self) -> int:
        """What must fit for the model to load: everything but the prompt cache (`memory_need_bytes`)."""
        return self.total_bytes - self.prompt_cache

    def summary(self) -> str:
        """The plan's figures in the words every command uses: the need, its context, the prompt cache on top."""
        where = f"~{format_bytes(self.gpu_bytes)} on the GPU, ~{format_bytes(self.host_bytes - self.prompt_cache)} in RAM"
        cache = f" + {format_bytes(self.prompt_cache)} of RAM for the prompt cache" if self.prompt_cache else ""
        return f"needs {format_bytes(self.need_bytes)} with {self.ctx_size} tokens of context ({where}){cache}"

    def describe(self) -> str:
        parts = [
            f"weights {format_bytes(self.weights_gpu + self.weights_host)}",
            f"KV cache {format_bytes(self.kv_gpu + self.kv_host)} for {self.ctx_size} tokens",
            f"compute buffers {format_bytes(self.compute_gpu + self.compute_host)}",
            f"prompt cache {format_bytes(self.prompt_cache)} (RAM)" if self.prompt_cache else "no prompt cache",
        ]
        return " + ".join(parts[:3]) + "; " + parts[3]


@dataclass(frozen=True)
class Placement:
    """Bytes per memory pool for one choice of GPU layers: fixed bytes plus bytes per context token."""

    host_budget: float
    weights_host: float
    compute_host: float
    kv_host_per_token: float
    gpu_budget: float = 0.0
    weights_gpu: float = 0.0
    compute_gpu: float = 0.0
    kv_gpu_per_token: float = 0.0
    # Unified memory: the GPU's use beyond its carve-out comes out of the same RAM as the CPU's share.
    unified_carve_out: float | None = None

    @property
    def host_fixed(self) -> float:
        return self.weights_host + self.compute_host

    @property
    def gpu_fixed(self) -> float:
        return self.weights_gpu + self.compute_gpu

    def _limits(self) -> list[tuple[float, float]]:
        """(room left after fixed bytes, bytes per token) for every pool that must hold."""
        limits = [(self.host_budget - self.host_fixed, self.kv_host_per_token)]
        if self.gpu_fixed or self.kv_gpu_per_token:
            limits.append((self.gpu_budget - self.gpu_fixed, self.kv_gpu_per_token))
            if self.unified_carve_out is not None:
                limits.append(
                    (
                        self.host_budget + self.unified_carve_out - self.host_fixed - self.gpu_fixed,
                        self.kv_host_per_token + self.kv_gpu_per_token,
                    )
                )
        return limits

    def _ram_limits(self) -> list[tuple[float, float]]:
        """The limits that RAM sets (host pool, and the shared pool on unified memory)."""
        limits = self._limits()
        return [limits[0]] + ([limits[2]] if len(limits) == 3 else [])

    def max_ctx(self) -> float:
        best = float("inf")
        for room, per_token in self._limits():
            if room < 0:
                return 0.0
            if per_token > 0:
                best = min(best, room / per_token)
        return best

    def fits(self, ctx: int) -> bool:
        return all(room >= per_token * ctx for room, per_token in self._limits())

    def gpu_fits(self, ctx: int) -> bool:
        return self.gpu_fixed + self.kv_gpu_per_token * ctx <= self.gpu_budget

    def ram_left(self, ctx: int) -> int:
        """RAM still free once the model and `ctx` tokens of KV cache are in place (0 when none)."""
        return max(0, int(min(room - per_token * ctx for room, per_token in self._ram_limits())))

    def use(self, ctx: int, prompt_cache: int = 0) -> MemoryUse:
        return MemoryUse(
            weights_gpu=int(self.weights_gpu),
            weights_host=int(self.weights_host),
            kv_gpu=int(self.kv_gpu_per_token * ctx),
            kv_host=int(self.kv_host_per_token * ctx),
            compute_gpu=int(self.compute_gpu),
            compute_host=int(self.compute_host),
            prompt_cache=prompt_cache,
            ctx_size=ctx,
        )


def placement(model: ModelFacts, host_budget: int, gpu: GpuInfo | None, gpu_layers: int, kv_per_token: float) -> Placement:
    """Where the bytes go with `gpu_layers` layers on `gpu` (none: all in RAM)."""
    if gpu is None or gpu_layers == 0:
        return Placement(host_budget, model.total_bytes, COMPUTE_OVERHEAD_BYTES, kv_per_token)
    layer_bytes = model.total_bytes / model.offloadable_layers
    kv_layers_on_gpu = min(gpu_layers, model.block_count)
    kv_per_layer = kv_per_token / model.block_count
    return Placement(
        host_budget=host_budget,
        weights_host=model.total_bytes - gpu_layers * layer_bytes,
        compute_host=0.0,
        kv_host_per_token=(model.block_count - kv_layers_on_gpu) * kv_per_layer,
        gpu_budget=gpu.budget_bytes,
        weights_gpu=gpu_layers * layer_bytes,
        compute_gpu=COMPUTE_OVERHEAD_BYTES,
        kv_gpu_per_token=kv_layers_on_gpu * kv_per_layer,
        unified_carve_out=gpu.dedicated_bytes if gpu.unified else None,
    )


def most_layers(model: ModelFacts, host_budget: int, gpu: GpuInfo, kv_per_token: float, floor: int) -> int:
    """The most layers the GPU holds with room for their share of `floor` tokens of context.

    Only the GPU's budget decides: when the rest does not fit in RAM either,
    the model does not fit at all, which the plan reports separately.
    """
    for layers in range(model.offloadable_layers, 0, -1):
        if placement(model, host_budget, gpu, layers, kv_per_token).gpu_fits(floor):
            return layers
    return 0


def prompt_cache_bytes(where: Placement, ctx: int, kv_per_token: float) -> int:
    """What the prompt cache may hold: one more full context's worth of KV states, in whole MiB.

    That is as many finished conversations as the slots hold at once, which is
    where a returning conversation has the best chance of a hit; never more than
    llama.cpp's own default, and never more RAM than the model and its context
    leave free (so the cache cannot turn a fitting plan into an out-of-memory kill).
    """
    wanted = min(PROMPT_CACHE_MAX_BYTES, int(kv_per_token * ctx), where.ram_left(ctx))
    return max(0, wanted) // PROMPT_CACHE_UNIT_BYTES * PROMPT_CACHE_UNIT_BYTES
