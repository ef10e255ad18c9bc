"""Which quant of a model fits this box: said before a 100 GB download, not after a crashed load.

A quant fits when its weights, the KV cache for the target context and the
compute buffers (`prepare.memory.memory_need_bytes`, the figures the launch plan
uses too) fit the box's capacity (`HardwareReport.capacity()`, which
already keeps the system reserve back). The advice names the largest quant
that fits; asking for one that does not raises `QuantDoesNotFit` with a
message that names the one that does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.hardware.report import MemoryCapacity
from meshnet_gguf.prepare.memory import COMPUTE_OVERHEAD_BYTES, ModelFacts, ctx_floor, memory_need_bytes

if TYPE_CHECKING:
    from meshnet_gguf.models.catalog import CatalogEntry, CatalogQuant


@dataclass(frozen=True)
class QuantOption:
    name: str
    total_bytes: int  # all shards together
    shard_count: int = 1


@dataclass(frozen=True)
class QuantFit:
    quant: QuantOption
    kv_bytes: int
    need_bytes: int
    fits: bool  # in the box's capacity at all
    fits_gpu: bool  # entirely within the GPU budget

    def describe(self, target_ctx: int, *, minimum: bool = True) -> str:
        """`minimum`: `target_ctx` is the least context the plan launches with, so the figure is a floor."""
        kv = f" + {format_bytes(self.kv_bytes)} KV cache for {target_ctx} tokens" if self.kv_bytes else ""
        return (
            f"{self.quant.name} needs {'at least ' if minimum else ''}{format_bytes(self.need_bytes)} "
            f"({format_bytes(self.quant.total_bytes)} weights{kv} + {format_bytes(COMPUTE_OVERHEAD_BYTES)} compute buffers)"
        )


@dataclass(frozen=True)
class QuantAdvice:
    capacity: MemoryCapacity
    target_ctx: int
    options: tuple[QuantFit, ...]  # largest first
    # True when `target_ctx` is the least context a plan launches with (no `--ctx-size`): every
    # figure here is then a minimum, and the launch plan's own figure (more context) may be larger.
    minimum: bool = True

    @property
    def best(self) -> QuantFit | None:
        """The largest quant that fits, preferring one that fits the GPU whole over a larger split one."""
        on_gpu = [o for o in self.options if o.fits_gpu]
        if on_gpu:
            return on_gpu[0]
        return next((o for o in self.options if o.fits), None)

    def find(self, quant: str) -> QuantFit | None:
        wanted = quant.lower().removeprefix("ud-")
        exact = [o for o in self.options if o.quant.name.lower() == quant.lower()]
        if exact:
            return exact[0]
        loose = [o for o in self.options if o.quant.name.lower().removeprefix("ud-") == wanted]
        return loose[0] if len(loose) == 1 else None

    def need_bytes(self, quant: CatalogQuant) -> int:
        """What a catalog quant needs here (weights + KV + compute): `catalog.featured`'s `need_bytes`."""
        fit = self.find(quant.name)
        return fit.need_bytes if fit is not None else memory_need_bytes(quant.total_bytes, 0.0, 0)

    def check(self, quant: str) -> QuantFit:
        """The chosen quant's fit, or `QuantDoesNotFit` naming the quant that fits (ValueError: not offered).

        `serve --force` skips this check rather than passing a flag here.
        """
        chosen = self.find(quant)
        if chosen is None:
            names = ", ".join(o.quant.name for o in self.options)
            raise ValueError(f"quant {quant!r} is not one of: {names}")
        if chosen.fits:
            return chosen
        best = self.best
        if best is not None:
            where = "" if best.fits_gpu or self.capacity.gpu_bytes == 0 else ", partly on the CPU,"
            tail = (
                f"{best.quant.name} fits{where} (needs {'at least ' if self.minimum else ''}{format_bytes(best.need_bytes)}). "
                f"Choose --quant {best.quant.name}, or pass --force to try anyway."
            )
        else:
            smallest = self.options[-1]
            tail = (
                f"no quant of this model fits here; the smallest, {smallest.quant.name}, needs {'at least ' if self.minimum else ''}"
                f"{format_bytes(smallest.need_bytes)}. Pass --force to try anyway."
            )
        shortfall = f"{chosen.describe(self.target_ctx, minimum=self.minimum)}; {self.capacity.describe()}"
        raise QuantDoesNotFit(
            f"{shortfall}; {tail}", quant=chosen.quant.name, suggestion=best.quant.name if best else None, shortfall=shortfall
        )

    def describe(self) -> str:
        if not self.target_ctx:
            context = "minimum figures: KV cache not counted (model shape unknown)"
        elif self.minimum:
            context = f"minimum figures, with {self.target_ctx} tokens of context (the least a plan launches with)"
        else:
            context = f"figures with {self.target_ctx} tokens of context (--ctx-size)"
        lines = [f"{self.capacity.describe()}; {context}"]
        needed = "at least" if self.minimum or not self.target_ctx else "needed"
        best = self.best
        in_ram = "fits (partly on the CPU)" if self.capacity.gpu_bytes > 0 else "fits in RAM"
        for option in self.options:
            verdict = "fits on the GPU" if option.fits_gpu else in_ram if option.fits else "does not fit"
            mark = " <- best" if option is best else ""
            lines.append(f"  {option.quant.name:<14} {format_bytes(option.need_bytes):>7} {needed}: {verdict}{mark}")
        return "\n".join(lines)


