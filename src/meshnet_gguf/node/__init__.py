"""The node: the composition root, where every part a running node has is built in one place and run together.

`prepare/pipeline.prepare_launch()` has decided everything that can fail before a port
opens, and `node_identity()` has loaded the node's key. `build_node()` reads top to
bottom: each part is built with what it needs passed in, nothing is attached afterwards. `Node.run()` runs the parts in
one task group until a signal, drains, closes them in order and returns the
exit code. `listener.py` builds the node's one listener.

May import: common, contract, models, llama, hardware, prepare, serving, mesh, ops, proof.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import anyio

from meshnet_gguf import __version__
from meshnet_gguf.common.logs import register_secret
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.node_part import NodePart
from meshnet_gguf.contract.protocol import HardwareSummary, HealthReport, PoolDescription, ShardDigest
from meshnet_gguf.hardware.report import probe_hardware
from meshnet_gguf.llama.load_progress import model_file_bytes
from meshnet_gguf.llama.pool_monitor import PoolMonitor, WatchedWorker, http_status_reader
from meshnet_gguf.llama.speed_probe import DEFAULT_SPEED_PROBE
from meshnet_gguf.llama.supervisor import Supervisor, SupervisorPolicy
from meshnet_gguf.llama.upstream.choice import make_upstream_client
from meshnet_gguf.llama.warmup import warmup_for
from meshnet_gguf.models.gguf_info import GGUFError
from meshnet_gguf.models.in_use import ModelFilesHeld
from meshnet_gguf.node.listener import build_listener, build_proxy
from meshnet_gguf.ops.metrics import NodeMetrics, fetch_llama_metrics, llama_up_text
from meshnet_gguf.ops.sd_notify import SystemdNotifier, watchdog_interval
from meshnet_gguf.ops.state_lock import StateDirInUse, StateDirLock
from meshnet_gguf.ops.systemd_part import OperationsPart, ServedAt
from meshnet_gguf.prepare.announcement import ModelFactsError, hardware_summary, model_layout, shard_digests
from meshnet_gguf.prepare.pipeline import NodeSetupError, PreparedLaunch
from meshnet_gguf.serving.prompt_count import PromptCounter, stored_prompt_counter
from meshnet_gguf.serving.slots import Slots
from meshnet_gguf.serving.status_page import RecentRequests
from meshnet_gguf.serving.upstream_target import UpstreamTarget
from meshnet_gguf.serving.usage_journal import UsageJournal
from meshnet_gguf.serving.usage_stats import UsageLog, UsageStats

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from meshnet_gguf.contract.protocol import RelayAttachment
    from meshnet_gguf.mesh.identity import NodeIdentity
    from meshnet_gguf.mesh.relay_link import RelayLink
    from meshnet_gguf.mesh.tracker_link import DescribeModel, ServedModel, TrackerLink

log = logging.getLogger(__name__)

# Polling in-flight during drain; small, the drain is rare.
DRAIN_POLL_S = 0.05
# llama-server's own /metrics exists only when it was started with this flag.
LLAMA_METRICS_FLAG = "--metrics"


def build_node(launch: PreparedLaunch, identity: NodeIdentity | None) -> Node:
    """Every part of a node, wired in the order a request meets them. `identity` is the node's key
    from `node_identity` (loaded once per run): the pool monitor, the relay link and the tracker
    link all sign with it."""
    settings = launch.settings
    if identity is None and (launch.pool or settings.tracker or settings.relay_url):
        raise ValueError("a node with a pool, a tracker or a relay signs with its key: pass node_identity(settings)")
    # First: the identity, ledger and llama-server pidfile in the state dir are this node's alone.
    state_lock = hold_state_dir(settings)
    # A shared lock on each model file while the node lives: `meshnet-gguf rm` will not remove them.
    shards = launch.resolved.shards if launch.resolved else (launch.model_path,)
    model_files = ModelFilesHeld([f for f in shards if f.is_file()], settings.download_dir)

    # systemd's variables are read, then removed, before any child could inherit them.
    watchdog_s = watchdog_interval()
    notifier = SystemdNotifier.from_environment(unset=True)

    slots = Slots(total=settings.parallel)
    usage_stats = UsageStats()
    recent_requests = RecentRequests()
    # The health report reads the node built at the end of this function; nothing asks for it before.
    health = lambda: node.health_report()  # noqa: E731

    operations = OperationsPart(
        served=ServedAt(launch.model_name, settings.host, settings.port),
        model_bytes=model_file_bytes(launch.model_path),
        load_stall_timeout_s=settings.load_stall_timeout_s,
        drain_grace_s=settings.drain_grace_s,
        slots=slots,
        notifier=notifier,
        watchdog_s=watchdog_s,
        health=health,
    )
    # With a LAN pool: llama-server runs only while every worker is up (the monitor's word).
    pool = _pool_monitor(launch, identity) if launch.pool and identity else None
    supervisor = Supervisor(
        launch.child,
        SupervisorPolicy.from_settings(
            settings, warmup_for(launch.cpu_only) if settings.warmup else None, DEFAULT_SPEED_PROBE if settings.measure_speed else None
        ),
        state_dir=settings.state_dir,
        listeners=[operations, *([pool] if pool else [])],
        pool=pool,
    )
    for secret in (supervisor.api_key, settings.api_key, settings.enrolment_secret, settings.metrics_key):
        register_secret(secret)

    def upstream() -> UpstreamTarget | None:
        if supervisor.state != "ready" or supervisor.base_url is None:
            return None
        return UpstreamTarget(base_url=supervisor.base_url, api_key=supervisor.api_key)

    upstream_client = make_upstream_client(settings.upstream_client, settings.parallel)
    # One tunnel per relay, each its own part: with two, the tracker moves to the other when one fails (protocol 9.7).
    relays = _relay_links(settings, identity) if settings.relay_url and identity else []
    is_relayed = _relayed_through(relays) if relays else None
    # One counter of prompts, for the proxy's requests and, meshed, for a prompt the previous run died
    # before counting (its body kept in the ledger).
    prompt_counter = PromptCounter(upstream_client, settings.retry_after_s)
    count_prompt = stored_prompt_counter(upstream, prompt_counter)
    tracker_link = (
        _tracker_link(launch, identity, health, [link.attachment() for link in relays], count_prompt)
        if settings.tracker and identity
        else None
    )

    async def llama_metrics() -> str:
        target = upstream()
        if target is None:
            return llama_up_text(False)
        return await fetch_llama_metrics(upstream_client, target.base_url, target.api_key)

    # Standalone, usage is kept in an append-only journal (a meshed node's ledger keeps it otherwise).
    journal = UsageJournal.in_state_dir(settings.state_dir) if tracker_link is None else None

    metrics = NodeMetrics(
        in_flight=lambda: slots.in_flight,
        # Each request in flight holds one llama-server slot.
        slots_busy=lambda: slots.in_flight,
        slots_total=lambda: slots.total,
        supervisor_state=lambda: supervisor.state,
        restarts=lambda: supervisor.restarts,
        outbox_depth=tracker_link.outbox_depth if tracker_link else None,
        load_progress=operations.load_fraction,
        info=lambda: {"version": __version__, "model": launch.model_name, "llama_build": launch.binary.build or "unknown"},
        llama_metrics=llama_metrics if LLAMA_METRICS_FLAG in launch.child.args else None,
    )
    metrics.count_download_bytes(launch.downloaded_bytes)
    if relays:
        metrics.registry.register(_relay_metrics(relays))

    http = build_listener(
        launch,
        upstream=upstream,
        client=upstream_client,
        slots=slots,
        prompt_counter=prompt_counter,
        health=health,
        usage_sinks=[
            usage_stats,
            recent_requests,
            UsageLog(),
            metrics,
            *([tracker_link.usage_sink] if tracker_link else []),
            *([journal] if journal else []),
        ],  # fmt: skip
        recent_requests=recent_requests,
        metrics=metrics,
        tracker_link=tracker_link,
        is_relayed=is_relayed,
    )

    node = Node(
        launch=launch,
        # The order parts are closed in: llama-server first (streams still open end with an
        # error event), then the listener, the tracker link's last receipts, the relay tunnel, systemd,
        # and last the state dir's lock, so a second node cannot start while this one still stops.
        parts=[
            supervisor,
            http,
            *([tracker_link] if tracker_link else []),
            *relays,
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


def pool_description(launch: PreparedLaunch) -> PoolDescription | None:
    """What the network hears of the pool: how many workers, the memory and the plan; no address."""
    from meshnet_gguf.prepare.pool import shares_line

    if not launch.pool:
        return None
    shares = launch.pool_shares
    return PoolDescription(workers=len(launch.pool), total_bytes=sum(s.budget_bytes for s in shares), plan=shares_line(shares) or None)


def _pool_monitor(launch: PreparedLaunch, identity: NodeIdentity) -> PoolMonitor:
    """The watch over the pool the launch checked: each worker by name, its status read with the node's key."""
    from meshnet_gguf.llama.rpc_status import status_token
    from meshnet_gguf.prepare.pool import worker_name

    settings = launch.settings
    read, close = http_status_reader(lambda: status_token(identity.private_key), settings.pool_status_timeout_s)
    workers = [
        WatchedWorker(worker_name(i), m.spec.endpoint, m.spec.status_url, m.budget_bytes, m.protocol) for i, m in enumerate(launch.pool)
    ]
    described = pool_description(launch)
    assert described is not None
    return PoolMonitor(
        workers, read, interval_s=settings.pool_poll_interval_s, timeout_s=settings.pool_status_timeout_s,
        total_bytes=described.total_bytes, plan=described.plan, close_reader=close,
    )  # fmt: skip


