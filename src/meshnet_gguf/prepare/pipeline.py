"""Preparing a launch: everything decided before a node opens its port, as one straight pipeline.

    read the request ─► a binary that runs it here (built if none does) ─► probe the hardware
      ─► choose the quant (quant_table) ─► get the model (resolve, download, verify) ─► read its facts (the headers) ─► plan

Each step takes only the values it needs and returns the value the next one
takes; `prepare_launch` runs them in this order. `--dry-run` and `doctor` run the
same steps with one flag down (`may_write`): the model is found on disk rather
than fetched, the hub's listing is not saved and nothing is built (nothing is
downloaded, built or written). A quant that cannot fit is refused before any byte is
downloaded, a model is launched only once downloaded and verified, and a plan
that does not fit is refused (`--force` overrides both). Whatever fails here
fails with a `NodeSetupError` that says what to do.

The model source is asked once per step that needs it (`pick_source`, `offered`, then `fetch`
or `on_disk`), each answer a value whose fields the steps read; nothing here calls back into it.

The words: a *launch* is one start of llama-server for one model.
`PreparedLaunch` is what this module decides (model, binary, plan, command);
its `plan` is a `prepare.plan.LaunchPlan` (llama-server's flags and their memory,
`prepare.memory`); its `child` is the `llama.child.ChildSpec` the supervisor runs.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.common.units import format_bytes
from meshnet_gguf.hardware.report import HardwareReport, probe_configured
from meshnet_gguf.llama.binary import BinaryInfo, BinaryNotFound
from meshnet_gguf.llama.child import ChildSpec
from meshnet_gguf.llama.features import BinaryFeatures, missing_rpc
from meshnet_gguf.llama.model_set import ModelSetError
from meshnet_gguf.llama.run_probe import model_weight_types
from meshnet_gguf.llama.runnable import BinaryCannotRun, RunnableBinary, quant_weight_types, runnable_llama_server
from meshnet_gguf.llama.speed_choice import BinaryChoice
from meshnet_gguf.models.catalog import load_catalog, model_aliases
from meshnet_gguf.models.download import DownloadError, HubAccess, default_free_bytes
from meshnet_gguf.models.gguf_info import GGUFError, read_gguf_info
from meshnet_gguf.models.quants import QuantRequired
from meshnet_gguf.models.source import (
    CatalogSource,
    FileSource,
    HubFetch,
    ModelResolutionError,
    ModelSource,
    Offer,
    OfferedQuant,
    ResolvedModel,
    pick_source,
)
from meshnet_gguf.prepare.memory import ModelFacts
from meshnet_gguf.prepare.model_set_plan import OtherModels
from meshnet_gguf.prepare.plan import BinaryCapabilities, LaunchPlan, OperatorChoiceError, OperatorChoices, plan_launch
from meshnet_gguf.prepare.pool import (
    PoolError,
    PoolMember,
    PoolShare,
    check_pool,
    http_status_fetch,
    local_rpc_protocol,
    parse_pool_worker,
    pool_shares,
    pooled_plan,
)
from meshnet_gguf.prepare.quant_advisor import QuantAdvice, QuantDoesNotFit
from meshnet_gguf.prepare.quant_table import UNKNOWN_BINARY, ModelSize, PlanRefused, QuantTable, quant_table, size_of

log = logging.getLogger(__name__)

# Notes that a serving node logs as warnings: a plan made for another machine, or forced.
RECORDED_MACHINE_NOTE = "hardware: planned for the recorded machine (a testing aid)"
FORCE_NOTE_PREFIX = "--force:"
_WARNING_NOTES = (RECORDED_MACHINE_NOTE, "--force")


class NodeSetupError(RuntimeError):
    """Something an operator must fix before the node can start; the message says what."""


class DoesNotFit(NodeSetupError):
    """The model, its quant or its plan does not fit this machine (or the pool); `--force` tries anyway.
    `headline` is the message without the plan it may carry, for a dry run that printed the plan already."""

    def __init__(self, message: str, *, headline: str | None = None) -> None:
        super().__init__(message)
        self.headline = headline or message


@dataclass
class PreparedLaunch:
    """Everything decided before the node opens its port."""

    settings: NodeSettings  # as given, with `parallel` from `--llama-arg --parallel` when set there
    binary: BinaryInfo
    # What the binary can do (web UI, RPC, Vulkan): the page links a chat only where there is one.
    features: BinaryFeatures | None
    model_path: Path  # shard 1: what `--model` gets (in a dry run, possibly where it will be)
    model_name: str  # `--alias`, /v1/models, /health and usage records: see `_model_name`
    quant: str | None
    child: ChildSpec
    notes: list[str] = field(default_factory=list)
    hardware: HardwareReport | None = None
    plan: LaunchPlan | None = None
    facts: ModelFacts | None = None  # what the plan was made from: shard 1's header, or the catalog's figures
    advice: QuantAdvice | None = None  # catalog and hub models: how every quant fits this box
    # The verified model on disk; in a dry run the unverified files found on disk, or None
    # when nothing is downloaded yet and the plan came from the catalog's figures.
    resolved: ResolvedModel | None = None
    downloaded_bytes: int = 0  # fetched from the hub for this launch (0 when everything was on disk)
    # Other names the node answers to (`protocol.model_answers_to`): `demo` for `demo:Q4_K_M`, the file name.
    model_aliases: tuple[str, ...] = ()
    # The checked pool workers and each member's share (empty without --pool-worker).
    pool: tuple[PoolMember, ...] = ()
    pool_shares: tuple[PoolShare, ...] = ()
    # A dry run without --force: what serving would refuse this plan for (it is shown all the same).
    refusal: str | None = None
    # Which installed llama-server serves and why: the fastest measured, or why nothing was measured (step 8).
    binary_choice: BinaryChoice | None = None
    # Steps 4 and 5's answers, so step 8 plans the other llama-servers for the very same model files.
    quant_choice: QuantChoice | None = field(default=None, repr=False)
    model_on_disk: ModelOnDisk | None = field(default=None, repr=False)
    # The models served beside this one (a repeated --gguf, `[[models]]`), planned with it (step 9); None: this one alone.
    others: OtherModels | None = None

    @property
    def cpu_only(self) -> bool:
        """Whether llama-server runs on the CPU alone (no plan: as good as)."""
        return self.plan is None or self.plan.cpu_only

    @property
    def model_files(self) -> tuple[Path, ...]:
        """The model's files on disk (every shard), or where shard 1 will be."""
        return tuple(self.resolved.shards) if self.resolved is not None else (self.model_path,)

    def describe(self) -> str:
        lines = []
        if self.hardware is not None:
            lines.append(f"hardware:  {self.hardware.summary()}")
            lines += [f"  note:    {note}" for note in self.hardware.notes]
        lines += [
            f"model:     {self.model_name} ({self.model_path})",
            f"binary:    {self.binary.describe()}",
        ]
        if self.features is not None:
            lines.append(f"features:  {self.features.describe()}")
        if self.binary_choice is not None:
            lines.append("chosen:    " + "\n           ".join(self.binary_choice.lines()))
        lines += [f"note:      {note}" for note in self.notes]
        if self.advice is not None:
            lines.append("quants:    " + self.advice.describe().replace("\n", "\n           "))
        if self.plan is not None:
            lines.append(self.plan.describe(with_argv=False))  # the command line below has it all
        command = shlex.join([str(self.binary.path), *self.child.args])
        lines.append(f"command:   {command} --host 127.0.0.1 --port <private>  (API key in LLAMA_API_KEY)")
        if self.child.env:
            lines.append("env:       " + " ".join(f"{k}={shlex.quote(v)}" for k, v in self.child.env.items()))
        if self.others is not None:
            lines.append(self.others.describe())
        return "\n".join(lines)


