"""The node's operations part: systemd notify and llama-server's load progress.

A `ChildListener` of the supervisor (it hears every child line and state) and
a node part (its `run()` samples load progress and feeds the watchdog). What
systemd is told:

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
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from meshnet_gguf.common.ports import wildcard_loopback
from meshnet_gguf.contract.node_part import BasePart
from meshnet_gguf.contract.protocol import HealthReport, NodeState
from meshnet_gguf.llama.load_progress import LoadProgress, LoadProgressReader
from meshnet_gguf.ops.sd_notify import WATCHDOG_PING_FRACTION, SystemdNotifier
from meshnet_gguf.serving.slots import Slots

log = logging.getLogger(__name__)

# How often the child's I/O counters are read while it loads: often enough for
# a moving percentage, rare enough to cost nothing.
PROGRESS_SAMPLE_S = 1.0
# A progress report buys this much more start time beyond the stall timer,
# which is what really decides that a load is stuck.
START_EXTENSION_MARGIN_S = 60.0
# The console gets a progress line per phase and per this much of the load.
PROGRESS_LOG_STEP = 0.10
_LOADING_STATES = frozenset({"starting", "loading"})


@dataclass(frozen=True)
class ServedAt:
    """What the STATUS lines name: the model and where the node listens."""

    model_name: str
    host: str
    port: int

    @property
    def url(self) -> str:
        """Where a client on this machine reaches the node (loopback when it listens on every address)."""
        host = wildcard_loopback(self.host) or self.host
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"http://{host}:{self.port}"


class OperationsPart(BasePart):
    name = "operations"

    def __init__(
        self,
        *,
        served: ServedAt,
        model_bytes: int | None,
        load_stall_timeout_s: float,
        drain_grace_s: float,
        slots: Slots,
        notifier: SystemdNotifier,
        watchdog_s: float | None,
        health: Callable[[], HealthReport],
    ) -> None:
        self._served = served
        self._model_bytes = model_bytes
        self._load_stall_timeout_s = load_stall_timeout_s
        self._drain_grace_s = drain_grace_s
        self._slots = slots
        self.notifier = notifier
        self._watchdog_s = watchdog_s
        self._health = health
        self._load: LoadProgressReader | None = None
        self._child_state: NodeState = "starting"
        self._child_pid: int | None = None
        self._logged_step = -1.0
        self._ready_sent = False

    # --- what the supervisor tells us ------------------------------------------------

    def child_state(self, state: NodeState, detail: str | None, pid: int | None) -> None:
        self._child_state, self._child_pid = state, pid
        name = self._served.model_name
        if state in _LOADING_STATES:
            if self._load is None or self._load.done:
                self._load = LoadProgressReader(self._model_bytes)
                self._logged_step = -1.0
            if state == "loading" and pid is not None:
                self._load.observe_process(pid)  # baseline: the child just started
            self.notifier.status(f"{state}: {name}")
        elif state == "ready":
            status = f"serving {name} on {self._served.host}:{self._served.port}"
            if self._load is not None:
                status += f" (loaded in {self._load.current.elapsed_s:.0f} s)"
            if self._ready_sent:
                self.notifier.status(status)
            else:
                self._ready_sent = True
                self.notifier.ready(status)
                # The line an operator waits for after `serve`: where to point a client and a browser.
                log.info("ready: %s at %s/v1 (this node's page: %s/)", name, self._served.url, self._served.url)
        else:
            self.notifier.status(f"{state}: {detail}" if detail else state)

    def child_line(self, line: str) -> None:
        load = self._load
        if load is None or load.done:
            return
        progress = load.feed(line)
        if progress is not None:
            self._report(progress)

    def _report(self, progress: LoadProgress) -> None:
        description = progress.describe()
        self.notifier.status(f"loading {self._served.model_name}: {description}")
        self.notifier.extend_timeout(self._load_stall_timeout_s + START_EXTENSION_MARGIN_S)
        step = int((progress.fraction or 0.0) / PROGRESS_LOG_STEP) * PROGRESS_LOG_STEP
        if step > self._logged_step or progress.phase == "ready":
            self._logged_step = step
            log.info("loading %s: %s", self._served.model_name, description)

    def load_fraction(self) -> float | None:
        """For /metrics: how much of the model is loaded, while it loads."""
        if self._load is None or self._child_state not in _LOADING_STATES:
            return None
        return self._load.current.fraction

    # --- node part ------------------------------------------------------------------

    def health(self, report: HealthReport) -> HealthReport:
        load = self._load
        if load is None or report.state not in _LOADING_STATES:
            return report
        progress = load.current
        return report.model_copy(update={"load_progress": progress.fraction, "detail": f"loading model: {progress.describe()}"})

    async def run(self) -> None:
        """Sample load progress and feed the watchdog, from the node's event loop, until cancelled."""
        ping_every = self._watchdog_s * WATCHDOG_PING_FRACTION if self._watchdog_s else None
        next_ping = 0.0
        while True:
            now = anyio.current_time()
            load = self._load
            if load is not None and self._child_state == "loading" and self._child_pid is not None:
                progress = load.observe_process(self._child_pid)
                if progress is not None:
                    self._report(progress)
            if ping_every is not None and now >= next_ping and self._healthy():
                self.notifier.watchdog()
                next_ping = now + ping_every
            await anyio.sleep(min(PROGRESS_SAMPLE_S, ping_every or PROGRESS_SAMPLE_S))

    def _healthy(self) -> bool:
        """What the watchdog vouches for: this loop runs, the supervisor has not given up,
        and the node can still describe itself."""
        try:
            return self._health().state != "failed"
        except Exception:
            log.exception("health report failed; withholding the systemd watchdog ping")
            return False

    async def drain(self) -> None:
        self.notifier.stopping(f"draining: {self._slots.in_flight} request(s) in flight, up to {self._drain_grace_s:.0f} s")

    async def close(self) -> None:
        self.notifier.close()


__all__ = ["OperationsPart", "ServedAt"]