class QuantDoesNotFit(RuntimeError):
    """The chosen quant cannot load here. The message names what does fit (or that nothing does)."""

    def __init__(self, message: str, *, quant: str, suggestion: str | None, shortfall: str = ""):
        super().__init__(message)
        self.quant = quant
        self.suggestion = suggestion
        # Why it does not fit, without the advice to choose another quant or pass --force
        # (what a forced launch says: its operator has already chosen).
        self.shortfall = shortfall or message


def advise_quant(
    quants: Sequence[QuantOption], capacity: MemoryCapacity, *, model: ModelFacts | None, target_ctx: int, minimum: bool = True
) -> QuantAdvice:
    """Rate every quant against `capacity`. `model` gives the KV size; without it only weights count.
    `minimum`: `target_ctx` is the least context planned (`target_context` without `--ctx-size`)."""
    kv_per_token = model.kv_bytes_per_token() if model is not None else 0.0
    options = []
    for quant in sorted(quants, key=lambda q: q.total_bytes, reverse=True):
        need = memory_need_bytes(quant.total_bytes, kv_per_token, target_ctx)
        options.append(
            QuantFit(
                quant=quant,
                kv_bytes=int(kv_per_token * target_ctx),
                need_bytes=need,
                fits=need <= capacity.total_bytes,
                fits_gpu=capacity.gpu_bytes > 0 and need <= capacity.gpu_bytes,
            )
        )
    return QuantAdvice(capacity, target_ctx, tuple(options), minimum=minimum or model is None)


def target_context(model: ModelFacts | None, *, parallel: int, ctx_size: int | None) -> int:
    """The context a quant must leave room for: `--ctx-size` when given (0: the model's own),
    else every slot's minimum (`prepare.memory.ctx_floor`), the least the plan would launch with."""
    if model is None:
        return ctx_size or 0
    if ctx_size is not None:
        return ctx_size or model.context_length
    return ctx_floor(model, parallel)


def catalog_quant_options(entry: CatalogEntry) -> list[QuantOption]:
    return [QuantOption(q.name, q.total_bytes, q.shards) for q in entry.quants]


def advise_catalog_entry(entry: CatalogEntry, capacity: MemoryCapacity, *, parallel: int, ctx_size: int | None) -> QuantAdvice:
    """Rate a catalog entry's quants with its model shape (KV cache) when the catalog gives one."""
    model = ModelFacts.from_catalog(entry, entry.quants[0]) if entry.shape is not None else None
    target = target_context(model, parallel=parallel, ctx_size=ctx_size)
    return advise_quant(catalog_quant_options(entry), capacity, model=model, target_ctx=target, minimum=ctx_size is None)


def check_quant(
    quant: str,
    quants: Sequence[QuantOption],
    capacity: MemoryCapacity,
    *,
    model: ModelFacts | None,
    target_ctx: int,
) -> QuantFit:
    """Rate `quants` and check the chosen one in one call (`QuantAdvice.check`)."""
    return advise_quant(quants, capacity, model=model, target_ctx=target_ctx).check(quant)