@dataclass(frozen=True)
class LaunchRequest:
    """Step 1's answer: what the operator asked for, read once (the model source and llama-server's options)."""

    source: ModelSource
    operator: OperatorChoices


@dataclass(frozen=True)
class QuantChoice:
    """Step 4's answer: the source, the row chosen, and how every offered quant fits."""

    source: ModelSource
    advice: QuantAdvice | None
    notes: tuple[str, ...] = ()
    offer: Offer | None = None  # None: a dry run that could not list the source (nothing to plan from but the catalog)
    chosen: OfferedQuant | None = None
    table: QuantTable | None = None  # catalog and hub models: every offered quant with the plan's figure here


@dataclass(frozen=True)
class ModelOnDisk:
    """Step 5's answer: the files, or (dry run, nothing downloaded yet) where they will be."""

    resolved: ResolvedModel | None  # None: planned from the catalog's figures
    facts: ModelFacts
    name: str
    quant: str | None
    notes: tuple[str, ...] = ()


class NotDownloadedYet(NodeSetupError):
    """A dry run (or `doctor`) with nothing on disk to plan from, and no catalog figures: `choice` says what fits."""

    def __init__(self, message: str, choice: QuantChoice) -> None:
        super().__init__(message)
        self.choice = choice


# --------------------------------------------------------------------------- the pipeline


