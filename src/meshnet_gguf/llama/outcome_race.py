"""Watchers of a llama-server child run side by side; the first to name an outcome ends them all."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from anyio.abc import TaskGroup


class OutcomeRace:
    """Started inside a task group: `outcome` holds `default` until a watcher ends the race."""

    def __init__(self, tg: TaskGroup, default: str) -> None:
        self._tg = tg
        self.outcome = default

    def end(self, outcome: str | None = None) -> None:
        """Stop every watcher; `outcome` replaces the current one unless None."""
        if outcome is not None:
            self.outcome = outcome
        self._tg.cancel_scope.cancel()

    def end_when(self, wait: Callable[[], Awaitable[object]], outcome: str | None) -> None:
        """Start a watcher that ends the race once `wait()` returns, with `outcome` unless None."""

        async def watch() -> None:
            await wait()
            self.end(outcome)

        self._tg.start_soon(watch)
