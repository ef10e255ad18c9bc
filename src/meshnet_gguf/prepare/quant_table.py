"""The quant table: every quant a source offers with what the launch plan needs for it on this box.

`meshnet-gguf models` prints it; `serve`, its dry run and `doctor` choose and refuse from the
same table (`pipeline.settle_quant`), so the four cannot drift. A row's figure is the launch
plan's (weights + KV cache for the planned context + compute buffers) when the catalog gives
the model's shape, else the quant advisor's floor (weights + compute buffers), marked a minimum.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.hardware.report import HardwareReport
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.models.catalog import Catalog, CatalogEntry
from meshnet_gguf.models.download import HubAccess
from meshnet_gguf.models.source import Offer, OfferedQuant, offered_by_catalog, offered_quants
from meshnet_gguf.prepare.memory import ModelFacts
from meshnet_gguf.prepare.plan import BinaryCapabilities, LaunchPlan, OperatorChoices, plan_launch
from meshnet_gguf.prepare.quant_advisor import QuantAdvice, QuantOption, advise_quant, target_context

# What a plan is made with when no llama-server was found (`doctor`, `models`): a binary that offers no option.
UNKNOWN_BINARY = BinaryInfo(path=Path("llama-server"), source="not found", version="unknown", build=None, help_text="")


class PlanRefused(ValueError):
    """The operator's flags cannot make a plan (a malformed --n-gpu-layers); the message says which."""


@dataclass
class ModelSize:
    """A model as the launch plan sees it: the figures `serve`, `doctor` and `models` print."""

    label: str
    total_bytes: int  # the weights: what is on disk, or what a download fetches
    local: bool  # already on disk (nothing to download)
    need_bytes: int  # what must fit: weights + KV cache for `ctx_size` + compute buffers (`prepare.memory`)
    ctx_size: int | None = None  # the planned context the figure holds
    prompt_cache_bytes: int = 0  # the plan's `--cache-ram`, on top of `need_bytes` (only RAM left free)
    # The plan's verdict when there is a plan: does it fit, and where do the layers go.
    fits: bool | None = None
    placement: Literal["gpu", "split", "cpu"] | None = None
    # True when there was no plan (no header, no catalog shape) and `need_bytes` is the quant
    # advisor's floor: weights + KV for the least context planned + compute buffers.
    minimum: bool = False

    def describe_need(self) -> str:
        """The figure in the words every command uses (`memory.MemoryUse.summary`)."""
        need = f"{'at least ' if self.minimum else ''}{format_bytes(self.need_bytes)}"
        context = f" with {self.ctx_size} tokens of context" if self.ctx_size else ""
        cache = f" + {format_bytes(self.prompt_cache_bytes)} of RAM for the prompt cache" if self.prompt_cache_bytes else ""
        return f"needs {need}{context}{cache}"


def size_as_planned(
    name: str, facts: ModelFacts, hardware: HardwareReport, operator: OperatorChoices, binary: BinaryCapabilities | None, *, local: bool
) -> ModelSize:
    """What the launch plan for `facts` on `hardware` needs: the one memory figure every command prints."""
    try:
        plan = plan_launch(facts, hardware, operator, binary or UNKNOWN_BINARY)
    except ValueError as exc:  # a malformed --n-gpu-layers
        raise PlanRefused(str(exc)) from exc
    return size_of(name, facts, plan, local=local)


def size_of(name: str, facts: ModelFacts, plan: LaunchPlan, *, local: bool) -> ModelSize:
    placement: Literal["gpu", "split", "cpu"] = (
        "cpu" if plan.cpu_only else "gpu" if plan.gpu_layers in (plan.total_layers, "auto") else "split"
    )
    return ModelSize(
        name, facts.total_bytes, local, plan.memory.need_bytes,
        ctx_size=plan.memory.ctx_size, prompt_cache_bytes=plan.memory.prompt_cache, fits=plan.fits, placement=placement,
    )  # fmt: skip


@dataclass(frozen=True)
class QuantRow:
    quant: OfferedQuant
    size: ModelSize


@dataclass(frozen=True)
class QuantTable:
    offer: Offer
    rows: tuple[QuantRow, ...]
    advice: QuantAdvice  # the complete quants rated on this box, as `serve` prints them
    shape_known: bool  # the catalog gives the model's shape: the KV cache is counted

    def row(self, name: str) -> QuantRow | None:
        return next((r for r in self.rows if r.quant.name == name), None)


def quant_table(
    offer: Offer, curated: CatalogEntry | None, hardware: HardwareReport, operator: OperatorChoices, binary: BinaryCapabilities | None
) -> QuantTable:
    """Every offered quant with the launch plan's figure for it here (`curated`: the catalog entry that gives the shape)."""
    facts = ModelFacts.from_catalog(curated, curated.quants[0]) if curated is not None and curated.shape is not None else None
    capacity = hardware.capacity()
    target = target_context(facts, parallel=operator.parallel, ctx_size=operator.ctx_size)
    options = [QuantOption(q.name, q.total_bytes, q.shards) for q in offer.quants]
    advice = advise_quant(
        [o for o, q in zip(options, offer.quants) if q.complete], capacity, model=facts, target_ctx=target,
        minimum=operator.ctx_size is None,
    )  # fmt: skip
    rows = []
    for quant, option in zip(offer.quants, options):
        if facts is not None:
            quant_facts = replace(facts, name=quant.name, total_bytes=quant.total_bytes, shard_count=quant.shards)
            size = size_as_planned(quant.name, quant_facts, hardware, operator, binary, local=False)
        else:
            fit = advise_quant([option], capacity, model=None, target_ctx=target).options[0]
            size = ModelSize(quant.name, quant.total_bytes, False, fit.need_bytes, fits=fit.fits, minimum=True)
        rows.append(QuantRow(quant, size))
    return QuantTable(offer, tuple(rows), advice, facts is not None)


def listed_quant_table(
    spec: str,
    download_dir: Path,
    access: HubAccess,
    catalog: Catalog,
    hardware: HardwareReport,
    operator: OperatorChoices,
    binary: BinaryCapabilities | None,
) -> QuantTable:
    """`meshnet-gguf models SPEC`: what a repo, catalog id or folder offers, each quant with the plan's figure here.
    Raises ModelResolutionError for what cannot be listed; the hub's listing is saved for --offline."""
    offer = offered_quants(spec, download_dir, access=access, catalog=catalog)
    return quant_table(offer, catalog.get(spec) or catalog.by_repo(spec), hardware, operator, binary)


def catalog_quant_tables(
    catalog: Catalog, hardware: HardwareReport, operator: OperatorChoices, binary: BinaryCapabilities | None
) -> list[tuple[CatalogEntry, QuantTable]]:
    """`meshnet-gguf models`: every catalog entry's quants with the plan's figure here."""
    return [(entry, quant_table(offered_by_catalog(entry), entry, hardware, operator, binary)) for entry in catalog.entries]
