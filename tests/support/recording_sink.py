"""A usage sink that keeps every record the proxy hands its sinks, for tests to read."""

from __future__ import annotations

import anyio

from meshnet_gguf.contract.protocol import UsageRecord


class RecordingSink:
    """Keeps every usage record it is given, in order."""

    def __init__(self) -> None:
        self.records: list[UsageRecord] = []

    async def record(self, usage: UsageRecord) -> None:
        self.records.append(usage)

    async def wait_for(self, count: int, timeout: float = 10.0) -> list[UsageRecord]:
        """The records once there are `count` of them (requests are recorded after their answer ends)."""
        with anyio.fail_after(timeout):
            while len(self.records) < count:
                await anyio.sleep(0.01)
        return self.records