def prepare_launch(
    settings: NodeSettings, *, dry_run: bool = False, pool_token: Callable[[], str] | None = None, measure: bool | None = None
) -> PreparedLaunch:
    """Run the pipeline for `serve`. A dry run downloads nothing, and logs nothing it then prints.
    `pool_token` gives a status token signed by the node's key, for the pool workers' check.
    `measure` (serving's default; a dry run's is off) lets step 8 run the installed llama-servers it has no figures for."""
    request = read_request(settings)
    runnable = runnable_binary(settings, request.source, dry_run=dry_run)
    binary = runnable.binary
    hardware = probe(binary, settings.hardware_fixture)
    pool = check_pool_workers(settings, binary, pool_token)
    try:
        launch = prepare_with(request, settings, binary, hardware, dry_run=dry_run, pool=pool, features=runnable.features)
    except DoesNotFit as exc:
        if not dry_run:
            raise
        # A dry run shows the plan serving would refuse, then the refusal: planned as --force would, said unforced.
        forced = settings.model_copy(update={"force": True})
        launch = prepare_with(request, forced, binary, hardware, dry_run=True, pool=pool, features=runnable.features)
        launch.settings = launch.settings.model_copy(update={"force": False})
        launch.notes = [note for note in launch.notes if not note.startswith(FORCE_NOTE_PREFIX)]
        launch.refusal = exc.headline
    launch.notes[:0] = runnable.notes
    launch = choose_binary(launch, request, settings, runnable, measure=not dry_run if measure is None else measure)
    if settings.models:
        launch.others = prepare_other_models(launch, settings, dry_run=dry_run)
    if not dry_run:
        _log_launch(launch)
    return launch


def prepare_other_models(launch: PreparedLaunch, settings: NodeSettings, *, dry_run: bool) -> OtherModels:
    """Step 9: each model beside the first through steps 4 to 7 (the first one's binary and hardware), then the
    set placed together (`prepare/model_set_plan`): refused naming the model that would not fit, unless `--force`."""
    from meshnet_gguf.llama.model_set import ModelSet
    from meshnet_gguf.prepare.model_set_plan import ModelSetDoesNotFit, checked_set, entry_settings, fit_together, model_to_serve, need_of

    assert launch.hardware is not None, "planned after the hardware was probed"
    served, children, plans = [], {}, {}
    for entry in settings.models:
        own = entry_settings(settings, entry)
        try:
            prepared = prepare_with(read_request(own), own, launch.binary, launch.hardware, dry_run=dry_run, features=launch.features)
        except NodeSetupError as exc:
            raise type(exc)(f"--gguf {entry.gguf}: {exc}") from exc
        model = model_to_serve(
            entry, settings, path=prepared.model_path, alias=prepared.model_name, quant=prepared.quant, plan=prepared.plan
        )
        served.append(model)
        children[model.alias] = prepared.child
        if prepared.plan is not None:
            plans[model.alias] = prepared.plan
    try:
        models = checked_set(served, [launch.model_name, *launch.model_aliases], on_disk=not dry_run)
    except ModelSetError as exc:
        raise NodeSetupError(str(exc)) from exc
    first = need_of(launch.model_name, launch.plan, pinned=True)
    needs = {m.alias: need_of(m.alias, plans.get(m.alias), pinned=m.pinned) for m in models}
    notes: tuple[str, ...] = ()
    budget: int | None = None
    try:
        room = fit_together(first, list(needs.values()), launch.hardware.capacity())
        # Each model counted in the one figure the children make room by: its share of the room, GPU included.
        models = ModelSet(tuple(replace(m, memory_bytes=room.cost(needs[m.alias]) or None) for m in models))
        budget = room.total_bytes
    except ModelSetDoesNotFit as exc:
        if not settings.force:
            raise DoesNotFit(f"{exc}; or pass --force to try anyway") from exc
        notes = (f"{FORCE_NOTE_PREFIX} serving these models although {exc}",)
    return OtherModels(models, children, budget, plans, notes)


