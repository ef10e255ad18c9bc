"""The mesh wing: the node's key and the tracker key it trusts (each settled once per run, before a
port opens), the tracker link (signed routes in front of the proxy, receipts behind it, presence
beside it) and the relay links (an outbound tunnel to each relay brings the tracker's requests to this
node's own listener).

`node_key` and `existing_node_key` are the one place the node's key file is read, by `serve` (through
`node_keys`), `doctor` and `models` alike.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from prometheus_client.registry import Collector

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import MAX_NODE_RELAYS, AnnouncedModel, HardwareSummary, HealthReport, RelayAttachment, ShardDigest
from meshnet_gguf.hardware.report import probe_hardware
from meshnet_gguf.llama.model_children import ModelChildren
from meshnet_gguf.mesh.announced_models import announced_from_children
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.ledger import UsageLedger
from meshnet_gguf.mesh.meshed_mode import MeshedMode, RouteGate
from meshnet_gguf.mesh.receipts import LedgerUsageSink, OutboxReporter, settle_interrupted
from meshnet_gguf.mesh.relay_link import RelayLink, build_relay_link, local_address_for
from meshnet_gguf.mesh.tracker_client import TrackerClient
from meshnet_gguf.mesh.tracker_link import (
    DescribeModel,
    MeshSetupError,
    ServedModel,
    TrackerLink,
    check_first_contact,
    configured_tracker_key,
    seed_replay_cache,
)
from meshnet_gguf.models.gguf_info import GGUFError
from meshnet_gguf.node.pool import pool_description
from meshnet_gguf.ops.relay_metrics import RelayLinkCollector
from meshnet_gguf.prepare.announcement import ModelFactsError, hardware_summary, model_layout, shard_digests
from meshnet_gguf.prepare.pipeline import NodeSetupError, PreparedLaunch
from meshnet_gguf.serving.proxy import UsageSink

# Counts one prompt's tokens with llama-server: (model, body) -> tokens.
CountPrompt = Callable[[str, bytes], Awaitable[int]]
IsRelayed = Callable[[tuple[str, int]], bool]


@dataclass(frozen=True)
class TrackerTrust:
    """The tracker key this node trusts before it contacts the tracker: configured or pinned on an
    earlier first contact, or None where the link learns it on first contact. Made by `trust_tracker`
    only, which has checked that learning it there is safe."""

    tracker_url: str
    pinned: Ed25519PublicKey | None


@dataclass(frozen=True)
class NodeKeys:
    """The node's own key, for every part that signs with it (the pool's status reads, the relay links,
    the tracker link), and with a tracker link the tracker key it trusts."""

    identity: NodeIdentity
    tracker: TrackerTrust | None = None


def trust_tracker(settings: NodeSettings) -> TrackerTrust:
    """The first-contact check: the configured or pinned tracker key, else settings where learning the
    key on first contact cannot be spoofed (not plain http to another machine). `MeshSetupError` names the fix."""
    pinned = configured_tracker_key(settings)
    check_first_contact(settings, pinned)
    assert settings.tracker is not None  # check_first_contact refuses settings without one
    return TrackerTrust(settings.tracker, pinned)


def node_key(settings: NodeSettings) -> NodeIdentity:
    """The node's key from its state dir, created (mode 0600) on the first start."""
    return NodeIdentity.load_or_create(settings.state_dir)


def existing_node_key(settings: NodeSettings) -> NodeIdentity | None:
    """The node's key if it has one, else None (the node never started): for readers such as doctor's relay probe."""
    try:
        return NodeIdentity.load(settings.state_dir)
    except FileNotFoundError:
        return None


def node_keys(settings: NodeSettings, *, dry_run: bool = False) -> NodeKeys | None:
    """The node's keys, settled once per run for every part that signs or trusts: None when none runs.

    The mesh settings are checked first: settings that cannot work create no key. A dry run starts
    no link, so it needs the key only to read the pool workers' status, and checks nothing else.
    """
    links = not dry_run and bool(settings.tracker or settings.relay_url)
    if not (links or settings.pool_workers):
        return None
    try:
        tracker = trust_tracker(settings) if links and settings.tracker else None
    except MeshSetupError as exc:
        raise NodeSetupError(str(exc)) from exc
    return NodeKeys(node_key(settings), tracker)