def node_identity(settings: NodeSettings, *, dry_run: bool = False) -> NodeIdentity | None:
    """The node's key, loaded (or created on the first start) once per run, for every part that signs
    with it: the pool workers' status reads, the relay link, the tracker link. None when none of them runs.

    The mesh settings are checked first: settings that cannot work create no key. A dry run starts
    no link, so it needs the key only to read the pool workers' status, and checks nothing else.
    """
    from meshnet_gguf.mesh.identity import NodeIdentity
    from meshnet_gguf.mesh.tracker_link import MeshSetupError, check_first_contact, configured_tracker_key

    links = not dry_run and bool(settings.tracker or settings.relay_url)
    if not (links or settings.pool_workers):
        return None
    if links and settings.tracker:
        try:
            check_first_contact(settings, configured_tracker_key(settings))
        except MeshSetupError as exc:
            raise NodeSetupError(str(exc)) from exc
    return NodeIdentity.load_or_create(settings.state_dir)


def _tracker_link(
    launch: PreparedLaunch,
    identity: NodeIdentity,
    health: Callable[[], HealthReport],
    relay_attachments: Sequence[RelayAttachment],
    count_prompt: Callable[[str, bytes], Awaitable[int]],
) -> TrackerLink:
    """With a tracker: signed routes in front of the proxy, receipts behind it, presence beside it."""
    from meshnet_gguf.mesh.tracker_link import MeshSetupError, ServedModel

    settings, resolved = launch.settings, launch.resolved
    try:
        layout = model_layout(list(resolved.shards) if resolved else [launch.model_path])
    except (ModelFactsError, GGUFError) as exc:
        raise NodeSetupError(str(exc)) from exc
    served = ServedModel(
        model_id=launch.model_name, total_layers=layout.total_layers, model_aliases=launch.model_aliases,
        max_tokens_cap=settings.max_tokens_cap, quant=launch.quant, llama_build=launch.binary.build,
        slots=settings.parallel, ctx_size=launch.plan.ctx_size if launch.plan else settings.ctx_size,
        pool=pool_description(launch),
    )  # fmt: skip
    known = list(resolved.sha256s) if resolved else []

    def describe() -> tuple[list[ShardDigest], HardwareSummary | None]:
        report = launch.hardware or probe_hardware(launch.binary)
        return shard_digests(layout.shards, known, settings.state_dir), hardware_summary(report)

    try:
        return build_tracker_link(settings, identity, served, health, describe, relay_attachments, count_prompt)
    except MeshSetupError as exc:
        raise NodeSetupError(str(exc)) from exc