def choose_binary(
    launch: PreparedLaunch, request: LaunchRequest, settings: NodeSettings, runnable: RunnableBinary, *, measure: bool
) -> PreparedLaunch:
    """Step 8: where several installed llama-servers run the model, the launch with the fastest here
    (`prepare/binary_choice`); else `launch` as it is, saying why nothing was measured."""
    from meshnet_gguf.prepare.binary_choice import fastest_launch

    return fastest_launch(
        launch, settings, runnable,
        plan_for=lambda other, hardware: launch_for(request, settings, other.binary, hardware, features=other.features,
                                                    choice=launch.quant_choice, model=launch.model_on_disk),
        hardware_for=lambda binary: probe(binary, settings.hardware_fixture), measure=measure,
    )  # fmt: skip


def runnable_binary(settings: NodeSettings, source: ModelSource, *, dry_run: bool) -> RunnableBinary:
    """Step 2: a llama-server that runs this model's weight types on this machine, built here when none does
    (not in a dry run, which says so instead; not with `--no-build`, which refuses with the fix)."""
    try:
        return runnable_llama_server(
            settings.llama_server, source_weight_types(source), may_build=settings.build, dry_run=dry_run,
            build_source=settings.build_source,
        )  # fmt: skip
    except (BinaryNotFound, BinaryCannotRun) as exc:
        raise NodeSetupError(str(exc)) from exc


def source_weight_types(source: ModelSource) -> tuple[str, ...]:
    """The weight types to probe a binary with before the model is fetched: a local file's own, else its quant's name."""
    if isinstance(source, FileSource):
        try:
            header = read_gguf_info(source.path)
        except GGUFError:
            return quant_weight_types(source.quant)  # getting the model says what is wrong with the file
        return model_weight_types(header.file_type, header.tensor_types)
    entry = source.entry  # a field: the source is not asked again before step 4
    # The asked-for quant, else the catalog entry's first (its only one, or the one to probe with).
    return quant_weight_types(source.quant if source.quant is not None else entry.quants[0].name if entry is not None else None)


def check_pool_workers(settings: NodeSettings, binary: BinaryInfo, token: Callable[[], str] | None) -> list[PoolMember]:
    """Step 3b: every `--pool-worker` reachable, on this build's RPC protocol, with its budget free."""
    if not settings.pool_workers:
        return []
    if not binary.supports("--rpc"):
        raise NodeSetupError(f"--pool-worker: {missing_rpc(binary)}")
    if token is None:
        raise NodeSetupError("pool workers need the node's key to read their status")
    try:
        specs = [parse_pool_worker(text) for text in settings.pool_workers]
        return check_pool(specs, http_status_fetch(token), local_rpc_protocol(binary))
    except (ValueError, PoolError) as exc:
        raise NodeSetupError(f"{exc}; not starting") from exc