@dataclass(frozen=True)
class MeshWing:
    """The node's way into the mesh: the tracker link (None standalone) and the relay links."""

    tracker_link: TrackerLink | None
    relays: Sequence[RelayLink]

    @property
    def parts(self) -> list[TrackerLink | RelayLink]:
        """In the order they close: the link's last receipts, then the tunnels."""
        return [*([self.tracker_link] if self.tracker_link else []), *self.relays]

    @property
    def usage_sinks(self) -> list[UsageSink]:
        return [self.tracker_link.usage_sink] if self.tracker_link else []

    @property
    def is_relayed(self) -> IsRelayed | None:
        """Whether a connection to the node's listener carries a stream from any of its relays (None without relays)."""
        relays = tuple(self.relays)
        return (lambda peer: any(link.is_relayed(peer) for link in relays)) if relays else None

    def metrics(self) -> Collector | None:
        """One collector for all the relays (a registry refuses two of the same names), None without relays."""
        return RelayLinkCollector(self.relays) if self.relays else None


def build_mesh(launch: PreparedLaunch, keys: NodeKeys | None, health: Callable[[], HealthReport], count_prompt: CountPrompt) -> MeshWing:
    """The relay links, then the tracker link that announces them (with two relays, the tracker moves to
    the other when one fails); none of them without the node's keys."""
    settings = launch.settings
    if keys is None:
        return MeshWing(None, [])
    relays = _relay_links(settings, keys.identity) if settings.relay_url else []
    link = _tracker_link(launch, keys, health, [r.attachment() for r in relays], count_prompt) if settings.tracker else None
    return MeshWing(link, relays)


def announce_other_models(link: TrackerLink | None, launch: PreparedLaunch, others: ModelChildren | None) -> None:
    """A node of several models announces each one beside its first, in its child's state at each registration and
    heartbeat (`mesh/announced_models`): loaded, loadable with the load time measured at its first load, or
    unavailable; the node's slots are all of theirs, the first model's own the settings' `parallel`."""
    if link is None or others is None or launch.others is None:
        return
    described = {
        m.alias: AnnouncedModel(model_id=m.alias, quant=m.quant_label, ctx_size=m.context, slots=m.slots) for m in launch.others.models
    }
    own = launch.settings.parallel
    try:
        link.announce_beside(
            lambda: announced_from_children(others.status(), described), own_slots=own,
            total_slots=own + sum(m.slots for m in launch.others.models),
        )  # fmt: skip
    except MeshSetupError as exc:
        raise NodeSetupError(str(exc)) from exc


def _tracker_link(
    launch: PreparedLaunch,
    keys: NodeKeys,
    health: Callable[[], HealthReport],
    relay_attachments: Sequence[RelayAttachment],
    count_prompt: CountPrompt,
) -> TrackerLink:
    """The tracker link for the launch's model: its layers, shards and hardware as the tracker hears them."""
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
        return build_tracker_link(settings, keys, served, health, describe, relay_attachments, count_prompt)
    except MeshSetupError as exc:
        raise NodeSetupError(str(exc)) from exc


def build_tracker_link(
    settings: NodeSettings,
    keys: NodeKeys,
    model: ServedModel,
    health: Callable[[], HealthReport],
    describe: DescribeModel,
    relay_attachments: Sequence[RelayAttachment] = (),
    count_prompt: CountPrompt | None = None,
) -> TrackerLink:
    """The tracker link and every part it runs: the one place a node opens its ledger.

    It trusts the tracker key `keys` settled (the first contact was checked there, once). Before the
    link takes a request: the replay cache holds every unexpired route the ledger has seen, and rows a
    crash left open are settled into receipts.
    """
    trust = keys.tracker
    if trust is None or trust.tracker_url != settings.tracker:
        raise MeshSetupError("the tracker link needs the tracker key trusted for this tracker: node_keys(settings) settles it")
    identity = keys.identity
    ledger = UsageLedger.in_state_dir(settings.state_dir)
    client = TrackerClient(trust.tracker_url, identity, enrolment_secret=settings.enrolment_secret)
    reporter = OutboxReporter(ledger, client, linger_s=settings.usage_report_interval_s)
    usage_sink = LedgerUsageSink(ledger, identity, reporter, count_prompt=count_prompt)
    route_gate = RouteGate(identity.node_id, model.model_id, model.total_layers, trust.pinned)
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
    if len(settings.relay_url) > MAX_NODE_RELAYS:
        raise NodeSetupError(f"--relay: {len(settings.relay_url)} relays named; a node announces at most {MAX_NODE_RELAYS}")
    try:
        return [
            build_relay_link(url, identity, settings.state_dir, local_address_for(settings.host, settings.port))
            for url in settings.relay_url
        ]
    except ValueError as exc:
        raise NodeSetupError(f"--relay: {exc}") from exc


__all__ = [
    "MeshWing",
    "NodeKeys",
    "TrackerTrust",
    "announce_other_models",
    "build_mesh",
    "build_tracker_link",
    "existing_node_key",
    "node_key",
    "node_keys",
    "trust_tracker",
]
