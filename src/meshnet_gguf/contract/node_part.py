"""The shape every part of a running node has: run, drain, close, and what it adds to health.

`Node` holds a list of parts (supervisor, HTTP server, tracker link, relay link,
operations) and drives them all the same way, in list order:

1. `run()` for every part, side by side in one task group, until shutdown;
2. `drain()` when shutdown begins (deregister, tell systemd, stop taking work);
3. `close()` once the HTTP server and llama-server have stopped (final flushes);

and `health()` for every part whenever someone asks how the node is.
A part that has nothing to do at a step inherits the no-op from `BasePart`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from meshnet_gguf.contract.protocol import HealthReport


@runtime_checkable
class NodePart(Protocol):
    name: str

    async def run(self) -> None:
        """Do this part's work until cancelled; return at once when there is none."""
        ...

    async def drain(self) -> None:
        """Shutdown has begun: stop taking new work. Requests in flight still finish."""
        ...

    async def close(self) -> None:
        """The last call, after the HTTP server and llama-server have stopped."""
        ...

    def health(self, report: HealthReport) -> HealthReport:
        """The node's health report with what this part knows added (or unchanged)."""
        ...


class BasePart:
    """No-op defaults, so a part writes only the steps it cares about."""

    name = "part"

    async def run(self) -> None:
        return None

    async def drain(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def health(self, report: HealthReport) -> HealthReport:
        return report


__all__ = ["BasePart", "NodePart"]
