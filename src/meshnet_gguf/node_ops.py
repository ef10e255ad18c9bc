"""Operations around a running node: systemd notify, Prometheus metrics, load progress, log secrets.

Attached to a `Node` through its extension points (usage sinks, the proxy's
extra routes and rejection observers, the supervisor's line and state
listeners, health extras, background tasks, drain and shutdown hooks), so the
node's own code stays about serving. What systemd is told:

- STATUS= while loading, with progress and elapsed time, and on every state change;
- EXTEND_TIMEOUT_USEC= whenever the load makes progress, so `TimeoutStartSec`
  ends a stuck start but never a slow one;
- READY=1 once, when llama-server first answers /health;
- WATCHDOG=1 from the node's own event loop while the node is healthy (not
  `failed`); a blocked loop or a node that gave up stops the pings;
- STOPPING=1 when the drain starts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import anyio

from meshnet_gguf import __version__
from meshnet_gguf.load_progress import LoadProgress, LoadProgressTracker, model_file_bytes
from meshnet_gguf.logs import register_secret
from meshnet_gguf.metrics import NodeMetrics, fetch_llama_metrics, llama_up_text
from meshnet_gguf.protocol import HealthReport, NodeState
from meshnet_gguf.sd_notify import WATCHDOG_PING_FRACTION, SystemdNotifier, watchdog_interval

if TYPE_CHECKING:
    from meshnet_gguf.node import Node

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
LLAMA_METRICS_FLAG = "--metrics"
# How often the child's I/O counters are read while it loads: often enough for
# a moving percentage, rare enough to cost nothing.
PROGRESS_SAMPLE_S = 1.0
# A progress report buys this much more start time beyond the stall timer,
# which is what really decides that a load is stuck.
START_EXTENSION_MARGIN_S = 60.0
# The console gets a progress line per phase and per this much of the load.
PROGRESS_LOG_STEP = 0.10
_LOADING_STATES = frozenset({"starting", "loading"})


class NodeOperations:
    def __init__(self, node: Node, notifier: SystemdNotifier | None = None) -> None:
        self.node = node
        # Read before the notify variables leave the environment (so llama-server
        # cannot inherit them and speak for the node).
        self._watchdog_s = watchdog_interval()
        self.notifier = notifier or SystemdNotifier.from_environment(unset=True)
        self._tracker: LoadProgressTracker | None = None
        self._model_bytes = model_file_bytes(node.launch.model_path)
        self._logged_step = -1.0
        self._ready_sent = False
        settings = node.settings

        for secret in (node.supervisor.api_key, settings.api_key, settings.enrolment_secret):
            register_secret(secret)

        supervisor, proxy = node.supervisor, node.proxy
        self.metrics = NodeMetrics(
            in_flight=lambda: proxy.in_flight,
            # Admission gives each request in flight one llama-server slot.
            slots_busy=lambda: proxy.in_flight,
            slots_total=lambda: proxy.limits.slots,
            supervisor_state=lambda: supervisor.state,
            restarts=lambda: supervisor.restarts,
            load_progress=self._load_fraction,
            info=lambda: {
                "version": __version__,
                "model": node.launch.model_name,
                "llama_build": node.launch.binary.build or "unknown",
            },
            llama_metrics=self._llama_metrics if LLAMA_METRICS_FLAG in node.launch.child.args else None,
        )
        proxy.usage_sinks.append(self.metrics)
        proxy.rejection_observers.append(self.metrics.count_request)
        proxy.extra_get_routes[METRICS_PATH] = self.metrics.scrape
        supervisor.line_listeners.append(self._on_child_line)
        supervisor.state_listeners.append(self._on_state)
        node.health_extras.append(self._health_extra)
        node.background_tasks.append(self.run)
        node.drain_hooks.append(self._on_drain)
        node.shutdown_hooks.append(self._on_shutdown)

    # --- load progress -------------------------------------------------------------

    def _on_state(self, state: NodeState) -> None:
        supervisor = self.node.supervisor
        if state in _LOADING_STATES:
            if self._tracker is None or self._tracker.done:
                self._tracker = LoadProgressTracker(self._model_bytes)
                self._logged_step = -1.0
            if state == "loading" and supervisor.pid is not None:
                self._tracker.observe_process(supervisor.pid)  # baseline: the child just started
            self.notifier.status(f"{state}: {self.node.launch.model_name}")
        elif state == "ready":
            status = f"serving {self.node.launch.model_name} on {self.node.settings.host}:{self.node.settings.port}"
            if self._tracker is not None:
                status += f" (loaded in {self._tracker.current.elapsed_s:.0f} s)"
            if self._ready_sent:
                self.notifier.status(status)
            else:
                self._ready_sent = True
                self.notifier.ready(status)
        else:
            self.notifier.status(f"{state}: {supervisor.detail}" if supervisor.detail else state)

    def _on_child_line(self, line: str) -> None:
        tracker = self._tracker
        if tracker is None or tracker.done:
            return
        progress = tracker.feed(line)
        if progress is not None:
            self._report(progress)

    def _report(self, progress: LoadProgress) -> None:
        description = progress.describe()
        self.notifier.status(f"loading {self.node.launch.model_name}: {description}")
        self.notifier.extend_timeout(self.node.settings.load_stall_timeout_s + START_EXTENSION_MARGIN_S)
        step = int((progress.fraction or 0.0) / PROGRESS_LOG_STEP) * PROGRESS_LOG_STEP
        if step > self._logged_step or progress.phase == "ready":
            self._logged_step = step
            log.info("loading %s: %s", self.node.launch.model_name, description)

    def _load_fraction(self) -> float | None:
        tracker = self._tracker
        if tracker is None or self.node.supervisor.state not in _LOADING_STATES:
            return None
        return tracker.current.fraction

    def _health_extra(self, report: HealthReport) -> HealthReport:
        tracker = self._tracker
        if tracker is None or report.state not in _LOADING_STATES:
            return report
        progress = tracker.current
        return report.model_copy(update={"load_progress": progress.fraction, "detail": f"loading model: {progress.describe()}"})

    # --- the node's own loop ---------------------------------------------------------

    async def run(self) -> None:
        """Sample load progress and feed the watchdog, from the node's event loop, until cancelled."""
        ping_every = self._watchdog_s * WATCHDOG_PING_FRACTION if self._watchdog_s else None
        next_ping = 0.0
        while True:
            now = anyio.current_time()
            supervisor = self.node.supervisor
            tracker = self._tracker
            if tracker is not None and supervisor.state == "loading" and supervisor.pid is not None:
                progress = tracker.observe_process(supervisor.pid)
                if progress is not None:
                    self._report(progress)
            if ping_every is not None and now >= next_ping and self._healthy():
                self.notifier.watchdog()
                next_ping = now + ping_every
            await anyio.sleep(min(PROGRESS_SAMPLE_S, ping_every or PROGRESS_SAMPLE_S))

    def _healthy(self) -> bool:
        """What the watchdog vouches for: this loop runs, the supervisor has not given up,
        and the node can still describe itself."""
        if self.node.supervisor.state == "failed":
            return False
        try:
            self.node.health_report()
        except Exception:
            log.exception("health report failed; withholding the systemd watchdog ping")
            return False
        return True

    async def _llama_metrics(self) -> str:
        supervisor = self.node.supervisor
        base_url = supervisor.base_url if supervisor.state == "ready" else None
        if base_url is None:
            return llama_up_text(False)
        return await fetch_llama_metrics(self.node.upstream_client, base_url, supervisor.api_key)

    # --- stopping --------------------------------------------------------------------

    async def _on_drain(self) -> None:
        in_flight = self.node.proxy.in_flight
        self.notifier.stopping(
            f"draining: {in_flight} request(s) in flight, up to {self.node.settings.drain_grace_s:.0f} s"
        )

    async def _on_shutdown(self) -> None:
        self.notifier.close()
