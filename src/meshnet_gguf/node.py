"""Composition root: build the node's pieces and run them in one task group.

`launch.prepare_launch()` has done everything that can fail before a port is
opened; `Node.run()` serves until a signal, drains, and returns the exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable

import anyio
import uvicorn

from meshnet_gguf import __version__
from meshnet_gguf.config import NodeSettings
from meshnet_gguf.launch import NodeSetupError, PreparedLaunch
from meshnet_gguf.node_ops import NodeOperations
from meshnet_gguf.protocol import HealthReport
from meshnet_gguf.proxy import ProxyApp, ProxyLimits, UpstreamTarget
from meshnet_gguf.state_lock import StateDirInUse, StateDirLock
from meshnet_gguf.supervisor import ChildFailed, Supervisor, SupervisorPolicy
from meshnet_gguf.upstream_http import make_upstream_client
from meshnet_gguf.usage_stats import UsageLog, UsageStats

log = logging.getLogger(__name__)

# uvicorn's own graceful shutdown runs after our drain, so it only closes idle keep-alives.
HTTP_SHUTDOWN_TIMEOUT_S = 2.0
# Polling in-flight during drain; small, the drain is rare.
DRAIN_POLL_S = 0.05


class _NodeHTTPServer(uvicorn.Server):
    """uvicorn without its own signal handling: the node drains first, then stops the server."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