def build_tracker_link(
    settings: NodeSettings,
    identity: NodeIdentity,
    model: ServedModel,
    health: Callable[[], HealthReport],
    describe: DescribeModel,
    relay_attachments: Sequence[RelayAttachment] = (),
    count_prompt: Callable[[str, bytes], Awaitable[int]] | None = None,
) -> TrackerLink:
    """The tracker link and every part it runs: the one place a node opens its ledger.

    Before the link takes a request: the replay cache holds every unexpired route the
    ledger has seen, and rows a crash left open are settled into receipts.
    """
    from meshnet_gguf.mesh.ledger import UsageLedger
    from meshnet_gguf.mesh.meshed_mode import MeshedMode, RouteGate
    from meshnet_gguf.mesh.receipts import LedgerUsageSink, OutboxReporter, settle_interrupted
    from meshnet_gguf.mesh.tracker_client import TrackerClient
    from meshnet_gguf.mesh.tracker_link import TrackerLink, check_first_contact, configured_tracker_key, seed_replay_cache

    pinned = configured_tracker_key(settings)
    check_first_contact(settings, pinned)
    assert settings.tracker is not None
    ledger = UsageLedger.in_state_dir(settings.state_dir)
    client = TrackerClient(settings.tracker, identity, enrolment_secret=settings.enrolment_secret)
    reporter = OutboxReporter(ledger, client, linger_s=settings.usage_report_interval_s)
    usage_sink = LedgerUsageSink(ledger, identity, reporter, count_prompt=count_prompt)
    route_gate = RouteGate(identity.node_id, model.model_id, model.total_layers, pinned)
    seed_replay_cache(route_gate.replay_cache, ledger)
    settle_interrupted(ledger, identity)
    # Read now, before this run opens rows of its own: they are billed once llama-server can count them.
    left_uncounted = ledger.awaiting_count_sync()
    mode = MeshedMode(route_gate, usage_sink, retry_after_s=settings.retry_after_s, api_key=settings.api_key)
    return TrackerLink(
        settings=settings, model=model, identity=identity, ledger=ledger, client=client, reporter=reporter,
        usage_sink=usage_sink, route_gate=route_gate, admission_mode=mode, health=health, describe=describe,
        left_uncounted=left_uncounted, count_prompt=count_prompt, relay_attachments=relay_attachments,
    )  # fmt: skip