def read_request(settings: NodeSettings) -> LaunchRequest:
    """Step 1: the model source and llama-server's options, parsed once."""
    try:
        source = pick_source(settings.gguf, quant=settings.quant, demo=settings.demo, catalog=load_catalog())
        operator = OperatorChoices.read(
            parallel=settings.parallel, ctx_size=settings.ctx_size, n_gpu_layers=settings.n_gpu_layers,
            llama_args=settings.llama_args,
        )  # fmt: skip
    except (ModelResolutionError, OperatorChoiceError) as exc:
        raise NodeSetupError(str(exc)) from exc
    return LaunchRequest(source, operator)


def probe(binary: BinaryInfo | None, fixture: Path | None) -> HardwareReport:
    """Step 3: this machine, or the recorded one `fixture` names (a testing and diagnosis aid)."""
    try:
        return probe_configured(binary, fixture)
    except FileNotFoundError as exc:
        raise NodeSetupError(f"hardware_fixture (MESHNET_HARDWARE_FIXTURE): {exc}") from exc


def prepare_with(
    request: LaunchRequest,
    settings: NodeSettings,
    binary: BinaryInfo,
    hardware: HardwareReport,
    *,
    dry_run: bool,
    pool: Sequence[PoolMember] = (),
    features: BinaryFeatures | None = None,
) -> PreparedLaunch:
    """Steps 4 to 7, for a binary and hardware already known (and a pool already checked)."""
    force = settings.force
    access = HubAccess.from_environment(offline=settings.offline)
    # With a pool, fitting this box alone is not the question: the pooled plan's check decides.
    choice = settle_quant(
        request.source, request.operator, hardware, binary, settings.download_dir, access, force=force or bool(pool),
        may_write=not dry_run,
    )  # fmt: skip
    model = get_model(choice, settings.download_dir, access, hardware, may_write=not dry_run)
    return launch_for(request, settings, binary, hardware, choice=choice, model=model, pool=pool, features=features)


def launch_for(
    request: LaunchRequest,
    settings: NodeSettings,
    binary: BinaryInfo,
    hardware: HardwareReport,
    *,
    choice: QuantChoice | None,
    model: ModelOnDisk | None,
    pool: Sequence[PoolMember] = (),
    features: BinaryFeatures | None = None,
) -> PreparedLaunch:
    """Steps 7 and on: the plan and the command for a model already chosen and found (steps 4 and 5's answers)."""
    assert choice is not None and model is not None, "planned after the model was chosen and found"
    force = settings.force
    plan = checked_plan(model, hardware, request.operator, binary, force=force or bool(pool))
    shares: tuple[PoolShare, ...] = ()
    if pool:
        plan, shares = checked_pool_plan(plan, pool, model, hardware, force=force)
    operator_alias = request.operator.alias
    # llama-server answers to the operator's alias when one is given; so must the proxy.
    name = operator_alias or model.name
    # The catalog's chat flags (the demo's template and stop) go first: the operator's --llama-arg, later, wins.
    entry = choice.source.entry
    catalog_args = entry.llama_args(binary.supports) if entry is not None else []
    args = [*catalog_args, *plan.argv] if operator_alias else [*catalog_args, *plan.argv, "--alias", name]
    notes = [*choice.notes, *model.notes]
    if settings.hardware_fixture is not None:
        notes.insert(0, f"{RECORDED_MACHINE_NOTE} {settings.hardware_fixture}, not this one: its plan may not run here")
    if not plan.fits and force:
        notes.append(f"{FORCE_NOTE_PREFIX} launching {name} although the plan says it does not fit this machine")
    return PreparedLaunch(
        settings=settings.model_copy(update={"parallel": request.operator.parallel}),
        binary=binary,
        features=features,
        model_path=model.facts.path if model.facts.path is not None else Path(name),
        model_name=name,
        quant=model.quant,
        child=ChildSpec(binary=binary, args=args, env=dict(plan.env)),
        notes=notes,
        hardware=hardware,
        plan=plan,
        facts=model.facts,
        advice=choice.advice,
        resolved=model.resolved,
        downloaded_bytes=model.resolved.fetched_bytes if model.resolved is not None else 0,
        model_aliases=model_aliases(
            name,
            load_catalog(),
            catalog_id=entry.id if entry is not None else None,
            repo_id=choice.source.repo_id,
            quant=model.quant,
            file_name=model.facts.path.name if model.facts.path is not None else None,
        ),  # fmt: skip
        pool=tuple(pool),
        pool_shares=shares,
        quant_choice=choice,
        model_on_disk=model,
    )


