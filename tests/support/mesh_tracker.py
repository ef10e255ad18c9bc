"""The reference tracker served in-process on a loopback port, for the tracker tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

import anyio
import httpx

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.reference.tracker.node_address import AddressPolicy
from meshnet_gguf.reference.tracker.app import Tracker
from meshnet_gguf.reference.tracker.config import TrackerConfig
from support.loopback import serve_asgi

SECRET = "enrol-me"
HEARTBEAT_S = 0.3
HEALTH_POLL_S = 0.2


@asynccontextmanager
async def start_tracker(
    tmp_path: Path, name: str = "tracker", *, port: int | None = None, **over: Any
) -> AsyncIterator[tuple[Tracker, str]]:
    """A tracker with its state in `tmp_path / name` (started again on the same `port`, it is the same tracker restarted)."""
    fields: dict[str, Any] = dict(
        state_dir=tmp_path / name, enrolment_secret=SECRET, addresses=AddressPolicy(allow_loopback=True),
        heartbeat_interval_s=HEARTBEAT_S, health_poll_interval_s=HEALTH_POLL_S,
    )  # fmt: skip
    service = Tracker(TrackerConfig(**{**fields, **over}))
    port = port or free_local_port()
    try:
        async with serve_asgi(service.app(), port, lifespan="on"):
            yield service, f"http://127.0.0.1:{port}"
    finally:
        service.close()


def tracker_key(state_dir: Path) -> str:
    """The public key of a tracker with this state dir (made on first use); its ledger is closed at once."""
    with closing(Tracker(TrackerConfig(state_dir=state_dir, open_enrolment=True))) as service:
        return service.public_key_text


async def wait_until(condition: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not await condition():
            await anyio.sleep(0.03)


async def models(http: httpx.AsyncClient, url: str) -> list[str]:
    return [m["id"] for m in (await http.get(url + "/v1/models")).json()["data"]]
