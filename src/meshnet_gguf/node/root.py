"""The composition root: every part a running node has, built in one place, one builder call per wing.

`build_node()` reads top to bottom: each part is built with what it needs passed in, nothing is
attached afterwards. The parts of the node itself (the state dir's lock, the model files held,
systemd, llama-server's supervisor, the metrics) are built here; the wings build theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import psutil

from meshnet_gguf import __version__
from meshnet_gguf.common.logs import register_secret
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import HealthReport
from meshnet_gguf.llama.load_progress import model_file_bytes
from meshnet_gguf.llama.model_children import IDLE_SWEEP_INTERVAL_S, ModelChildren
from meshnet_gguf.llama.model_set import ModelSetError
from meshnet_gguf.llama.pool_monitor import PoolMonitor
from meshnet_gguf.llama.speed_probe import DEFAULT_SPEED_PROBE
from meshnet_gguf.llama.supervisor import Supervisor, SupervisorPolicy
from meshnet_gguf.llama.upstream import UpstreamClient
from meshnet_gguf.llama.upstream.choice import make_upstream_client
from meshnet_gguf.llama.warmup import warmup_for
from meshnet_gguf.models.in_use import ModelFilesHeld
from meshnet_gguf.node.listener import build_listener
from meshnet_gguf.node.mesh import MeshWing, NodeKeys, announce_other_models, build_mesh
from meshnet_gguf.node.pool import build_pool
from meshnet_gguf.node.run import Node
from meshnet_gguf.ops.metrics import NodeMetrics, fetch_llama_metrics, llama_up_text
from meshnet_gguf.ops.model_metrics import ModelsCollector
from meshnet_gguf.ops.sd_notify import SystemdNotifier, watchdog_interval
from meshnet_gguf.ops.state_lock import StateDirInUse, StateDirLock
from meshnet_gguf.ops.systemd_part import OperationsPart, ServedAt
from meshnet_gguf.prepare.pipeline import NodeSetupError, PreparedLaunch
from meshnet_gguf.serving.prompt_count import PromptCounter, stored_prompt_counter
from meshnet_gguf.serving.slots import Slots
from meshnet_gguf.serving.status_page import RecentRequests
from meshnet_gguf.serving.upstream_target import UpstreamTarget
from meshnet_gguf.serving.usage_journal import UsageJournal
from meshnet_gguf.serving.usage_stats import UsageLog, UsageStats

# llama-server's own /metrics exists only when it was started with this flag.
LLAMA_METRICS_FLAG = "--metrics"
# How many idle sweeps fit in the shortest idle time of the models beside the first: one is unloaded at most
# a quarter of its idle time late.
IDLE_SWEEPS_PER_UNLOAD = 4


def build_node(launch: PreparedLaunch, keys: NodeKeys | None) -> Node:
    """Every part of a node, wired in the order a request meets them. `keys` are the node's key and the
    tracker key it trusts, from `node_keys` (settled once per run): the pool monitor, the relay links and
    the tracker link all sign with the one, the tracker link trusts the other."""
    settings = launch.settings
    if keys is None and (launch.pool or settings.tracker or settings.relay_url):
        raise ValueError("a node with a pool, a tracker or a relay signs with its key: pass node_keys(settings)")
    # First: the identity, ledger and llama-server pidfile in the state dir are this node's alone.
    state_lock = hold_state_dir(settings)
    # A shared lock on each model file while the node lives: `meshnet-gguf rm` will not remove them.
    shards = launch.resolved.shards if launch.resolved else (launch.model_path,)
    other_files = [m.path for m in launch.others.models] if launch.others else []
    model_files = ModelFilesHeld([f for f in (*shards, *other_files) if f.is_file()], settings.download_dir)
    # Each model beside the first brings its own slots: a request for it takes one of the node's as any does.
    slots = Slots(total=settings.parallel + (sum(m.slots for m in launch.others.models) if launch.others else 0))
    usage_stats, recent_requests = UsageStats(), RecentRequests()
    # The health report reads the node built at the end of this function; nothing asks for it before.
    health = lambda: node.health_report()  # noqa: E731
    operations = _operations(launch, slots, health)
    # With a LAN pool: llama-server runs only while every worker is up (the monitor's word).
    pool = build_pool(launch, keys.identity if keys else None)
    supervisor = _supervisor(launch, operations, pool)
    # The models beside the first: one llama-server each, loaded on demand, unloaded when idle.
    others = _other_models(launch)
    for secret in (supervisor.api_key, settings.api_key, settings.enrolment_secret, settings.metrics_key):
        register_secret(secret)
    upstream = _upstream_of(supervisor)
    upstream_client = make_upstream_client(settings.upstream_client, settings.parallel)
    # One counter of prompts, for the proxy's requests and, meshed, for a prompt the previous run died
    # before counting (its body kept in the ledger).
    prompt_counter = PromptCounter(upstream_client, settings.retry_after_s)
    mesh = build_mesh(launch, keys, health, stored_prompt_counter(upstream, prompt_counter))
    # Meshed, each model beside the first is announced in its child's state now (loaded, loadable, unavailable).
    announce_other_models(mesh.tracker_link, launch, others)
    # Standalone, usage is kept in an append-only journal (a meshed node's ledger keeps it otherwise).
    journal = UsageJournal.in_state_dir(settings.state_dir) if mesh.tracker_link is None else None
    metrics = _metrics(launch, slots, supervisor, operations, mesh, upstream, upstream_client)
    models_status = _models_status(launch, supervisor, health, others)
    if others is not None:  # each model a label value of the meshnet_model_* metrics
        metrics.registry.register(ModelsCollector(models_status))
    http = build_listener(
        launch,
        upstream=upstream,
        client=upstream_client,
        slots=slots,
        prompt_counter=prompt_counter,
        health=health,
        usage_sinks=[usage_stats, recent_requests, UsageLog(), metrics, *mesh.usage_sinks, *([journal] if journal else [])],
        recent_requests=recent_requests,
        metrics=metrics,
        tracker_link=mesh.tracker_link,
        is_relayed=mesh.is_relayed,
        others=others,
        models_status=models_status,
    )
    node = Node(
        launch=launch,
        # The order parts are closed in: llama-server first (streams still open end with an
        # error event), then the listener, the tracker link's last receipts, the relay tunnels, the pool,
        # systemd, and last the state dir's lock, so a second node cannot start while this one still stops.
        parts=[
            supervisor,
            http,
            # After the listener: its requests have ended, so each model's llama-server stops at once.
            *([others] if others else []),
            *mesh.parts,
            *([pool] if pool else []),
            operations,
            *([journal] if journal else []),
            model_files,
            state_lock,
        ],  # fmt: skip
        supervisor=supervisor,
        slots=slots,
        usage_stats=usage_stats,
        drain_grace_s=settings.drain_grace_s,
        on_close=upstream_client.aclose,
    )
    return node


def hold_state_dir(settings: NodeSettings) -> StateDirLock:
    """Lock the state dir for this node's life, or refuse naming the node that holds it."""
    try:
        return StateDirLock(settings.state_dir, host=settings.host, port=settings.port)
    except StateDirInUse as exc:
        raise NodeSetupError(str(exc)) from exc