def settle_quant(
    source: ModelSource,
    operator: OperatorChoices,
    hardware: HardwareReport,
    binary: BinaryCapabilities | None,
    download_dir: Path,
    access: HubAccess,
    *,
    force: bool,
    may_write: bool,
) -> QuantChoice:
    """Step 4, before any download: what the source offers, rated on this box (`quant_table`), one quant
    chosen (`models.source.choose_quant`), and refused when it cannot fit.

    Catalog models and curated repos are rated with the catalog's model shape (KV
    cache); a hub repo's quants come from its listing (sizes only; no model byte is
    fetched), and a curated repo's from the catalog when the hub cannot be asked.
    Local files and folders are not rated: the launch plan alone decides for them.
    Without `may_write` (a dry run, `doctor`) the hub's listing is not saved, and a hub that
    cannot be asked leaves the listing saved by the last download to answer.
    """
    notes: list[str] = []
    try:
        offer = source.offered(download_dir, access, may_write=may_write)  # the rows and the one chosen, in one call
    except (ModelResolutionError, DownloadError) as exc:
        if may_write or source.local:
            raise NodeSetupError(str(exc)) from exc
        offer = _offered_offline(source, download_dir)
        if offer is None:
            log.debug("no listing of %s for the quant check: %s", source.text, exc)
            return QuantChoice(source, None)  # planning reports what to do
        if offer.source == "catalog":
            notes.append(f"the hub did not list {source.repo_id} ({exc}): rated the catalog's quants of it")
    try:
        table = None if source.local else quant_table(offer, source.curated, hardware, operator, binary)
    except PlanRefused as exc:
        raise NodeSetupError(str(exc)) from exc
    advice = table.advice if table is not None and table.advice.options else None
    chosen = offer.chosen
    if chosen is None:
        refusal = offer.refusal
        assert refusal is not None, "an offer chooses a row or says why not"
        if isinstance(refusal.__cause__, QuantRequired) and advice is not None:
            raise NodeSetupError(
                f"{source.text} offers several quants; choose one with --quant (or {source.text}:QUANT):\n" + advice.describe()
            ) from refusal
        raise NodeSetupError(str(refusal)) from refusal
    choice = QuantChoice(source, advice, tuple(notes), offer, chosen, table)
    if advice is None or advice.find(chosen.name) is None:
        return choice
    capacity = hardware.capacity()
    try:
        fit = advice.check(chosen.name)
    except QuantDoesNotFit as exc:
        if not force:
            raise DoesNotFit(str(exc)) from exc
        return replace(choice, notes=(*notes, f"{FORCE_NOTE_PREFIX} trying anyway although {exc.shortfall}"))
    where = "on the GPU" if fit.fits_gpu else "partly on the CPU" if capacity.gpu_bytes else "in RAM"
    floor = "the least context a plan launches with; the plan below gives it what memory allows" if advice.minimum else "--ctx-size"
    fitting = f"quant {fit.quant.name} fits {where}: {fit.describe(advice.target_ctx, minimum=advice.minimum)} ({floor})"
    return replace(choice, notes=(*notes, fitting))


def _offered_offline(source: ModelSource, download_dir: Path) -> Offer | None:
    """What a source offers as this machine knows it (the saved listing, its folder, the catalog), or None."""
    try:
        return source.offered(download_dir, HubAccess(endpoint="", token=None, offline=True), may_write=False)
    except (ModelResolutionError, DownloadError):
        return None


