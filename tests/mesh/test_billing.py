"""Billing outbox against a real loopback receipt endpoint: a tracker that is down, loses acks,
refuses receipts, or whose client is killed -9 mid-batch. Nothing may be lost, nothing doubled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet_gguf.common.retry import Backoff
from meshnet_gguf.contract.protocol import ReceiptAck, ReceiptBatch, ReceiptClaims, ReceiptRejection, UsageRecord
from meshnet_gguf.contract.signing import verify
from meshnet_gguf.contract.token_policies import RECEIPT_TOKEN
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.ledger import UsageLedger
from meshnet_gguf.mesh.receipts import LedgerUsageSink, OutboxReporter
from meshnet_gguf.mesh.tracker_client import TrackerClient
from support.loopback import serve_asgi
from support.node_process import free_port

pytestmark = pytest.mark.anyio
WORKER = Path(__file__).parents[1] / "support" / "billing_worker.py"
FAST_RETRY = Backoff(0.05, 0.2)
DELIVERY_TIMEOUT_S = 20.0


class Collector:
    """The receipts half of a tracker: verifies each receipt's signature and stores it once by request id."""

    def __init__(self, identity: Callable[[], NodeIdentity]) -> None:
        self._identity = identity
        self.stored: dict[str, ReceiptClaims] = {}
        self.posts: Counter[str] = Counter()
        self.lose_acks = 0  # answer 500 *after* storing: the node must resend, we must not double count
        self.reject: set[str] = set()
        self.ack_delay_s = 0.0
        self.holding_ack = anyio.Event()

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/nodes/{node_id}/receipts", self.receipts, methods=["POST"])])

    async def receipts(self, request: Request) -> Response:
        batch = ReceiptBatch.model_validate_json(await request.body())
        ident = self._identity()
        assert batch.node_id == request.path_params["node_id"] == ident.node_id
        ack = ReceiptAck()
        for receipt in batch.receipts:
            self.posts[receipt.request_id] += 1
            if receipt.request_id in self.reject:
                ack.rejected.append(ReceiptRejection(request_id=receipt.request_id, code="unknown_request", message="no"))
                continue
            claims = ReceiptClaims.model_validate(verify(receipt.token, ident.public_key, RECEIPT_TOKEN, issuer=ident.node_id))
            self.stored.setdefault(receipt.request_id, claims)
            ack.accepted.append(receipt.request_id)
        if self.ack_delay_s:
            self.holding_ack.set()
            await anyio.sleep(self.ack_delay_s)
        if self.lose_acks:
            self.lose_acks -= 1
            return JSONResponse({"error": {"message": "lost", "type": "server_error", "code": 500}}, 500)
        return Response(ack.model_dump_json(), media_type="application/json")


def record(i: int) -> UsageRecord:
    return UsageRecord(
        request_id=f"req-{i:05d}", route="/v1/chat/completions", model="tiny", status=200, stream=False,
        prompt_tokens=i, completion_tokens=i + 1, finish_reason="stop", started_at=float(i),
    )  # fmt: skip


async def wait_until(condition: Callable[[], bool], timeout: float = DELIVERY_TIMEOUT_S) -> None:
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.02)


@pytest.fixture
def node(tmp_path: Path):
    identity = NodeIdentity.load_or_create(tmp_path / "state")
    ledger = UsageLedger.in_state_dir(tmp_path / "state")
    yield identity, ledger
    ledger.close()


async def test_tracker_down_then_up_delivers_everything_exactly_once(node) -> None:
    identity, ledger = node
    port = free_port()
    client = TrackerClient(f"http://127.0.0.1:{port}", identity, audience="tracker-test")
    reporter = OutboxReporter(ledger, client, batch_size=40, backoff=Backoff(0.05, 0.2))
    sink = LedgerUsageSink(ledger, identity, reporter)
    collector = Collector(lambda: identity)
    async with anyio.create_task_group() as tg:
        tg.start_soon(reporter.run)
        for i in range(100):  # written while nobody listens on the port
            await sink.record(record(i))
        await anyio.sleep(0.3)  # the reporter has been failing and backing off meanwhile
        assert (await ledger.totals()).pending == 100
        async with serve_asgi(collector.app(), port):
            await wait_until(lambda: len(collector.stored) == 100)
            await sink.record(record(100))  # written while up: the wake sends it at once
            await wait_until(lambda: len(collector.stored) == 101, timeout=2.0)
            await wait_until(lambda: ledger.totals_sync().pending == 0)
        tg.cancel_scope.cancel()
    await client.aclose()
    assert max(collector.posts.values()) == 1
    assert collector.stored["req-00042"].usage == record(42)
    assert (await ledger.totals()).reported == 101


