"""Exponential backoff with jitter, for anything that retries a peer until it answers."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Delays double from `initial_s` up to `max_s`; each is drawn from [d/2, d] ("equal jitter").

    The jitter spreads a fleet of nodes that lost the tracker at the same
    moment, so they do not all come back in the same second; the lower half
    is kept so a retry never spins.
    """

    initial_s: float
    max_s: float
    factor: float = 2.0
    _current: float = field(default=0.0, init=False, repr=False)

    def next_delay(self) -> float:
        self._current = self.initial_s if self._current == 0 else min(self._current * self.factor, self.max_s)
        return random.uniform(self._current / 2, self._current)

    def reset(self) -> None:
        self._current = 0.0