def get_model(choice: QuantChoice, download_dir: Path, access: HubAccess, hardware: HardwareReport, *, may_write: bool) -> ModelOnDisk:
    """Step 5: serving, resolve, download and verify the chosen quant, header-checked. Without `may_write`
    (a dry run, `doctor`): the files already on disk, or where the catalog says they will be; nothing is
    fetched or written, and files on disk are header-checked but not re-hashed."""
    if not may_write:
        return _find_model(choice, download_dir)
    assert choice.offer is not None and choice.chosen is not None, "serving lists the source or stops"
    capacity = hardware.capacity().total_bytes
    hub = HubFetch(download_dir, access, True, default_free_bytes, lambda: capacity)
    try:
        resolved = choice.source.fetch(choice.offer, choice.chosen, hub)  # downloaded, verified and header-checked
    except DownloadError as exc:
        raise NodeSetupError(str(exc)) from exc
    except ModelResolutionError as exc:
        raise NodeSetupError(str(exc)) from exc
    log.info(
        "model %s: %s in %d file(s)%s, first shard %s",
        resolved.label, format_bytes(resolved.total_bytes), len(resolved.shards),
        ", sha256 verified" if resolved.verified else "", resolved.first_shard,
    )  # fmt: skip
    return ModelOnDisk(resolved, _facts_of(resolved), _model_name(resolved), resolved.quant)


def _find_model(choice: QuantChoice, download_dir: Path) -> ModelOnDisk:
    source = choice.source
    try:
        found = source.on_disk(choice.chosen, download_dir)  # the files header-checked, or where they will be, in one call
    except ModelResolutionError as exc:
        raise NodeSetupError(str(exc)) from exc
    resolved = found.model
    if resolved is not None:
        notes = () if source.local else ("on disk; a dry run does not re-check sha256 (serving does)",)
        return ModelOnDisk(resolved, _facts_of(resolved), _model_name(resolved), resolved.quant, notes)
    quant = found.quant
    entry = source.curated
    chosen = found.catalog_quant
    if entry is None or chosen is None or found.first_shard is None or entry.shape is None:
        advised = f"\n{choice.advice.describe()}" if choice.advice is not None else ""
        raise NotDownloadedYet(
            f"{source.text}{':' + quant if quant else ''} is not downloaded yet, and the catalog has no figures for it: "
            "the plan needs its GGUF header (layers, attention shape). Run `meshnet-gguf download "
            f"{source.text}{' --quant ' + quant if quant else ''}` (or serve without --dry-run), then --dry-run again." + advised,
            choice,
        )
    path = found.first_shard
    note = (f"not downloaded yet: planned from the catalog's figures ({format_bytes(chosen.total_bytes)}, "
            f"{chosen.shards} shard{'s' if chosen.shards != 1 else ''})")  # fmt: skip
    # A curated quant reached through its repo id keeps the name serving would give it.
    name = f"{entry.id}:{chosen.name}" if isinstance(source, CatalogSource) else f"{source.repo_id}:{chosen.name}"
    return ModelOnDisk(None, ModelFacts.from_catalog(entry, chosen, path=path), name, chosen.name, (note,))


def checked_plan(
    model: ModelOnDisk, hardware: HardwareReport, operator: OperatorChoices, binary: BinaryCapabilities, *, force: bool
) -> LaunchPlan:
    """Step 7: llama-server's flags for this model on this box; refused when it does not fit (unless `force`)."""
    try:
        plan = plan_launch(model.facts, hardware, operator, binary)
    except ValueError as exc:  # a malformed --n-gpu-layers
        raise NodeSetupError(str(exc)) from exc
    if not plan.fits and not force:
        problems = "; ".join(plan.warnings) or "the estimate exceeds this machine's memory"
        headline = (
            f"{model.name} does not fit this machine: {problems}. Choose a smaller quant, lower --ctx-size or "
            "--parallel, or pass --force to try anyway."
        )
        raise DoesNotFit(f"{headline}\n{plan.describe()}", headline=headline)
    return plan


