"""Billing: every request's usage becomes a node-signed receipt in the ledger, and the outbox
reporter delivers receipts to the tracker until each one is acknowledged.

Exactly once, whatever crashes: the ledger keeps one row per request id, a row
leaves the outbox only when the tracker acknowledged it (or refused it for
good), and the tracker stores receipts idempotently by request id. A kill -9
between the tracker's store and our mark only causes a resend the tracker
recognises.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import anyio

from meshnet_gguf.common.retry import Backoff
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.protocol import MAX_RECEIPTS_PER_BATCH, ReceiptAck, UsageReceipt, UsageRecord
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.ledger import UsageLedger
from meshnet_gguf.mesh.tracker_client import RETRY_INITIAL_S, RETRY_MAX_S, NodeUnknown, TrackerRefused, TrackerUnavailable

log = logging.getLogger(__name__)

# The sink wakes the reporter after each write; this poll only catches rows a
# previous run left behind or a wake that raced a send.
OUTBOX_IDLE_POLL_S = 30.0
# Status recorded for a request the node itself died in the middle of (it never answered).
NODE_DIED_STATUS = 502
# How long a request that ended before its prompt was counted waits for llama-server (restarted
# by the supervisor) to count it; past that its row waits, parked, for the next start.
LATE_COUNT_TIMEOUT_S = 60.0
# Outcomes of a request llama-server took in (answered, cut off by the client, broken mid-answer):
# its prompt ran. A 503 (llama-server never took it) or its own refusal ran nothing.
PROMPT_RAN_STATUSES = frozenset({200, 499, 502})


class ReceiptSender(Protocol):
    async def send_receipts(self, receipts: list[UsageReceipt]) -> ReceiptAck: ...


class OutboxReporter:
    """Sends pending receipts in batches until each is acknowledged; run it for the node's lifetime."""

    def __init__(
        self,
        ledger: UsageLedger,
        sender: ReceiptSender,
        *,
        batch_size: int = MAX_RECEIPTS_PER_BATCH,
        backoff: Backoff | None = None,
        idle_poll_s: float = OUTBOX_IDLE_POLL_S,
        linger_s: float = 0.0,
    ) -> None:
        self._ledger = ledger
        self._sender = sender
        self._batch_size = min(batch_size, MAX_RECEIPTS_PER_BATCH)
        self._backoff = backoff or Backoff(RETRY_INITIAL_S, RETRY_MAX_S)
        self._idle_poll_s = idle_poll_s
        self._linger_s = linger_s
        self._wake = anyio.Event()

    def wake(self) -> None:
        """New rows are waiting: send now instead of at the next poll."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                await self.flush()
            except TrackerUnavailable as exc:
                delay = self._backoff.next_delay()
                level = logging.ERROR if isinstance(exc, TrackerRefused) and not isinstance(exc, NodeUnknown) else logging.WARNING
                log.log(level, "usage receipts not delivered (%s); kept in the ledger, retrying in %.0f s", exc, delay)
                await anyio.sleep(delay)
                continue
            self._backoff.reset()
            with anyio.move_on_after(self._idle_poll_s):
                await self._wake.wait()
            # Let receipts of requests ending close together share one batch.
            await anyio.sleep(self._linger_s)

    async def flush(self) -> int:
        """Send batches until the outbox is empty; returns how many receipts the tracker settled.

        Raises `TrackerUnavailable` when a batch did not go through; its rows stay pending.
        """
        settled = 0
        while True:
            # A fresh event before reading: a wake during this pass is then not lost.
            self._wake = anyio.Event()
            batch = await self._ledger.pending(self._batch_size)
            if not batch:
                return settled
            ack = await self._sender.send_receipts(batch)
            sent = {r.request_id for r in batch}
            accepted = [rid for rid in ack.accepted if rid in sent]
            rejected = [(r.request_id, f"{r.code}: {r.message}") for r in ack.rejected if r.request_id in sent]
            await self._ledger.mark_reported(accepted)
            if rejected:
                await self._ledger.mark_rejected(rejected)
                for rid, reason in rejected:
                    log.error("tracker refused the receipt for request %s for good: %s", rid, reason)
            if not accepted and not rejected:
                raise TrackerUnavailable(f"tracker settled none of {len(batch)} receipts")
            settled += len(accepted) + len(rejected)


class LedgerUsageSink:
    """The proxy's journal and usage sink: opens each request's ledger row as it is forwarded,
    then signs its record and settles the row before the request is over."""

    def __init__(
        self,
        ledger: UsageLedger,
        identity: NodeIdentity,
        reporter: OutboxReporter | None = None,
        *,
        count_prompt: Callable[[str, bytes], Awaitable[int]] | None = None,
    ) -> None:
        self._ledger = ledger
        self._identity = identity
        self._reporter = reporter
        # Counts a prompt from its request body (waiting for llama-server) when the live count never landed.
        self._count_prompt = count_prompt

    def open_soon(self, usage: UsageRecord, route_expires_at: float | None, prompt_body: bytes | None = None) -> asyncio.Future[bool]:
        """The request's in-flight row, handed to the ledger now; the future says once it is on disk
        (False when its id is already there). `prompt_body` is kept in the row until `note_prompt`
        (a restart counts it when that never came)."""
        return self._ledger.open_request_soon(usage, route_expires_at, prompt_body)

    async def note_prompt(self, request_id: str, prompt_tokens: int) -> None:
        await self._ledger.note_prompt(request_id, prompt_tokens)

    async def record(self, usage: UsageRecord) -> None:
        if usage.prompt_tokens == 0 and usage.status in PROMPT_RAN_STATUSES and (body := await self._ledger.park(usage)) is not None:
            # llama-server went away between forwarding and the count: the prompt ran, bill it once counted.
            await self._settle_late(usage, body)
            return
        receipt = self._identity.sign_receipt(usage)
        if not await self._ledger.add(usage, receipt):
            log.warning("request id %s is already in the ledger; the first record stands", usage.request_id)
            return
        if self._reporter is not None:
            self._reporter.wake()

    async def _settle_late(self, usage: UsageRecord, body: bytes) -> None:
        if self._count_prompt is None:
            log.warning("request %s ended before its prompt was counted; billed at the next start", usage.request_id)
            return
        with anyio.move_on_after(LATE_COUNT_TIMEOUT_S) as scope:
            await settle_uncounted(self._ledger, self._identity, [(usage, body)], self._count_prompt, self._reporter)
        if scope.cancel_called:
            log.warning("request %s: its prompt could not be counted yet; billed at the next start", usage.request_id)


def settle_interrupted(ledger: UsageLedger, identity: NodeIdentity) -> int:
    """Settle the rows a previous run left open (killed while those requests ran) whose prompt was
    counted: each gets its receipt with what was known (its prompt), marked as an error.

    Runs at start, before the proxy takes requests, so every request that reached
    llama-server ends with exactly one settled row and one receipt. Rows killed before
    their count landed wait for `settle_uncounted`, once llama-server can count them.
    """
    return sum(_settle_cut(ledger, identity, record) for record in ledger.open_counted_sync())


async def settle_uncounted(
    ledger: UsageLedger,
    identity: NodeIdentity,
    left: Sequence[tuple[UsageRecord, bytes]],
    count: Callable[[str, bytes], Awaitable[int]],
    reporter: OutboxReporter | None = None,
) -> int:
    """Settle the rows a previous run left open before their prompt was counted (`left`, read from
    `ledger.awaiting_count_sync()` at start): each prompt counted now from the body kept in its
    row, then billed as an error, once.

    `count(route, body)` waits for llama-server and raises `ApiError`: a 400 (it cannot read
    the body) bills 0 tokens; anything else is retried with backoff, the rows staying open.
    """
    backoff = Backoff(RETRY_INITIAL_S, RETRY_MAX_S)
    settled = 0
    for record, body in left:
        while True:
            try:
                tokens = await count(record.route, body)
                break
            except ApiError as exc:
                if exc.status == 400:
                    tokens = 0
                    break
                delay = backoff.next_delay()
                log.warning("cannot count the prompt of interrupted request %s yet (%s); retrying in %.0f s", record.request_id, exc, delay)
                await anyio.sleep(delay)
        counted = record.model_copy(update={"prompt_tokens": tokens})
        settled += await anyio.to_thread.run_sync(_settle_cut, ledger, identity, counted)
    if settled and reporter is not None:
        reporter.wake()
    return settled


def _settle_cut(ledger: UsageLedger, identity: NodeIdentity, record: UsageRecord) -> bool:
    """Settle a row its request never settled itself: a crash row (its record as opened, outcome
    unknown: an error) or a parked one (its final record in, only the prompt was missing)."""
    ended = record.finish_reason != "unknown"
    cut = record.model_copy(
        update={"finish_reason": record.finish_reason if ended else "error", "status": record.status or NODE_DIED_STATUS}
    )
    if not ledger.add_sync(cut, identity.sign_receipt(cut)):
        return False
    log.warning(
        "request %s %s; billed its prompt (%d tokens)",
        record.request_id, "ended before its prompt was counted" if ended else "was in flight when the node stopped",
        record.prompt_tokens,
    )  # fmt: skip
    return True
