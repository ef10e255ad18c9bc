"""The run: a built node's parts started together in one task group, drained together on a signal,
closed in order; and the health report every part adds its word to."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence

import anyio

from meshnet_gguf import __version__
from meshnet_gguf.contract.node_part import NodePart
from meshnet_gguf.contract.protocol import HealthReport
from meshnet_gguf.llama.supervisor import Supervisor
from meshnet_gguf.prepare.pipeline import PreparedLaunch
from meshnet_gguf.serving.slots import Slots
from meshnet_gguf.serving.usage_stats import UsageStats

log = logging.getLogger(__name__)

# Polling in-flight during drain; small, the drain is rare.
DRAIN_POLL_S = 0.05


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


__all__ = ["DRAIN_POLL_S", "Node"]