def checked_pool_plan(
    plan: LaunchPlan, pool: Sequence[PoolMember], model: ModelOnDisk, hardware: HardwareReport, *, force: bool
) -> tuple[LaunchPlan, tuple[PoolShare, ...]]:
    """Step 7b: the plan spread over the pool, and each member's share; refused when the pool cannot hold it (unless `force`)."""
    facts = model.facts
    to_place = facts.total_bytes + int(facts.kv_bytes_per_token() * (plan.ctx_size or facts.context_length))
    local_budget = hardware.capacity().gpu_bytes
    pooled = pooled_plan(plan, pool, local_budget, to_place)
    if not pooled.fits and not force:
        headline = f"{model.name}: {'; '.join(pooled.warnings)}. Choose a smaller quant or pass --force."
        raise DoesNotFit(f"{headline}\n{pooled.describe()}", headline=headline)
    shares = pool_shares(pool, None if plan.cpu_only else plan.device, local_budget, to_place)
    return pooled, tuple(shares)


# --------------------------------------------------------------------------- step helpers


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


def _facts_of(resolved: ResolvedModel) -> ModelFacts:
    """Step 6: the model's facts from shard 1's header, which `models.source` has already checked."""
    assert resolved.header is not None, "models.source returns header-checked models only"
    return ModelFacts.from_gguf(resolved.header, resolved.total_bytes, path=resolved.first_shard)


def _log_launch(launch: PreparedLaunch) -> None:
    """What a serving node says at start (a dry run prints `describe()` instead)."""
    log.info("llama-server: %s", launch.binary.describe())
    if launch.binary_choice is not None:
        log.info("llama-server chosen: %s", launch.binary_choice.describe())
    hardware = launch.hardware
    if hardware is not None:
        log.info("hardware: %s", hardware.summary())
        for note in hardware.notes:
            log.info("hardware note: %s", note)
    for note in launch.notes:
        (log.warning if note.startswith(_WARNING_NOTES) else log.info)("%s", note)
    if launch.plan is not None:
        log.info("launch plan for %s:\n%s", launch.model_name, launch.plan.describe())


# --------------------------------------------------------------------------- doctor


def model_size(settings: NodeSettings, binary: BinaryInfo | None, hardware: HardwareReport) -> ModelSize | None:
    """The configured model's size and memory as `serve --dry-run` plans it, for `doctor`'s memory and disk checks.

    The same pipeline as `serve`, with the binary and hardware doctor has already
    probed, and nothing downloaded or written (forced: doctor reports a misfit, it
    does not stop at it). A hub model that is neither on disk nor in the catalog has
    no header to plan from: its row of the quant table (the advisor's floor) stands in.
    """
    forced = settings.model_copy(update={"force": True})
    try:
        launch = prepare_with(read_request(settings), forced, binary or UNKNOWN_BINARY, hardware, dry_run=True)
    except NotDownloadedYet as exc:
        choice = exc.choice
        row = choice.table.row(choice.chosen.name) if choice.table is not None and choice.chosen is not None else None
        if row is None or choice.advice is None:
            raise
        return replace(row.size, label=f"{choice.source.text}:{row.quant.name}", ctx_size=choice.advice.target_ctx or None)
    assert launch.plan is not None and launch.facts is not None
    return size_of(launch.model_name, launch.facts, launch.plan, local=launch.resolved is not None)


def pool_summary(settings: NodeSettings, token: Callable[[], str], binary: BinaryInfo, hardware: HardwareReport) -> str:
    """For `doctor`: the pool workers checked as `serve` checks them, and the configured model's pooled
    plan as `serve --dry-run` makes it (workers named by place, never by address). NodeSetupError
    names the worker that is away, or says the pool cannot hold the model."""
    from meshnet_gguf.prepare.pool import shares_line, worker_name

    members = check_pool_workers(settings, binary, token)
    workers = ", ".join(f"{worker_name(i)} {format_bytes(m.budget_bytes)} (RPC protocol {m.protocol})" for i, m in enumerate(members))
    if settings.gguf is None and not settings.demo:
        return f"{len(members)} worker(s) up: {workers}"
    launch = prepare_with(read_request(settings), settings, binary, hardware, dry_run=True, pool=members)
    return f"{len(members)} worker(s) up: {workers}; {launch.model_name} pooled: {shares_line(launch.pool_shares)}"
