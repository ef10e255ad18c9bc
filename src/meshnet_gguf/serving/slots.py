"""The node's request slots: how many requests it has in flight, and whether it takes more.

One object, owned by the proxy's request handling and read by health, metrics
and the drain. Each request in flight holds one llama-server slot. The policy is no queue: when every llama-server slot is busy a
request is refused at once (503 + Retry-After), so the tracker, which routes to
the least busy node, or the client can go elsewhere instead of waiting blind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Slots:
    total: int
    in_flight: int = 0
    draining: bool = False

    def try_acquire(self, weight: int = 1) -> Callable[[], None] | None:
        """Take `weight` slots; return the one-shot callable that gives them back, or None when full."""
        if self.in_flight + weight > self.total:
            return None
        self.in_flight += weight
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= weight

        return release


__all__ = ["Slots"]