def _operations(launch: PreparedLaunch, slots: Slots, health: Callable[[], HealthReport]) -> OperationsPart:
    """systemd's side of the node: readiness, the watchdog, the load's progress and the drain."""
    settings = launch.settings
    # systemd's variables are read, then removed, before any child could inherit them.
    watchdog_s = watchdog_interval()
    notifier = SystemdNotifier.from_environment(unset=True)
    return OperationsPart(
        served=ServedAt(launch.model_name, settings.host, settings.port),
        model_bytes=model_file_bytes(launch.model_path),
        load_stall_timeout_s=settings.load_stall_timeout_s,
        drain_grace_s=settings.drain_grace_s,
        slots=slots,
        notifier=notifier,
        watchdog_s=watchdog_s,
        health=health,
    )


def _supervisor(launch: PreparedLaunch, operations: OperationsPart, pool: PoolMonitor | None) -> Supervisor:
    """llama-server's supervisor, as the settings ask: warm-up and speed probe, and the pool it waits for."""
    settings = launch.settings
    warmup = warmup_for(launch.cpu_only) if settings.warmup else None
    policy = SupervisorPolicy.from_settings(settings, warmup, DEFAULT_SPEED_PROBE if settings.measure_speed else None)
    listeners = [operations, *([pool] if pool else [])]
    return Supervisor(launch.child, policy, state_dir=settings.state_dir, listeners=listeners, pool=pool)


