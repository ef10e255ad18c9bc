"""In-memory usage sinks: running totals and recent decode speed for `/health`, and the log line."""

from __future__ import annotations

import logging
import time
from collections import deque

from meshnet_gguf.contract.protocol import UsageRecord, UsageTotals

log = logging.getLogger("meshnet_gguf.usage")

# "Recent tokens/s" averages the requests that finished in this window.
RECENT_WINDOW_S = 60.0
_RECENT_MAX_ENTRIES = 4096


class UsageStats:
    """Totals since start and recent decode speed; read by the health report."""

    def __init__(self) -> None:
        self.totals = UsageTotals()
        self._recent: deque[tuple[float, float]] = deque(maxlen=_RECENT_MAX_ENTRIES)

    async def record(self, usage: UsageRecord) -> None:
        self.observe(usage)

    def observe(self, usage: UsageRecord) -> None:
        t = self.totals
        t.requests += 1
        t.prompt_tokens += usage.prompt_tokens
        t.cached_tokens += usage.cached_tokens
        t.completion_tokens += usage.completion_tokens
        t.errors += usage.finish_reason == "error"
        t.cancelled += usage.finish_reason == "cancelled"
        if usage.decode_tokens_per_s:
            self._recent.append((time.monotonic(), usage.decode_tokens_per_s))

    def recent_tokens_per_s(self) -> float | None:
        horizon = time.monotonic() - RECENT_WINDOW_S
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        if not self._recent:
            return None
        # Each rate divided first: two rates near a float's limit cannot add up to inf (HealthReport refuses it).
        count = len(self._recent)
        return sum(rate / count for _, rate in self._recent)


class UsageLog:
    """One log line per request: what an operator greps for first."""

    async def record(self, usage: UsageRecord) -> None:
        # The id goes in the record, not the message: the formatter shows it once (`[req ID]`,
        # or `request_id` in JSON), whether or not this runs inside the request's own task.
        log.info(
            "%s status=%s finish=%s prompt=%d cached=%d completion=%d ttft=%s decode=%s tok/s duration=%.3fs",
            usage.route,
            usage.status,
            usage.finish_reason,
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
            f"{usage.ttft_s * 1000:.1f}ms" if usage.ttft_s is not None else "-",
            f"{usage.decode_tokens_per_s:.1f}" if usage.decode_tokens_per_s else "-",
            usage.duration_s,
            extra={"request_id": usage.request_id},
        )
