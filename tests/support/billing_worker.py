"""A node-like process for billing tests: writes usage records through the real sink and runs the
real outbox reporter, so a test can kill -9 it at any moment and start it again.

usage: billing_worker.py STATE_DIR TRACKER_URL FIRST COUNT
Prints "wrote <request id>" after each record is committed, then "idle" when done writing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio

from meshnet_gguf.common.retry import Backoff
from meshnet_gguf.contract.protocol import UsageRecord
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.ledger import UsageLedger
from meshnet_gguf.mesh.receipts import LedgerUsageSink, OutboxReporter
from meshnet_gguf.mesh.tracker_client import TrackerClient


async def main(state_dir: Path, tracker_url: str, first: int, count: int) -> None:
    identity = NodeIdentity.load_or_create(state_dir)
    ledger = UsageLedger.in_state_dir(state_dir)
    client = TrackerClient(tracker_url, identity, audience="tracker-test")
    reporter = OutboxReporter(ledger, client, batch_size=10, backoff=Backoff(0.05, 0.2))
    sink = LedgerUsageSink(ledger, identity, reporter)
    async with anyio.create_task_group() as tg:
        tg.start_soon(reporter.run)
        for i in range(first, first + count):
            rid = f"req-{i:05d}"
            await sink.record(
                UsageRecord(
                    request_id=rid,
                    route="/v1/chat/completions",
                    model="tiny",
                    status=200,
                    stream=True,
                    prompt_tokens=i,
                    completion_tokens=2 * i,
                    finish_reason="stop",
                    started_at=1000.0 + i,
                )  # fmt: skip
            )
            print(f"wrote {rid}", flush=True)
            await anyio.sleep(0.01)
        print("idle", flush=True)


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
