"""An in-process node front for billing and abuse tests: the real `ProxyApp` behind the node's real
HTTP listener (`HttpServerPart`), in front of a real llama-server process (the bundled binary or
the fake one), with a real route gate and a real SQLite ledger when a test asks for them.

Everything but the supervisor is the production code; the test owns the llama-server child
and can kill it, and reads the ledger and the usage records directly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import HealthReport, UsageRecord
from meshnet_gguf.contract.signing import body_sha256, encode_token, tracker_issuer_for
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.upstream.choice import make_upstream_client
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.ledger import UsageLedger
from meshnet_gguf.mesh.meshed_mode import MeshedMode, RouteGate
from meshnet_gguf.mesh.receipts import LedgerUsageSink
from meshnet_gguf.node import build_proxy
from meshnet_gguf.serving.slots import Slots
from meshnet_gguf.serving.admission_modes import StandaloneMode
from meshnet_gguf.serving.http_server import HttpServerPart
from meshnet_gguf.serving.prompt_count import PromptCounter, stored_prompt_counter
from meshnet_gguf.serving.node_surface import NodeDoors, node_table
from meshnet_gguf.serving.proxy import ProxyApp
from meshnet_gguf.serving.upstream_target import UpstreamTarget
from support.recording_sink import RecordingSink

READY_TIMEOUT_S = 30.0
RETRY_AFTER_S = 1
LLAMA_KEY = "internal-test-key"
MODEL_ID = "tiny"
TOTAL_LAYERS = 2


class LlamaChild:
    """llama-server (real or fake) as a child of the test, on a loopback port, stopped by its PID."""

    def __init__(
        self,
        binary: BinaryInfo,
        model: Path,
        *,
        slots: int = 2,
        ctx_size: int = 4096,
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> None:
        self.port = free_local_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [str(binary.path), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                "-c", str(ctx_size), "-np", str(slots), "--alias", MODEL_ID]  # fmt: skip
        full_env = {**binary.environment(), "LLAMA_API_KEY": LLAMA_KEY, **(env or {})}
        self._log = (log or Path(os.devnull)).open("ab")
        self.proc = subprocess.Popen(argv, env=full_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_ready()

    def wait_ready(self) -> float:
        started = time.monotonic()
        deadline = started + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"llama-server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        raise AssertionError("llama-server not ready")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


@dataclass
class Tracker:
    """Plays the tracker: mints routes for the node under test with its own key."""

    key: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)

    def route(self, node_id: str, path: str, body: bytes, *, lifetime_s: int = 30, **over: Any) -> str:
        now = int(time.time())
        claims = {
            "iss": tracker_issuer_for(self.key.public_key()), "sub": node_id, "jti": f"req-{time.perf_counter_ns()}",
            "iat": now, "exp": now + lifetime_s, "path": path, "model": MODEL_ID,
            "hops": [{"node_id": node_id, "first_layer": 0, "last_layer": TOTAL_LAYERS - 1}],
            "body_sha256": body_sha256(body),
        }  # fmt: skip
        return encode_token({**claims, **over}, self.key)


@dataclass
class FrontUnderTest:
    url: str
    app: ProxyApp
    sink: RecordingSink
    gate: RouteGate | None
    ledger: UsageLedger | None
    identity: NodeIdentity | None
    upstream_url: list[str]  # one element, swappable when llama-server restarts

    def target(self) -> UpstreamTarget | None:
        return UpstreamTarget(self.upstream_url[0], LLAMA_KEY) if self.upstream_url[0] else None


@contextlib.asynccontextmanager
async def serve_front(
    upstream_url: str,
    *,
    slots: int = 2,
    api_key: str | None = None,
    tracker: Tracker | None = None,
    state_dir: Path | None = None,
    allowed_hosts: Sequence[str] = (),
    max_body_bytes: int = 8 * 1024 * 1024,
) -> AsyncIterator[FrontUnderTest]:
    """The node's front (proxy + listener, and with `tracker` its route gate and ledger) on a free port."""
    sink = RecordingSink()
    gate = ledger = identity = None
    mode = StandaloneMode(api_key=api_key, allowed_hosts=allowed_hosts)
    sinks: list[Any] = [sink]
    upstream = [upstream_url]
    client = make_upstream_client("aiohttp", slots)

    def target() -> UpstreamTarget | None:
        return UpstreamTarget(upstream[0], LLAMA_KEY) if upstream[0] else None

    prompt_counter = PromptCounter(client, RETRY_AFTER_S)

    if tracker is not None:
        assert state_dir is not None
        identity = NodeIdentity.load_or_create(state_dir)
        ledger = UsageLedger.in_state_dir(state_dir)
        gate = RouteGate(identity.node_id, MODEL_ID, TOTAL_LAYERS, tracker.key.public_key())
        count_prompt = stored_prompt_counter(target, prompt_counter)
        journal = LedgerUsageSink(ledger, identity, count_prompt=count_prompt)
        mode = MeshedMode(gate, journal, retry_after_s=RETRY_AFTER_S, api_key=api_key)
        sinks.append(journal)
    node_slots = Slots(total=slots)
    health = lambda: HealthReport(state="ready", model=MODEL_ID, slots_total=slots, slots_busy=node_slots.in_flight)  # noqa: E731
    app = build_proxy(
        NodeSettings(max_body_bytes=max_body_bytes, retry_after_s=RETRY_AFTER_S),
        upstream=target,
        client=client,
        slots=node_slots,
        prompt_counter=prompt_counter,
        model_name=MODEL_ID,
        health=health,
        usage_sinks=sinks,
        mode=mode,
    )
    http = HttpServerPart(node_table(NodeDoors(app, health)), "127.0.0.1", free_local_port())
    async with anyio.create_task_group() as tg:
        tg.start_soon(http.run)
        front = FrontUnderTest(f"http://127.0.0.1:{http.port}", app, sink, gate, ledger, identity, upstream)
        try:
            yield front
        finally:
            await http.close()
            await client.aclose()
            if ledger is not None:
                await ledger.aclose()
            tg.cancel_scope.cancel()


async def wait_records(sink: RecordingSink, count: int, timeout: float = 10.0) -> list[UsageRecord]:
    return await sink.wait_for(count, timeout)
