"""A meshed node assembled in-process from the real parts: the node proxy (`ProxyApp`), the
tracker link (route gate, signed ledger, outbox, presence, control proof) and the fake
llama-server as a real HTTP process behind them, wired as `node.build_node` wires them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import anyio
import httpx

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import HealthReport, NodeCapability, NodeState, ShardDigest
from meshnet_gguf.llama.upstream.choice import make_upstream_client
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.tracker_link import ServedModel, TrackerLink
from meshnet_gguf.mesh.relay_link import RelayLink, build_relay_link, local_address_for
from meshnet_gguf.node import NodeKeys, build_proxy, build_tracker_link, trust_tracker
from meshnet_gguf.prepare.announcement import model_layout, shard_digests
from meshnet_gguf.serving.node_surface import NodeDoors, node_table
from meshnet_gguf.serving.slots import Slots
from meshnet_gguf.serving.prompt_count import PromptCounter
from meshnet_gguf.serving.upstream_target import UpstreamTarget
from support.loopback import serve_asgi

FAKE_LLAMA = Path(__file__).parent / "fake_llama_server.py"
FAKE_LLAMA_KEY = "internal-test-key"
MODEL = "tiny"
START_TIMEOUT_S = 10.0


class LlamaAt(Protocol):
    """A llama-server the node forwards to (the fake one, or a real one started with `FAKE_LLAMA_KEY`)."""

    url: str


class FakeLlama:
    """`tests/support/fake_llama_server.py` as a child process on a free loopback port; stopped by its PID."""

    def __init__(self, workdir: Path, **env: str) -> None:
        self.port = free_local_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.request_log = workdir / f"fake-llama-{self.port}.jsonl"
        argv = [sys.executable, str(FAKE_LLAMA), "--host", "127.0.0.1", "--port", str(self.port), "--alias", MODEL, "--parallel", "8"]
        full_env = {**os.environ, "LLAMA_API_KEY": FAKE_LLAMA_KEY, "FAKE_LLAMA_REQUEST_LOG": str(self.request_log), **env}
        self.proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.02)
        self.close()
        raise RuntimeError("fake llama-server did not start")

    def forwarded(self) -> list[dict[str, Any]]:
        """The bodies the node proxy forwarded, in order."""
        if not self.request_log.exists():
            return []
        return [json.loads(line)["body"] for line in self.request_log.read_text().splitlines()]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(5)


def tracker_link(
    settings: NodeSettings, gguf: Path, health: Callable[[], HealthReport], *, slots: int = 1, relay: RelayLink | None = None
) -> TrackerLink:
    """The tracker link as the node builds it, serving `gguf` as MODEL (no hardware probe: the announcement says none)."""
    layout = model_layout([gguf])
    served = ServedModel(model_id=MODEL, total_layers=layout.total_layers, slots=slots)
    identity = relay.identity if relay else NodeIdentity.load_or_create(settings.state_dir)

    def describe() -> tuple[list[ShardDigest], None]:
        return shard_digests(layout.shards, [], settings.state_dir), None

    # The tracker key trusted as `node_keys` settles it: MeshSetupError where first contact would be unsafe.
    keys = NodeKeys(identity, trust_tracker(settings))
    return build_tracker_link(settings, keys, served, health, describe, [relay.attachment()] if relay else [])


class MeshNode:
    """A node on loopback: real proxy + real tracker link, in front of a fake llama-server."""

    def __init__(
        self,
        state_dir: Path,
        tiny_gguf: Path,
        llama: LlamaAt,
        *,
        tracker_url: str,
        tracker_key: str | None,
        enrolment_secret: str | None,
        slots: int = 2,
        advertised_url: str | None = None,
        relay_url: str | None = None,
    ) -> None:
        self.port = free_local_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state: NodeState = "ready"
        # The speed figures its /health claims (a real node measures them at start; a test says them).
        self.capability: NodeCapability | None = None
        self.settings = NodeSettings(
            state_dir=state_dir, tracker=tracker_url, tracker_public_key=tracker_key, enrolment_secret=enrolment_secret,
            advertised_url=advertised_url or self.url, usage_report_interval_s=0, parallel=slots,
        )  # fmt: skip
        # With a relay: reached only through it, as `node.build_node` wires a node started with --relay.
        self.relay = (
            build_relay_link(relay_url, NodeIdentity.load_or_create(state_dir), state_dir, local_address_for("127.0.0.1", self.port))
            if relay_url else None
        )  # fmt: skip
        self.link = tracker_link(self.settings, tiny_gguf, self.health, slots=slots, relay=self.relay)
        self.upstream_client = make_upstream_client("httpx", slots)
        self.slots = Slots(total=slots)
        self.proxy = build_proxy(
            self.settings,
            upstream=lambda: UpstreamTarget(llama.url, FAKE_LLAMA_KEY) if self.state == "ready" else None,
            client=self.upstream_client,
            slots=self.slots,
            prompt_counter=PromptCounter(self.upstream_client, self.settings.retry_after_s),
            model_name=MODEL,
            health=self.health,
            usage_sinks=[self.link.usage_sink],
            mode=self.link.admission_mode,
        )
        self.app = node_table(NodeDoors(self.proxy, self.health, control=self.link.control_route))

    def health(self) -> HealthReport:
        busy = self.slots.in_flight if hasattr(self, "slots") else 0
        report = HealthReport(
            state=self.state, model=MODEL, slots_total=self.settings.parallel, slots_busy=busy, capability=self.capability
        )
        return self.link.health(report)

    @property
    def node_id(self) -> str:
        return self.link.identity.node_id

    @asynccontextmanager
    async def running(self) -> AsyncIterator[MeshNode]:
        """Serve on loopback and run the tracker link; on exit its tasks stop and its clients close."""
        async with serve_asgi(self.app, self.port):
            async with anyio.create_task_group() as tg:
                if self.relay is not None:
                    tg.start_soon(self.relay.run)
                tg.start_soon(self.link.run)
                try:
                    yield self
                finally:
                    if self.relay is not None:
                        await self.relay.close()
                    tg.cancel_scope.cancel()
            # Only once the link's tasks have ended: none of them may find its client closed.
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                await self.link.client.aclose()
                await self.upstream_client.aclose()
        self.link.ledger.close()