def _other_models(launch: PreparedLaunch) -> ModelChildren | None:
    """The models beside the first as `ModelChildren`: each one's llama-server command from its plan, the warm-up
    as the first model's (no speed probe: it is the first model's that is announced), room by the plan's bytes."""
    others = launch.others
    if others is None:
        return None
    settings = launch.settings
    warmup = warmup_for(launch.cpu_only) if settings.warmup else None
    policy = SupervisorPolicy.from_settings(settings, warmup, None)
    shortest_idle = min((m.idle_unload_s for m in others.models if m.unloads_when_idle and m.idle_unload_s), default=None)
    # An idle model goes within a few sweeps of its time: a quarter of the shortest idle time, or the usual sweep.
    sweep_s = min(IDLE_SWEEP_INTERVAL_S, shortest_idle / IDLE_SWEEPS_PER_UNLOAD) if shortest_idle else IDLE_SWEEP_INTERVAL_S
    children = others.children
    try:
        return ModelChildren(
            others.models,
            lambda model: children[model.alias],
            policy,
            settings.state_dir,
            memory_budget_bytes=others.budget_bytes,
            max_loaded=settings.max_loaded_models,
            idle_sweep_s=sweep_s,
        )
    except ModelSetError as exc:  # e.g. max_loaded_models below the pinned models' count
        raise NodeSetupError(f"{exc}: raise max_loaded_models or pin fewer") from exc


def _models_status(
    launch: PreparedLaunch, supervisor: Supervisor, health: Callable[[], HealthReport], others: ModelChildren | None
) -> Callable[[], list[dict[str, Any]]]:
    """Each model the node serves, as `/status.json` shows it and `meshnet-gguf ps` prints it: the first one
    (pinned, in its supervisor's state), then each model beside it as its children say."""
    plan = launch.plan

    def models() -> list[dict[str, Any]]:
        report = health()
        beside = [asdict(status) for status in others.status()] if others is not None else []
        # The node counts every request it answered; the first model's are those no other model took.
        requests = max(0, report.usage.requests - sum(int(s["requests"]) for s in beside))
        first = {
            "alias": launch.model_name, "state": "loaded" if supervisor.state == "ready" else supervisor.state, "pinned": True,
            "pid": supervisor.pid, "requests": requests, "in_flight": None, "idle_s": None, "expected_load_s": None,
            "last_load_s": None, "loads": None, "error": None,
            "memory_bytes": plan.gpu_bytes + plan.host_bytes if plan is not None else None,
        }  # fmt: skip
        return [{**model, "rss_bytes": _rss_bytes(model["pid"])} for model in (first, *beside)]

    return models


def _rss_bytes(pid: int | None) -> int | None:
    """A model's llama-server's resident memory now (GPU memory is not in it), or None when it runs no process."""
    if pid is None:
        return None
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None


def _upstream_of(supervisor: Supervisor) -> Callable[[], UpstreamTarget | None]:
    """Where requests go now: llama-server while it is ready, else nowhere."""

    def upstream() -> UpstreamTarget | None:
        if supervisor.state != "ready" or supervisor.base_url is None:
            return None
        return UpstreamTarget(base_url=supervisor.base_url, api_key=supervisor.api_key)

    return upstream


def _metrics(
    launch: PreparedLaunch,
    slots: Slots,
    supervisor: Supervisor,
    operations: OperationsPart,
    mesh: MeshWing,
    upstream: Callable[[], UpstreamTarget | None],
    client: UpstreamClient,
) -> NodeMetrics:
    """The node's Prometheus metrics, read at scrape time from the parts that hold them."""

    async def llama_metrics() -> str:
        target = upstream()
        if target is None:
            return llama_up_text(False)
        return await fetch_llama_metrics(client, target.base_url, target.api_key)

    metrics = NodeMetrics(
        in_flight=lambda: slots.in_flight,
        # Each request in flight holds one llama-server slot.
        slots_busy=lambda: slots.in_flight,
        slots_total=lambda: slots.total,
        supervisor_state=lambda: supervisor.state,
        restarts=lambda: supervisor.restarts,
        outbox_depth=mesh.tracker_link.outbox_depth if mesh.tracker_link else None,
        load_progress=operations.load_fraction,
        info=lambda: {"version": __version__, "model": launch.model_name, "llama_build": launch.binary.build or "unknown"},
        llama_metrics=llama_metrics if LLAMA_METRICS_FLAG in launch.child.args else None,
    )
    metrics.count_download_bytes(launch.downloaded_bytes)
    if (relay_metrics := mesh.metrics()) is not None:
        metrics.registry.register(relay_metrics)
    return metrics


__all__ = ["LLAMA_METRICS_FLAG", "build_node", "hold_state_dir"]