async def test_lost_acknowledgement_causes_a_resend_not_a_double_count(node) -> None:
    identity, ledger = node
    collector = Collector(lambda: identity)
    collector.lose_acks = 2
    port = free_port()
    sink = LedgerUsageSink(ledger, identity)
    for i in range(30):
        await sink.record(record(i))
    async with serve_asgi(collector.app(), port):
        client = TrackerClient(f"http://127.0.0.1:{port}", identity, audience="tracker-test")
        reporter = OutboxReporter(ledger, client, batch_size=10, backoff=FAST_RETRY)
        async with anyio.create_task_group() as tg:
            tg.start_soon(reporter.run)
            await wait_until(lambda: ledger.totals_sync().pending == 0)
            tg.cancel_scope.cancel()
        await client.aclose()
    assert len(collector.stored) == 30
    assert collector.posts["req-00000"] == 3  # sent three times, stored once
    assert (await ledger.totals()).reported == 30


async def test_refused_receipts_leave_the_outbox_and_are_not_retried(node) -> None:
    identity, ledger = node
    collector = Collector(lambda: identity)
    collector.reject = {"req-00001"}
    port = free_port()
    sink = LedgerUsageSink(ledger, identity)
    for i in range(3):
        await sink.record(record(i))
    async with serve_asgi(collector.app(), port):
        client = TrackerClient(f"http://127.0.0.1:{port}", identity, audience="tracker-test")
        assert await OutboxReporter(ledger, client, backoff=FAST_RETRY).flush() == 3
        assert await OutboxReporter(ledger, client, backoff=FAST_RETRY).flush() == 0
        await client.aclose()
    states = {e.record.request_id: e.outbox_state for e in await ledger.entries()}
    assert states == {"req-00000": "reported", "req-00001": "rejected", "req-00002": "reported"}
    assert collector.posts["req-00001"] == 1
    [entry] = [e for e in await ledger.entries() if e.rejected]
    assert "unknown_request" in (entry.rejected or "")


def _start_worker(state: Path, url: str, first: int, count: int, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(state), url, str(first), str(count)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


@pytest.mark.slow
async def test_kill_9_mid_batch_then_restart_delivers_each_record_once(tmp_path: Path) -> None:
    state = tmp_path / "state"
    identity = NodeIdentity.load_or_create(state)  # the worker loads the same key
    collector = Collector(lambda: identity)
    collector.ack_delay_s = 5.0  # the tracker stores, then is slow to answer: the kill lands in between
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log1, log2 = tmp_path / "worker1.log", tmp_path / "worker2.log"
    async with serve_asgi(collector.app(), port):
        worker = _start_worker(state, url, 0, 40, log1)
        try:
            await wait_until(lambda: collector.holding_ack.is_set() and log1.read_text().count("wrote") >= 15)
        finally:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(10)
        written_before_kill = [line.split()[1] for line in log1.read_text().splitlines() if line.startswith("wrote")]
        stored_before_restart = set(collector.stored)
        assert stored_before_restart, "the kill should land after the tracker stored a batch"

        ledger = UsageLedger.in_state_dir(state)
        try:
            in_ledger = {e.record.request_id for e in ledger.entries_sync(limit=1000)}
            # Every record the worker said it committed survived kill -9.
            assert set(written_before_kill) <= in_ledger
            # The stored-but-unacknowledged batch is still pending on the node.
            assert stored_before_restart & {r.request_id for r in ledger.pending_sync(1000)}

            collector.ack_delay_s = 0.0
            worker = _start_worker(state, url, 1000, 0, log2)
            try:
                await wait_until(lambda: ledger.totals_sync().pending == 0)
            finally:
                os.kill(worker.pid, signal.SIGKILL)
                worker.wait(10)
            assert set(collector.stored) == in_ledger
            assert all(collector.stored[rid].usage.request_id == rid for rid in in_ledger)
            assert any(n > 1 for n in collector.posts.values())  # the resend happened and was absorbed
            assert ledger.totals_sync().reported == len(in_ledger)
        finally:
            ledger.close()
