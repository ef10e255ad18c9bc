"""Everything decided before a node opens its port: binary, hardware, quant fit, model, launch plan.

`prepare_launch()` runs in the operator's order: a quant that cannot fit is
refused before any byte is downloaded, a model is launched only once downloaded
and verified, and a plan that does not fit is refused (`--force` overrides
both). Whatever fails here fails with a `NodeSetupError` that says what to do.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshnet_gguf.binary import BinaryInfo, BinaryNotFound, find_llama_server
from meshnet_gguf.catalog import DEMO_ID, Catalog, load_catalog, model_aliases
from meshnet_gguf.config import NodeSettings
from meshnet_gguf.cpu_compat import kernel_support
from meshnet_gguf.gguf_convert import dequantize_to_f16
from meshnet_gguf.gguf_info import GGUFError, check_shard_set, read_gguf_info
from meshnet_gguf.gguf_names import format_bytes, quant_of
from meshnet_gguf.hardware import HardwareReport, probe_configured
from meshnet_gguf.launch_plan import LaunchPlan, ModelFacts, plan_launch
from meshnet_gguf.model_source import (
    ModelResolutionError,
    ModelSpec,
    ResolvedModel,
    expected_first_shard,
    offered_quants,
    parse_model_spec,
    resolve_model,
    shards_on_disk,
)
from meshnet_gguf.quant_advisor import (
    QuantAdvice,
    QuantDoesNotFit,
    QuantOption,
    advise_quant,
    catalog_quant_options,
    check_quant,
    target_context,
)
from meshnet_gguf.supervisor import ChildSpec

log = logging.getLogger(__name__)

# Where `--demo` keeps its dequantized copy on CPUs the llama-server build is too new for.
DEMO_F16_FILE = "gemma-3-270m-f16.gguf"


class NodeSetupError(RuntimeError):
    """Something an operator must fix before the node can start; the message says what."""


@dataclass
class PreparedLaunch:
    """Everything decided before the node opens its port."""

    settings: NodeSettings
    binary: BinaryInfo
    model_path: Path  # shard 1: what `--model` gets (in a dry run, possibly where it will be)
    model_name: str  # `--alias`, /v1/models, /health and usage records: see `_model_name`
    quant: str | None
    child: ChildSpec
    notes: list[str] = field(default_factory=list)
    hardware: HardwareReport | None = None
    plan: LaunchPlan | None = None
    advice: QuantAdvice | None = None  # catalog and hub models: how every quant fits this box
    # The verified model on disk; in a dry run the unverified files found on disk, or None
    # when nothing is downloaded yet and the plan came from the catalog's figures.
    resolved: ResolvedModel | None = None
    # Other names the node answers to (`protocol.model_answers_to`): `demo` for `demo:Q4_K_M`, the file name.
    model_aliases: tuple[str, ...] = ()

    def describe(self) -> str:
        lines = []
        if self.hardware is not None:
            lines.append(f"hardware:  {self.hardware.summary()}")
            lines += [f"  note:    {note}" for note in self.hardware.notes]
        lines += [
            f"model:     {self.model_name} ({self.model_path})",
            f"binary:    {self.binary.describe()}",
        ]
        lines += [f"note:      {note}" for note in self.notes]
        if self.advice is not None:
            lines.append("quants:    " + self.advice.describe().replace("\n", "\n           "))
        if self.plan is not None:
            lines.append(self.plan.describe())
        command = shlex.join([str(self.binary.path), *self.child.args])
        lines.append(f"command:   {command} --host 127.0.0.1 --port <private>  (API key in LLAMA_API_KEY)")
        if self.child.env:
            lines.append("env:       " + " ".join(f"{k}={shlex.quote(v)}" for k, v in self.child.env.items()))
        return "\n".join(lines)


def prepare_launch(settings: NodeSettings, *, dry_run: bool = False) -> PreparedLaunch:
    """Find the binary, probe the hardware, check the quant fits, get the model, plan llama-server's flags.

    The order is the operator's: a quant that cannot fit is refused before any byte
    is downloaded (issue 4), a model is launched only once downloaded and verified
    (issue 3), and a plan that does not fit is refused (`--force` overrides both).
    A dry run downloads nothing: it plans from the files already on disk, or from
    the catalog's figures.
    """
    binary = _find_binary(settings)
    settings = _slots_from_llama_args(settings)
    hardware = _probe_hardware(settings, binary)
    catalog = load_catalog()
    try:
        spec = parse_model_spec(settings, catalog)
    except ModelResolutionError as exc:
        raise NodeSetupError(str(exc)) from exc
    advice = _check_quant_fits(spec, settings, hardware, catalog)

    notes: list[str] = []
    if dry_run:
        resolved, facts, model_name, quant = _plan_input_without_download(spec, settings, catalog, advice, notes)
        if spec is not None and spec.entry is not None and spec.entry.id == DEMO_ID:
            support = kernel_support(binary)
            demo_note = support.demo_note()
            if demo_note is not None:  # serving would run the F16 copy: say so, and name it as serving will
                notes.insert(0, demo_note)
                quant = support.demo_quant(quant or "")
                model_name = f"{DEMO_ID}:{quant}"
    else:
        resolved = _runnable_on_this_cpu(_resolve(settings, catalog), binary, settings)
        facts = _facts_of(resolved)
        model_name, quant = _model_name(resolved), resolved.quant

    plan = _plan(facts, hardware, settings, binary, model_name)
    operator_alias = _operator_value(settings.llama_args, ("-a", "--alias"))
    if operator_alias:
        model_name = operator_alias  # llama-server answers to the operator's alias; so must the proxy
    # The catalog's chat flags go first: the operator's --llama-arg, later in argv, wins.
    catalog_args = _catalog_llama_args(resolved, spec, catalog, binary)
    args = [*catalog_args, *plan.argv] if operator_alias else [*catalog_args, *plan.argv, "--alias", model_name]
    aliases = model_aliases(
        model_name, catalog,
        catalog_id=resolved.catalog_id if resolved is not None else (spec.entry.id if spec is not None and spec.entry else None),
        repo_id=resolved.repo_id if resolved is not None else (spec.repo_id if spec is not None else None),
        quant=quant, file_name=facts.path.name if facts.path is not None else None,
    )  # fmt: skip
    return PreparedLaunch(
        model_aliases=aliases,
        settings=settings,
        binary=binary,
        model_path=facts.path if facts.path is not None else Path(model_name),
        model_name=model_name,
        quant=quant,
        child=ChildSpec(binary=binary, args=args, env=dict(plan.env)),
        notes=notes,
        hardware=hardware,
        plan=plan,
        advice=advice,
        resolved=resolved,
    )


def _catalog_llama_args(resolved: ResolvedModel | None, spec: ModelSpec | None, catalog: Catalog, binary: BinaryInfo) -> list[str]:
    """What a catalog entry asks of llama-server (the demo's chat template and stop string)."""
    entry_id = resolved.catalog_id if resolved is not None else (spec.entry.id if spec is not None and spec.entry else None)
    entry = catalog.get(entry_id) if entry_id else None
    return entry.llama_args(binary.supports) if entry is not None else []


def _runnable_on_this_cpu(resolved: ResolvedModel, binary: BinaryInfo, settings: NodeSettings) -> ResolvedModel:
    """The demo as this llama-server can run it on this CPU: as downloaded, or an F16 copy.

    A build compiled for a newer CPU dies with SIGILL on quantized kernels (see
    `cpu_compat`). For the demo, whose job is to show a working node in one
    command, the dequantized copy (540 MB, made once) is the better answer;
    any other model is served as asked, and a crash is explained by the supervisor.
    Not called in a dry run, which must not write model files.
    """
    if resolved.catalog_id != DEMO_ID:
        return resolved
    support = kernel_support(binary)
    note = support.demo_note()
    if note is None:
        return resolved
    log.warning("%s", note)  # once, before the wait: why the demo runs as F16 and how to get quantized models running
    f16 = settings.download_dir / "demo" / DEMO_F16_FILE
    if not f16.is_file() or f16.stat().st_mtime < resolved.first_shard.stat().st_mtime:
        log.info("writing %s (once)", f16)
        dequantize_to_f16(resolved.first_shard, f16)
    return replace(
        resolved,
        first_shard=f16,
        shards=(f16,),
        total_bytes=f16.stat().st_size,
        sha256s=(None,),
        quant="F16",  # the name clients see says what really runs
        header=read_gguf_info(f16),
    )


def _model_name(resolved: ResolvedModel) -> str:
    """The name clients see (`--alias`, /v1/models, /health, usage records, the tracker).

    Catalog and hub models use their label, `deepseek-v4-flash:UD-IQ3_XXS` or
    `owner/name:Q4_K_M`: the same on every node that serves them, whatever the
    download dir, so a tracker can group those nodes. Local files use their file
    name without `.gguf` and without a split's `-00001-of-00003` (`Model-Q4_K_M`).
    """
    if resolved.catalog_id or resolved.repo_id:
        return resolved.label
    return resolved.name


def _find_binary(settings: NodeSettings) -> BinaryInfo:
    try:
        binary = find_llama_server(settings.llama_server)
    except BinaryNotFound as exc:
        raise NodeSetupError(str(exc)) from exc
    log.info("llama-server: %s", binary.describe())
    return binary


def _operator_value(args: list[str], spellings: tuple[str, ...]) -> str | None:
    """The last value `--llama-arg` gives an option (`--opt V` or `--opt=V`), as llama-server reads it."""
    value = None
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if flag in spellings:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
    return value


def _slots_from_llama_args(settings: NodeSettings) -> NodeSettings:
    """`--llama-arg --parallel N` sets the node's slots too: the proxy admits as many requests as llama-server has slots."""
    given = _operator_value(settings.llama_args, ("-np", "--parallel"))
    if given is None:
        return settings
    try:
        slots = int(given)
    except ValueError as exc:
        raise NodeSetupError(f"--llama-arg --parallel {given!r}: not a number of slots") from exc
    if slots < 1:
        raise NodeSetupError("--llama-arg --parallel must be at least 1; use --parallel N")
    if slots != settings.parallel:
        log.info("llama-server gets --parallel %d from --llama-arg; the proxy admits as many requests at once", slots)
    return settings.model_copy(update={"parallel": slots})


def _probe_hardware(settings: NodeSettings, binary: BinaryInfo) -> HardwareReport:
    fixture = settings.hardware_fixture
    try:
        hardware = probe_configured(binary, fixture)
    except FileNotFoundError as exc:
        raise NodeSetupError(f"hardware_fixture (MESHNET_HARDWARE_FIXTURE): {exc}") from exc
    if fixture is not None:
        log.warning("hardware: the recorded machine %s, not this one (a testing aid): its plan may not run here", fixture)
    log.info("hardware: %s", hardware.summary())
    for note in hardware.notes:
        log.info("hardware note: %s", note)
    return hardware


def _shape_facts(spec: ModelSpec, catalog: Catalog) -> ModelFacts | None:
    """The catalog's model shape for a catalog or curated hub model (sizes the KV cache before a download)."""
    entry = spec.entry or (catalog.by_repo(spec.repo_id) if spec.repo_id else None)
    if entry is None or entry.shape is None:
        return None
    return ModelFacts.from_catalog(entry, entry.quants[0])


def _check_quant_fits(spec: ModelSpec | None, settings: NodeSettings, hardware: HardwareReport, catalog: Catalog) -> QuantAdvice | None:
    """Before any download: rate the offered quants on this box and refuse one that cannot fit (issue 4).

    Catalog models are rated from the catalog's figures, hub repos from the hub's
    listing (sizes only; no model byte is fetched), with the KV cache from the
    catalog's model shape where the model is curated. Local files have nothing to
    choose from: the launch plan alone decides for them.
    """
    if spec is None or spec.kind == "local":
        return None
    facts = _shape_facts(spec, catalog)
    if spec.entry is not None:
        options = catalog_quant_options(spec.entry)
    else:
        assert spec.repo_id is not None
        try:
            offered = offered_quants(spec.repo_id, settings)
        except ModelResolutionError as exc:
            log.debug("no listing of %s for the quant check: %s", spec.repo_id, exc)
            return None  # resolving the model reports the same problem, with what to do
        options = [QuantOption(q.name, q.total_bytes, q.shards) for q in offered.quants if q.complete]
    if not options:
        return None
    target = target_context(facts, parallel=settings.parallel, ctx_size=settings.ctx_size)
    capacity = hardware.capacity()
    advice = advise_quant(options, capacity, model=facts, target_ctx=target)
    quant = spec.quant_or_only() or (options[0].name if len(options) == 1 else None)
    if quant is None:
        raise NodeSetupError(
            f"{spec.text} offers several quants; choose one with --quant (or {spec.text}:QUANT):\n" + advice.describe()
        )
    if advice.find(quant) is None:
        if spec.entry is not None:
            offered_names = ", ".join(q.name for q in spec.entry.quants)
            raise NodeSetupError(f"{spec.entry.id} has no quant {quant}; the catalog offers {offered_names}")
        return advice  # resolving the model lists what the repo offers
    try:
        fit = check_quant(quant, options, capacity, model=facts, target_ctx=target)
    except QuantDoesNotFit as exc:
        if not settings.force:
            raise NodeSetupError(str(exc)) from exc
        log.warning("--force: trying anyway although %s", exc)
    else:
        where = "on the GPU" if fit.fits_gpu else "partly on the CPU" if capacity.gpu_bytes else "in RAM"
        log.info("quant %s fits %s: %s; %s", fit.quant.name, where, fit.describe(target), capacity.describe())
    return advice


def _resolve(settings: NodeSettings, catalog: Catalog, *, progress: bool = True) -> ResolvedModel:
    try:
        return resolve_model(settings, progress=progress, catalog=catalog)
    except ModelResolutionError as exc:
        raise NodeSetupError(str(exc)) from exc


def _facts_of(resolved: ResolvedModel) -> ModelFacts:
    header = resolved.header
    if header is None:  # resolve_model always checks the header; re-read it if a caller dropped it
        try:
            header = check_shard_set(list(resolved.shards))
        except GGUFError as exc:
            raise NodeSetupError(f"{resolved.label} is not a loadable GGUF: {exc}") from exc
    return ModelFacts.from_gguf(header, resolved.total_bytes, path=resolved.first_shard)


def _plan_input_without_download(
    spec: ModelSpec | None,
    settings: NodeSettings,
    catalog: Catalog,
    advice: QuantAdvice | None,
    notes: list[str],
) -> tuple[ResolvedModel | None, ModelFacts, str, str | None]:
    """A dry run's model facts: from the files on disk when they are all there, else from the catalog."""
    if spec is None or spec.kind == "local":
        resolved = _resolve(settings, catalog, progress=False)  # local files: nothing to download
        return resolved, _facts_of(resolved), _model_name(resolved), resolved.quant
    quant = spec.quant_or_only()
    entry = spec.entry or (catalog.by_repo(spec.repo_id) if spec.repo_id else None)
    shards = shards_on_disk(spec, settings)
    if shards:
        try:
            header = check_shard_set(list(shards))
        except GGUFError as exc:
            raise NodeSetupError(f"{shards[0]} is not a loadable GGUF: {exc}") from exc
        resolved = ResolvedModel(
            first_shard=shards[0], shards=shards, total_bytes=sum(p.stat().st_size for p in shards),
            source="package" if entry is not None and entry.package else "hub", sha256s=tuple(None for _ in shards),
            verified=False, repo_id=spec.repo_id, quant=quant_of(shards[0].name) or quant,
            catalog_id=spec.entry.id if spec.entry is not None else None, header=header,
        )  # fmt: skip
        notes.append("on disk; a dry run does not re-check sha256 (serving does)")
        return resolved, _facts_of(resolved), _model_name(resolved), resolved.quant
    chosen = entry.quant(quant) if entry is not None and quant else None
    if entry is None or chosen is None or entry.shape is None:
        advised = f"\n{advice.describe()}" if advice is not None else ""
        raise NodeSetupError(
            f"{spec.text}{':' + quant if quant else ''} is not downloaded yet, and the catalog has no figures for it: "
            "the plan needs its GGUF header (layers, attention shape). Run `meshnet-gguf download "
            f"{spec.text}{' --quant ' + quant if quant else ''}` (or serve without --dry-run), then --dry-run again."
            + advised
        )
    path = expected_first_shard(entry, chosen, settings.download_dir)
    notes.append(f"not downloaded yet: planned from the catalog's figures ({format_bytes(chosen.total_bytes)}, "
                 f"{chosen.shards} shard{'s' if chosen.shards != 1 else ''})")  # fmt: skip
    facts = ModelFacts.from_catalog(entry, chosen, path=path)
    # A curated quant reached through its repo id keeps the name serving would give it.
    name = f"{entry.id}:{chosen.name}" if spec.entry is not None else f"{spec.repo_id}:{chosen.name}"
    return None, facts, name, chosen.name


def _plan(facts: ModelFacts, hardware: HardwareReport, settings: NodeSettings, binary: BinaryInfo, model_name: str) -> LaunchPlan:
    try:
        plan = plan_launch(facts, hardware, settings, binary)
    except ValueError as exc:  # a malformed --n-gpu-layers
        raise NodeSetupError(str(exc)) from exc
    log.info("launch plan for %s:\n%s", model_name, plan.describe())
    if not plan.fits:
        if settings.force:
            log.warning("--force: launching %s although the plan says it does not fit this machine", model_name)
        else:
            problems = "; ".join(plan.warnings) or "the estimate exceeds this machine's memory"
            raise NodeSetupError(
                f"{model_name} does not fit this machine: {problems}. Choose a smaller quant, lower --ctx-size or "
                f"--parallel, or pass --force to try anyway.\n{plan.describe()}"
            )
    return plan