def _relay_links(settings: NodeSettings, identity: NodeIdentity) -> list[RelayLink]:
    """With relays: an outbound tunnel to each brings the tracker's requests to this node's own listener."""
    from meshnet_gguf.contract.protocol import MAX_NODE_RELAYS
    from meshnet_gguf.mesh.relay_link import build_relay_link, local_address_for

    if len(settings.relay_url) > MAX_NODE_RELAYS:
        raise NodeSetupError(f"--relay: {len(settings.relay_url)} relays named; a node announces at most {MAX_NODE_RELAYS}")
    try:
        return [
            build_relay_link(url, identity, settings.state_dir, local_address_for(settings.host, settings.port))
            for url in settings.relay_url
        ]
    except ValueError as exc:
        raise NodeSetupError(f"--relay: {exc}") from exc


def _relayed_through(relays: Sequence[RelayLink]) -> Callable[[tuple[str, int]], bool]:
    """Whether a connection to the node's listener carries a stream from any of its relays."""
    return lambda peer: any(link.is_relayed(peer) for link in relays)


def _relay_metrics(relays: Sequence[RelayLink]) -> Collector:
    from meshnet_gguf.ops.relay_health import RelayLinkCollector

    return RelayLinkCollector(relays)


def hold_state_dir(settings: NodeSettings) -> StateDirLock:
    """Lock the state dir for this node's life, or refuse naming the node that holds it."""
    try:
        return StateDirLock(settings.state_dir, host=settings.host, port=settings.port)
    except StateDirInUse as exc:
        raise NodeSetupError(str(exc)) from exc


