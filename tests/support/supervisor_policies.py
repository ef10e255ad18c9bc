"""Supervisor policies for tests that run a (fake) llama-server: quick polls and short backoffs; and a listener
that notes when the supervisor said ready."""

from __future__ import annotations

import time
from dataclasses import replace

from meshnet_gguf.llama.supervisor import SupervisorPolicy

QUICK = SupervisorPolicy(
    load_stall_timeout_s=10.0,
    health_poll_interval_s=0.05,
    restart_backoff_initial_s=0.2,
    restart_backoff_max_s=0.8,
    restart_stable_after_s=30.0,
    max_quick_crashes=2,
    stop_timeout_s=3.0,
)
# QUICK with a shorter load stall and a liveness check that gives up after two missed polls.
FAST = replace(QUICK, load_stall_timeout_s=5.0, liveness_interval_s=0.2, liveness_failures=2)


class ReadyClock:
    """A supervisor listener that notes when llama-server was first said ready (the supervisor's hooks)."""

    def __init__(self) -> None:
        self.ready_at: float | None = None

    def child_line(self, line: str) -> None:
        pass

    def child_state(self, state: str, detail: str | None, pid: int | None) -> None:
        if state == "ready" and self.ready_at is None:
            self.ready_at = time.time()