class Node:
    def __init__(self, launch: PreparedLaunch) -> None:
        self.launch = launch
        s = launch.settings
        self.settings = s
        # First: the identity, ledger and llama-server pidfile in the state dir are this node's alone.
        self.state_lock = hold_state_dir(s)
        self.started = time.monotonic()
        self.supervisor = Supervisor(
            launch.child,
            SupervisorPolicy(
                load_stall_timeout_s=s.load_stall_timeout_s,
                health_poll_interval_s=s.health_poll_interval_s,
                restart_backoff_initial_s=s.restart_backoff_initial_s,
                restart_backoff_max_s=s.restart_backoff_max_s,
                restart_stable_after_s=s.restart_stable_after_s,
                max_quick_crashes=s.max_quick_crashes,
                stop_timeout_s=s.stop_timeout_s,
            ),
            state_dir=s.state_dir,
        )
        self.usage_stats = UsageStats()
        self.upstream_client = make_upstream_client(s.upstream_client, s.parallel)
        self.proxy = ProxyApp(
            upstream=self._upstream_target,
            client=self.upstream_client,
            limits=ProxyLimits(
                slots=s.parallel, max_body_bytes=s.max_body_bytes, retry_after_s=s.retry_after_s,
                max_tokens_cap=s.max_tokens_cap,
            ),  # fmt: skip
            model_name=launch.model_name,
            model_aliases=launch.model_aliases,
            health=self.health_report,
            usage_sinks=[self.usage_stats, UsageLog()],
            api_key=s.api_key,
        )
        # Extension points for the mesh link, metrics, systemd: started beside the supervisor,
        # told when draining starts, and awaited once everything else has stopped.
        self.background_tasks: list[Callable[[], Awaitable[None]]] = []
        self.drain_hooks: list[Callable[[], Awaitable[None]]] = []
        self.shutdown_hooks: list[Callable[[], Awaitable[None]]] = []
        self.health_extras: list[Callable[[HealthReport], HealthReport]] = []
        if s.tracker:
            self._link_mesh()
        # systemd notify, /metrics, load progress and log redaction, through the hooks above (issue 6).
        self.operations = NodeOperations(self)
        self.exit_code = 0
        self._shutdown = anyio.Event()
        self._force = False
        self._signals_seen = 0

    def _link_mesh(self) -> None:
        """With a tracker: signed routes in front of the proxy, receipts behind it, presence beside it (issue 5)."""
        from meshnet_gguf.meshnet_link import MeshnetLink, MeshSetupError, ServedModel

        launch, s = self.launch, self.settings
        resolved = launch.resolved
        served = ServedModel(
            model_id=launch.model_name,
            model_aliases=launch.model_aliases,
            max_tokens_cap=s.max_tokens_cap,
            shards=list(resolved.shards) if resolved else [launch.model_path],
            quant=launch.quant,
            sha256s=list(resolved.sha256s) if resolved else (),
            llama_build=launch.binary.build,
            slots=s.parallel,
            ctx_size=launch.plan.ctx_size if launch.plan else s.ctx_size,
            hardware=launch.hardware,
            binary=launch.binary,
        )
        try:
            self.mesh = MeshnetLink(s, served, self.health_report)
        except MeshSetupError as exc:
            raise NodeSetupError(str(exc)) from exc
        self.proxy.route_verifier = self.mesh.route_verifier
        self.proxy.usage_sinks.append(self.mesh.usage_sink)
        self.health_extras.append(self.mesh.health_extra)
        self.background_tasks.append(self.mesh.run)
        self.drain_hooks.append(self.mesh.drain)
        self.shutdown_hooks.append(self.mesh.close)

    # --- views ------------------------------------------------------------
    def _upstream_target(self) -> UpstreamTarget | None:
        sup = self.supervisor
        if sup.state != "ready" or sup.base_url is None:
            return None
        return UpstreamTarget(base_url=sup.base_url, api_key=sup.api_key)

    def health_report(self) -> HealthReport:
        sup = self.supervisor
        report = HealthReport(
            state=sup.state,
            detail=sup.detail,
            model=self.launch.model_name,
            quant=self.launch.quant,
            slots_total=self.proxy.limits.slots,
            slots_busy=self.proxy.in_flight,
            uptime_s=time.monotonic() - self.started,
            restarts=sup.restarts,
            recent_tokens_per_s=self.usage_stats.recent_tokens_per_s(),
            usage=self.usage_stats.totals,
            node_version=__version__,
            llama_build=self.launch.binary.build,
            max_tokens_cap=self.settings.max_tokens_cap,
        )
        for extra in self.health_extras:
            report = extra(report)
        return report

    # --- lifecycle --------------------------------------------------------
    async def run(self) -> int:
        sock = _bind(self.settings.host, self.settings.port)
        config = uvicorn.Config(
            self.proxy,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=HTTP_SHUTDOWN_TIMEOUT_S,
            # SSE frames must leave as written; uvicorn adds no compression, say so explicitly.
            server_header=False,
            date_header=True,
            # uvicorn's own loggers propagate to the node's handler (text or JSON) instead of their own.
            log_config=None,
        )
        server = _NodeHTTPServer(config)
        self._install_signal_handlers()
        log.info("node listening on http://%s:%s (model %s)", self.settings.host, sock.getsockname()[1], self.launch.model_name)
        server_done = anyio.Event()

        async def serve_http() -> None:
            try:
                await server.serve([sock])
            finally:
                server_done.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._supervise)
                tg.start_soon(serve_http)
                for task in self.background_tasks:
                    tg.start_soon(task)
                await self._shutdown.wait()
                await self._drain()
                await self.supervisor.stop()
                server.should_exit = True
                with anyio.move_on_after(HTTP_SHUTDOWN_TIMEOUT_S + 1):
                    await server_done.wait()
                # Background tasks (heartbeats, reporters) end with the node.
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream_client.aclose()
                for hook in self.shutdown_hooks:
                    try:
                        await hook()
                    except Exception:
                        log.exception("shutdown hook %r failed", hook)
            sock.close()
            self.state_lock.close()
        log.info("node stopped (exit code %d)", self.exit_code)
        return self.exit_code

    def request_shutdown(self, *, force: bool = False) -> None:
        self._force = self._force or force
        self._shutdown.set()

    async def _supervise(self) -> None:
        try:
            await self.supervisor.run()
        except ChildFailed as exc:
            log.error("llama-server failed: %s", exc)
            self.exit_code = 1
            self.request_shutdown(force=True)

    async def _drain(self) -> None:
        self.proxy.draining = True
        for hook in self.drain_hooks:
            try:
                await hook()
            except Exception:
                log.exception("drain hook %r failed", hook)
        if self._force:
            return
        grace = self.settings.drain_grace_s
        if self.proxy.in_flight:
            log.info("draining: %d request(s) in flight, waiting up to %.0f s", self.proxy.in_flight, grace)
        deadline = time.monotonic() + grace
        while self.proxy.in_flight and time.monotonic() < deadline and not self._force:
            await anyio.sleep(DRAIN_POLL_S)
        if self.proxy.in_flight:
            log.warning("drain grace over: cutting %d request(s) short", self.proxy.in_flight)

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
            log.warning("%s again: stopping now", signal.Signals(sig).name)
            self.request_shutdown(force=True)


def hold_state_dir(settings: NodeSettings) -> StateDirLock:
    """Lock the state dir for this node's life, or refuse naming the node that holds it."""
    try:
        return StateDirLock(settings.state_dir, host=settings.host, port=settings.port)
    except StateDirInUse as exc:
        raise NodeSetupError(str(exc)) from exc


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise NodeSetupError(f"cannot listen on {host}:{port}: {exc.strerror} (is another node running? pick --port)") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


__all__ = ["Node"]
