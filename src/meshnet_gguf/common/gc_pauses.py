"""Shorter garbage-collector pauses for the long-running services (relay, tracker, node).

CPython's full collection walks every tracked object, and a service that has imported pydantic,
cryptography, anyio and uvicorn holds a few hundred thousand of them before it serves a request.
Measured on the relay under a flood of strangers (bench/bench_relay_flood.py, a gc callback timing
each collection): full collections of 33 to 93 ms, the honest streams' worst first tokens. Objects
made at startup (modules, classes, the settings) live as long as the process: `gc.freeze()` moves
them to a permanent generation that collections no longer walk, so a full collection only walks
what serving made. Cycles among frozen objects are never collected; startup makes none that
matter, and the memory they hold was held for the process's life anyway.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collects once, then freezes what is left (call when startup is done, before serving); returns how many froze."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


__all__ = ["freeze_startup_objects"]