class Node:
    """A running node: its parts, started together, drained together, closed in order."""

    def __init__(
        self,
        *,
        launch: PreparedLaunch,
        parts: Sequence[NodePart],
        supervisor: Supervisor,
        slots: Slots,
        usage_stats: UsageStats,
        drain_grace_s: float,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.launch = launch
        self.parts = tuple(parts)
        self.supervisor = supervisor
        self.slots = slots
        self.usage_stats = usage_stats
        self.drain_grace_s = drain_grace_s
        self._on_close = on_close
        self.started = time.monotonic()
        self.exit_code = 0
        self._shutdown = anyio.Event()
        self._force = False
        self._signals_seen = 0

    def health_report(self) -> HealthReport:
        sup = self.supervisor
        report = HealthReport(
            state="draining" if self.slots.draining else sup.state,
            detail=sup.detail,
            model=self.launch.model_name,
            quant=self.launch.quant,
            slots_total=self.slots.total,
            slots_busy=self.slots.in_flight,
            uptime_s=time.monotonic() - self.started,
            restarts=sup.restarts,
            recent_tokens_per_s=self.usage_stats.recent_tokens_per_s(),
            usage=self.usage_stats.totals,
            node_version=__version__,
            llama_build=self.launch.binary.build,
            max_tokens_cap=self.launch.settings.max_tokens_cap,
            capability=sup.capability,
        )
        for part in self.parts:
            report = part.health(report)
        return report

    # --- lifecycle --------------------------------------------------------
    async def run(self) -> int:
        self._install_signal_handlers()
        log.info("node serving %s", self.launch.model_name)
        try:
            async with anyio.create_task_group() as tg:
                scopes = [await tg.start(self._run_part, part) for part in self.parts]
                await self._shutdown.wait()
                await self._drain()
                for part, scope in zip(self.parts, scopes):
                    await self._close(part)
                    scope.cancel()  # whatever the part still runs ends with it
        finally:
            if self._on_close is not None:
                with anyio.CancelScope(shield=True):
                    await self._on_close()
        log.info("node stopped (exit code %d)", self.exit_code)
        return self.exit_code

    def request_shutdown(self, *, force: bool = False) -> None:
        self._force = self._force or force
        self._shutdown.set()

    async def _run_part(self, part: NodePart, *, task_status: anyio.abc.TaskStatus[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            try:
                await part.run()
            except Exception as exc:
                # A part that cannot go on (llama-server gave up, say) ends the node with an error.
                log.error("%s failed: %s", part.name, exc)
                self.exit_code = 1
                self.request_shutdown(force=True)

    async def _drain(self) -> None:
        self.slots.draining = True
        for part in self.parts:
            try:
                await part.drain()
            except Exception:
                log.exception("draining %s failed", part.name)
        if self._force:
            return
        slots = self.slots
        if slots.in_flight:
            log.info("draining: %d request(s) in flight, waiting up to %.0f s", slots.in_flight, self.drain_grace_s)
        deadline = time.monotonic() + self.drain_grace_s
        while slots.in_flight and time.monotonic() < deadline and not self._force:
            await anyio.sleep(DRAIN_POLL_S)
        if slots.in_flight:
            log.warning("drain grace over: cutting %d request(s) short", slots.in_flight)

    async def _close(self, part: NodePart) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await part.close()
            except Exception:
                log.exception("closing %s failed", part.name)

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        self._signals_seen += 1
        if self._signals_seen == 1:
            log.info("%s: draining (send again to stop at once)", signal.Signals(sig).name)
            self.request_shutdown()
        else:
            # llama-server with a stream in flight lets SIGTERM wait out its whole grace (10 s): not now.
            killed = self.supervisor.kill_now()
            also = f"; llama-server (pid {killed}) killed with SIGKILL, streams in flight end here" if killed else ""
            log.warning("%s again: stopping now%s", signal.Signals(sig).name, also)
            self.request_shutdown(force=True)


__all__ = ["Node", "build_node", "build_proxy", "build_tracker_link", "node_identity"]
