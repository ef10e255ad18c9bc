"""Proof of model, the tracker's side: which settled answers are audited, the queue that sends them
to a verifier it trusts, the probe a new node passes before its first client, and what a verdict does.

All of it is off unless `TrackerConfig.verifiers` names a verifier for the node's model: then
- a settled answer (complete, greedy or sampled) is drawn for audit with `secrets.randbelow`, at
  `AuditPolicy.rate`, or `new_node_rate` for a node's first `new_node_answers`; the node cannot tell
  which (the draw happens on the tracker, after the answer);
- one owner task posts each audit to the verifier; a verifier down or a `no_verdict` is retried with
  backoff and never counts against the node;
- a newly registered node stays unroutable until `PROBE_PROMPTS` greedy answers, asked through the
  ordinary route (signed routes, ledger rows), pass;
- a `failed` verdict makes the node unroutable (`NodeEntry.proof_blocked`) and flags its receipts
  since its last passed audit (`model_unproven`);
- every decided audit is kept in the ledger (`TrackerLedger.record_audit`, with the flags of a failure in
  the same transaction) and read back when the tracker starts (`load`): a node that failed stays
  unroutable across restarts, and its counts and latest audits stay listed. Audits still waiting for the
  verifier are not kept: they were drawn at random, and a restart draws again.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError

from meshnet_gguf.common.http1_client import HttpAnswer
from meshnet_gguf.contract.model_proof import (
    AUDIT_PATH,
    AUDIT_TOKEN_HEADER,
    DRIFT_REFUSE_NATS,
    VALUE_DRIFT,
    VALUE_DRIFTS,
    AnswerEvidence,
    AnswerGaps,
    AuditRequest,
    AuditVerdict,
    NodeDrift,
    unscoreable,
)
from meshnet_gguf.contract.openai_paths import COMPLETIONS_PATH, EMBEDDINGS_PATH
from meshnet_gguf.contract.protocol import REQUEST_ID_HEADER, ROUTE_HEADER
from meshnet_gguf.contract.signing import body_sha256, issue
from meshnet_gguf.contract.sse import event_data
from meshnet_gguf.contract.token_policies import AUDIT_TOKEN
from meshnet_gguf.reference.tracker.answer_evidence import evidence_body, evidence_of
from meshnet_gguf.reference.tracker.ledger import AuditRecord
from meshnet_gguf.reference.tracker.metering import ForwardMeter, prompt_ceiling, requested_choices
from meshnet_gguf.reference.tracker.registry import NodeEntry

log = logging.getLogger(__name__)

# Forwards a request to a node as the tracker does: (node, path, headers, body) -> its answer.
NodeSend = Callable[[NodeEntry, str, dict[str, str], bytes], Awaitable[HttpAnswer]]

# An answer's text kept for an audit, at most: past it the answer is not audited (its bytes still go by).
MAX_AUDITED_ANSWER_BYTES = 1024 * 1024
# llama-server samples at this temperature when a request names none: a request without one is sampled.
LLAMA_DEFAULT_TEMPERATURE = 0.8
# A verifier that is down or gives no verdict is asked again after this, doubling up to the cap.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
# A verifier that answers but cannot score an answer (too short for the sampled test) is asked this
# many times, then the audit is dropped: it proves nothing either way.
MAX_NO_VERDICT_ANSWERS = 3
# When the verifier falls behind (its throughput is bench/RESULTS.md's "Proof of quant: the audit's cost"), drawn
# audits wait. Two bounds, and one policy: no node can choose which of its drawn answers go unaudited, or push
# another node's audits out.
# - A node's queued audits, at most: past it, its draws are a reservoir sample (a new draw is kept with probability
#   share/seen, in place of one of its queued audits picked at random), so a node that floods the tracker with
#   answers of its own cannot flush an earlier audited answer out by order: each of its draws stays with the same
#   chance. 32 covers a new node's probe (3) and its first 50 answers at the new-node rate (12.5 expected) twice over.
MAX_QUEUED_AUDITS_PER_NODE = 32
# - All queued audits, at most (many nodes, each under its share): past it, one queued audit of the node with the most
#   queued is dropped, picked at random. A registration probe's audits are never dropped (a new node waits on them).
MAX_QUEUED_AUDITS = 1000
VERIFIER_TIMEOUT_S = 300.0
# The registration probe: a few greedy prompts, long enough that another model diverges (tests/proof).
PROBE_PROMPTS = ("hello world, this is a test of", "Once upon a time, in a land far away,", "The capital of France is")
PROBE_TOKENS = 32
PROBE_PATH = COMPLETIONS_PATH
# A node is probed once it is healthy; this bounds how long the probe waits for that.
PROBE_READY_POLL_S = 0.1
# The latest decided audits /v1/nodes and the page show per node (the ledger keeps them all).
RECENT_AUDITS_SHOWN = 5


@dataclass(frozen=True)
class AuditPolicy:
    """How often settled answers are audited: `rate` of them, `new_node_rate` of a node's first `new_node_answers`."""

    rate: float = 0.03
    new_node_rate: float = 0.25
    new_node_answers: int = 50

    def __post_init__(self) -> None:
        if not (0 <= self.rate <= 1 and 0 <= self.new_node_rate <= 1):
            raise ValueError("audit rates are fractions between 0 and 1")


# A draw's resolution: rates are compared with secrets.randbelow(DRAW_SCALE) / DRAW_SCALE.
DRAW_SCALE = 1_000_000


@dataclass
class NodeAudits:
    """One node's audit record on this tracker (shown in /v1/nodes)."""

    passed: int = 0
    failed: int = 0
    last_verdict: AuditVerdict | None = None
    answers: int = 0  # settled answers seen, for the new-node rate
    last_passed_at: float = 0.0  # wall clock; receipts since then are flagged on a failure
    pending: int = 0  # drawn and queued, not decided yet (not kept across a restart)
    # The CUSUM of its judged greedy audits (proof of quant), counted again from the ledger when the tracker starts.
    drift: NodeDrift = field(default_factory=NodeDrift)
    # The CUSUM of the values its audited answers' evidence committed (proof of quant for near quants), the same way.
    values: NodeDrift = field(default_factory=lambda: NodeDrift(rule=VALUE_DRIFT))
    recent: deque[AuditRecord] = field(default_factory=lambda: deque(maxlen=RECENT_AUDITS_SHOWN))  # newest first

    def summary(self) -> dict[str, Any]:
        last = self.last_verdict
        return {"passed": self.passed, "failed": self.failed, "pending": self.pending,
                "drift": {"cusum_nats": round(self.drift.s, 4), "refuse_at_nats": DRIFT_REFUSE_NATS, "answers": self.drift.answers},
                "value_drift": {"cusum_nats": round(self.values.s, 4), "refuse_at_nats": VALUE_DRIFT.refuse_nats,
                                "answers": self.values.answers},
                "last_verdict": None if last is None else {"outcome": last.outcome, "reason": last.reason},
                "recent": [{"audit_id": a.audit_id, "outcome": a.outcome, "reason": a.reason, "margin_nats": a.margin_nats,
                            "decided_at": a.decided_at} for a in self.recent]}  # fmt: skip


class AnswerCapture:
    """A bounded copy of one drawn answer as it is forwarded; its text once the answer completes."""

    def __init__(self, stream: bool, evidence_asked: bool = False) -> None:
        self.stream = stream
        # The tracker asked the node for the answer's log-probabilities (answer_evidence): an answer without them
        # withheld what every honest node sends.
        self.evidence_asked = evidence_asked
        # Taken when the route was issued: a failure flags every answer from then on, this one included.
        self.issued_at = time.time()
        self._chunks: list[bytes] = []
        self._size = 0
        self.overflowed = False
        # The answer parsed once: its text and its evidence both read it (up to MAX_AUDITED_ANSWER_BYTES of JSON).
        self._parsed: list[dict[str, Any]] | None = None

    def feed(self, chunk: bytes) -> None:
        if self.overflowed:
            return
        self._parsed = None
        self._size += len(chunk)
        if self._size > MAX_AUDITED_ANSWER_BYTES:
            self.overflowed, self._chunks = True, []
        else:
            self._chunks.append(chunk)

    def _documents(self) -> list[dict[str, Any]]:
        """The answer's JSON documents in order: the whole answer, or each event's data but [DONE]."""
        if self._parsed is not None:
            return self._parsed
        raw = b"".join(self._chunks)
        if not self.stream:
            self._parsed = [json.loads(raw)]
            return self._parsed
        documents = []
        for event in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
            data = event_data(event + b"\n\n")
            if data is not None and data.strip() != b"[DONE]":
                documents.append(json.loads(data))
        self._parsed = documents
        return documents

    def text(self) -> str | None:
        """The first choice's generated text, or None when it cannot be read back."""
        if self.overflowed:
            return None
        try:
            documents = self._documents()
            if not self.stream:
                return _choice_text(documents[0]["choices"][0], "message")
            parts: list[str] = []
            for document in documents:
                choices = document.get("choices") or []
                if choices:
                    parts.append(_choice_text(choices[0], "delta") or "")
            return "".join(parts)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return None

    def evidence(self, text: str) -> AnswerEvidence | None:
        """The first choice's log-probabilities as evidence (`answer_evidence`), or None when the answer has none; when
        the tracker asked for them, an empty evidence (the verifier refuses it: the node withheld them)."""
        evidence = None
        if not self.overflowed:
            try:
                evidence = evidence_of(self._documents(), text)
            except (ValueError, TypeError, AttributeError):
                evidence = None
        return AnswerEvidence(blocks=[]) if evidence is None and self.evidence_asked else evidence


def _choice_text(choice: dict[str, Any], key: str) -> str | None:
    if "text" in choice:  # /v1/completions
        return choice["text"]
    content = (choice.get(key) or {}).get("content")
    return content if isinstance(content, str) else None


def request_temperature(payload: dict[str, Any]) -> float:
    value = payload.get("temperature")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else LLAMA_DEFAULT_TEMPERATURE


@dataclass
class _Job:
    node_id: str
    request: AuditRequest
    issued_at: float  # when the audited answer's route was issued
    retry_s: float = RETRY_FIRST_S
    no_verdicts: int = 0
    probe: bool = False  # a registration probe's: never dropped
    done: anyio.Event = field(default_factory=anyio.Event)
    verdict: AuditVerdict | None = None


class Auditor:
    """Draws, queues and posts audits, probes new nodes, and applies verdicts. `flag_unproven(node_id, since)`
    flags a node's receipts since a time; `send(entry, path, headers, body)` forwards as the tracker does."""

    def __init__(self, verifiers: dict[str, str], policy: AuditPolicy, key: Ed25519PrivateKey, issuer: str,
                 ledger: Any, routes: Any, send: NodeSend) -> None:  # fmt: skip
        self.verifiers, self.policy, self._key, self.issuer = verifiers, policy, key, issuer
        self.ledger, self.routes, self._send = ledger, routes, send
        self.records: dict[str, NodeAudits] = {}
        self._queue: deque[_Job] = deque()
        # Per node whose share of the queue is full: its draws seen since (the reservoir's count).
        self._overflow_seen: dict[str, int] = {}
        self.outstanding = 0  # audits queued or waiting for a retry, not yet decided or dropped
        # Since this tracker started (its metrics): answers drawn, audits dropped undecided by why, verifier misses.
        self.drawn = 0
        self.dropped: Counter[str] = Counter()
        self.verifier_misses = 0
        self._wake = anyio.Event()
        self._http: httpx.AsyncClient | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    # --- which answers ------------------------------------------------------
    def verifier_for(self, entry: NodeEntry) -> str | None:
        return self.verifiers.get(entry.announcement.model_id)

    def record(self, node_id: str) -> NodeAudits:
        return self.records.setdefault(node_id, NodeAudits())

    async def load(self) -> None:
        """The ledger's audit history, read once before the tracker serves: counts, the last passed answer's
        issue time (the flags of a later failure start there), the latest audits, and answers so far."""
        totals = await self.ledger.audit_totals()
        recent = await self.ledger.recent_audits(limit=RECENT_AUDITS_SHOWN)
        for node_id, kept in totals.items():
            record = self.record(node_id)
            record.passed, record.failed, record.last_passed_at, record.answers = kept.passed, kept.failed, kept.last_passed_at, kept.routed
        for audit in recent:  # newest first, as the record keeps them
            record = self.record(audit.node_id)
            record.recent.append(audit)
            if record.last_verdict is None:
                record.last_verdict = AuditVerdict(audit_id=audit.audit_id, outcome=audit.outcome, reason=audit.reason,  # type: ignore[arg-type]
                                                   margin_nats=audit.margin_nats, positions_checked=0)  # fmt: skip
        for node_id, figures in (await self.ledger.audit_drifts()).items():
            record = self.record(node_id)
            for gap, tokens, value_gap, value_tokens, weights, issued_at in figures:
                record.drift.add(AnswerGaps(gap, tokens), issued_at)
                record.values.add(AnswerGaps(value_gap, value_tokens, rule=VALUE_DRIFTS.get(weights, VALUE_DRIFT)), issued_at)
        if totals:
            failed = sorted(node_id for node_id, kept in totals.items() if kept.failed)
            log.info("audit history of %d node(s) read from the ledger; %d failed and stay unroutable", len(totals), len(failed))

    def draw(
        self, entry: NodeEntry, path: str, payload: dict[str, Any], stream: bool, evidence_asked: bool = False
    ) -> AnswerCapture | None:
        """A capture for this answer when it is drawn for audit; None (nothing kept) otherwise. `evidence_asked`: the
        tracker asked the node for the answer's log-probabilities (`answer_evidence.evidence_body`)."""
        if self.verifier_for(entry) is None or path == EMBEDDINGS_PATH or requested_choices(payload) != 1:
            return None
        record = self.record(entry.node_id)
        record.answers += 1
        if unscoreable(payload) is not None:  # a biased or constrained answer is not the model's own: never judged
            return None
        rate = self.policy.new_node_rate if record.answers <= self.policy.new_node_answers else self.policy.rate
        if secrets.randbelow(DRAW_SCALE) >= rate * DRAW_SCALE:
            return None
        self.drawn += 1
        return AnswerCapture(stream, evidence_asked)

    def settled(self, entry: NodeEntry, path: str, body: bytes, payload: dict[str, Any], capture: AnswerCapture) -> None:
        """A drawn answer completed: queue its audit (never blocks the forward). `body`: as it was routed."""
        text = capture.text()
        if text is None:
            log.info("audit of an answer from %s skipped: its text could not be read back", entry.node_id)
            return
        request = self._request(entry, path, body, text, request_temperature(payload), capture.evidence(text))
        self._enqueue(entry.node_id, request, capture.issued_at)

    def _request(self, entry: NodeEntry, path: str, body: bytes, text: str, temperature: float,
                 evidence: AnswerEvidence | None = None) -> AuditRequest:  # fmt: skip
        return AuditRequest(audit_id=f"audit-{uuid.uuid4().hex}", model=entry.announcement.model_id, path=path,
                            body=body.decode("utf-8", "replace"), answer_text=text, temperature=temperature, evidence=evidence)  # fmt: skip

    def _enqueue(self, node_id: str, request: AuditRequest, issued_at: float, *, probe: bool = False) -> _Job:
        job = _Job(node_id, request, issued_at, probe=probe)
        if not probe:
            mine = [j for j in self._queue if j.node_id == node_id and not j.probe]
            if len(mine) >= MAX_QUEUED_AUDITS_PER_NODE:
                # Reservoir sampling over the node's draws while its share is full: the new one is kept with
                # probability share/seen, in place of one of its queued audits picked at random.
                seen = self._overflow_seen[node_id] = self._overflow_seen.get(node_id, len(mine)) + 1
                self.dropped["node_share_full"] += 1
                if secrets.randbelow(seen) >= MAX_QUEUED_AUDITS_PER_NODE:
                    log.info("audit of an answer from %s not queued: its share of the queue is full", node_id)
                    return job
                self._drop(mine[secrets.randbelow(len(mine))])
            else:
                self._overflow_seen.pop(node_id, None)
            if len(self._queue) >= MAX_QUEUED_AUDITS:
                counts = Counter(j.node_id for j in self._queue if not j.probe)
                if counts:
                    heaviest = max(counts, key=lambda n: counts[n])
                    theirs = [j for j in self._queue if j.node_id == heaviest and not j.probe]
                    self.dropped["queue_full"] += 1
                    self._drop(theirs[secrets.randbelow(len(theirs))])
        self._queue.append(job)
        self.outstanding += 1
        self.record(node_id).pending += 1
        self._wake.set()
        return job

    def _drop(self, job: _Job) -> None:
        self._queue.remove(job)
        self.outstanding -= 1
        self.record(job.node_id).pending -= 1
        log.warning("audit queue: audit %s of %s dropped undecided", job.request.audit_id, job.node_id)

    def queued(self, node_id: str | None = None) -> int:
        """Audits waiting in the queue (not those waiting for a retry), of one node or of all."""
        return len(self._queue) if node_id is None else sum(j.node_id == node_id for j in self._queue)

    # --- the owner task -----------------------------------------------------
    async def run(self, registry: Any) -> None:
        """Owns the queue and the verifier client; runs while the tracker serves."""
        self.registry = registry
        async with httpx.AsyncClient(timeout=VERIFIER_TIMEOUT_S) as http, anyio.create_task_group() as tg:
            self._http, self._tg = http, tg
            try:
                while True:
                    while not self._queue:
                        self._wake = anyio.Event()
                        await self._wake.wait()
                    job = self._queue.popleft()
                    verdict = await self._post(job)
                    if verdict is not None and verdict.outcome == "no_verdict":
                        job.no_verdicts += 1
                        if job.no_verdicts >= MAX_NO_VERDICT_ANSWERS:
                            log.info("audit %s of %s dropped: %s", job.request.audit_id, job.node_id, verdict.reason)
                            self.dropped["no_verdict"] += 1
                            job.verdict = verdict
                            job.done.set()
                            self.outstanding -= 1
                            self.record(job.node_id).pending -= 1
                            continue
                    if verdict is None or verdict.outcome == "no_verdict":
                        # Not the node's fault: asked again later, the queue goes on meanwhile.
                        self.verifier_misses += 1
                        tg.start_soon(self._retry_later, job)
                        continue
                    await self._apply(job, verdict)
                    job.verdict = verdict
                    job.done.set()
                    self.outstanding -= 1
                    self.record(job.node_id).pending -= 1
            finally:
                self._http = self._tg = None

    async def _retry_later(self, job: _Job) -> None:
        await anyio.sleep(job.retry_s)
        job.retry_s = min(job.retry_s * 2, RETRY_MAX_S)
        self._queue.append(job)
        self._wake.set()

    def _token(self, audit_id: str, body: bytes) -> str:
        # The audit policy fixes the subject and the life (its longest: one post, body read included).
        return issue(AUDIT_TOKEN, self._key, {"iss": self.issuer, "jti": audit_id, "body_sha256": body_sha256(body)})

    async def _post(self, job: _Job) -> AuditVerdict | None:
        url = self.verifiers.get(job.request.model)
        if url is None or self._http is None:
            return None
        body = job.request.model_dump_json().encode()
        headers = {"content-type": "application/json", AUDIT_TOKEN_HEADER: self._token(job.request.audit_id, body)}
        try:
            response = await self._http.post(url.rstrip("/") + AUDIT_PATH, content=body, headers=headers)
            verdict = AuditVerdict.model_validate_json(response.content) if response.status_code == 200 else None
        except (httpx.HTTPError, ValidationError) as exc:
            log.warning("verifier %s did not answer audit %s (%s); retried in %.0f s", url, job.request.audit_id, exc, job.retry_s)
            return None
        if verdict is None or verdict.audit_id != job.request.audit_id:
            log.warning("verifier %s answered audit %s with %s; retried", url, job.request.audit_id, response.status_code)
            return None
        return verdict

    @staticmethod
    def counted_gaps(job: _Job, verdict: AuditVerdict) -> AnswerGaps | None:
        """The verdict's whole-answer figures as this tracker counts them, or None: only a greedy answer's, and
        bounded by what the audited answer can hold (`AnswerGaps.bounded`), so no verdict, however it was made,
        can lower a node's CUSUM with tokens its answer never had or with a negative drift."""
        if job.request.temperature != 0.0 or verdict.outcome == "no_verdict" or verdict.drift_tokens <= 0:
            return None
        # Every token of an answer spells at least one byte of its text.
        return AnswerGaps(verdict.drift_gap_nats, verdict.drift_tokens).bounded(len(job.request.answer_text.encode("utf-8")))

    @staticmethod
    def counted_values(job: _Job, verdict: AuditVerdict) -> AnswerGaps | None:
        """The verdict's figures over the committed values as this tracker counts them, or None: only where the audit
        carried evidence, greedy or sampled, bounded the same way as `counted_gaps`."""
        if job.request.evidence is None or verdict.outcome == "no_verdict" or verdict.value_tokens <= 0:
            return None
        most = min(len(job.request.evidence.tokens), len(job.request.answer_text.encode("utf-8")))
        return AnswerGaps(verdict.value_gap_nats, verdict.value_tokens, rule=VALUE_DRIFTS[verdict.value_weights]).bounded(most)

    async def _apply(self, job: _Job, verdict: AuditVerdict) -> None:
        node_id = job.node_id
        record = self.record(node_id)
        gaps, values = self.counted_gaps(job, verdict), self.counted_values(job, verdict)
        flag_since = record.last_passed_at
        for figures, cusum, what in ((gaps, record.drift, "fall below the claimed model's best"),
                                     (values, record.values, "commit log-probabilities off the claimed model's")):  # fmt: skip
            if figures is None:
                continue
            started_at = cusum.started_at or job.issued_at
            if cusum.add(figures, job.issued_at) and verdict.outcome == "passed":
                # No token far off, but the node's audits in a row are off a little too often: a cheaper quant of the
                # claimed weights. The answers since the drift began are flagged with this one.
                flag_since = min(flag_since, started_at)
                verdict = verdict.model_copy(update={
                    "outcome": "failed",
                    "reason": f"the node's audited answers in a row {what} past their allowance: CUSUM {cusum.s:.3f} nats, "
                              f"bound {cusum.rule.refuse_nats} ({cusum.answers} judged answers so far): a cheaper quant of the "
                              f"claimed model? (this answer: {verdict.reason})",
                })  # fmt: skip
        record.last_verdict = verdict
        kept = AuditRecord(audit_id=verdict.audit_id, node_id=node_id, model=job.request.model, outcome=verdict.outcome,
                           reason=verdict.reason, margin_nats=verdict.margin_nats, issued_at=job.issued_at, decided_at=time.time(),
                           drift_gap_nats=gaps.gap_nats if gaps else 0.0, drift_tokens=gaps.tokens if gaps else 0,
                           value_gap_nats=values.gap_nats if values else 0.0, value_tokens=values.tokens if values else 0,
                           value_weights=verdict.value_weights)  # fmt: skip
        record.recent.appendleft(kept)
        if verdict.outcome == "passed":
            record.passed += 1
            # The answer's issue time, not the verdict's: answers issued after it are not proven by it.
            record.last_passed_at = max(record.last_passed_at, job.issued_at)
            await self.ledger.record_audit(kept)
            return
        record.failed += 1
        entry = self.registry.get(node_id)
        if entry is not None:
            entry.proof_blocked = True
        # Kept with its flags in one transaction: a restart finds the node failed, and its answers flagged.
        flagged = await self.ledger.record_audit(kept, flag_unproven_since=flag_since)
        log.warning("node %s failed an audit (%s): no longer routed, %d receipts since its last passed audit flagged",
                    node_id, verdict.reason, flagged)  # fmt: skip

    # --- registration probe -------------------------------------------------
    def registered(self, entry: NodeEntry) -> None:
        """A node (re)registered: with a verifier for its model, unroutable until its probe passes."""
        if self.verifier_for(entry) is None or self._tg is None:
            return
        entry.proof_blocked = True
        if self.record(entry.node_id).failed:
            # Failed an audit on this tracker, before this registration or a restart (the ledger keeps it): no
            # probe can clear it, or the node would register again, pass honestly, and switch back.
            log.warning("node %s failed an audit here before: it registered again and stays unroutable", entry.node_id)
            return
        self._tg.start_soon(self._probe, entry)

    async def _probe(self, entry: NodeEntry) -> None:
        announcement = entry.announcement
        while not entry.healthy:
            if self.registry.get(entry.node_id) is not entry or entry.announcement is not announcement:
                return  # gone, or registered again (that registration has its own probe)
            await anyio.sleep(PROBE_READY_POLL_S)
        jobs = []
        for prompt in PROBE_PROMPTS:
            payload = {"model": announcement.model_id, "prompt": prompt, "max_tokens": PROBE_TOKENS, "temperature": 0}
            asked = evidence_body(PROBE_PATH, payload)
            body = asked or json.dumps(payload).encode()
            issued_at = time.time()
            answer = await self._probe_answer(entry, payload, body, evidence_asked=asked is not None)
            if answer is None:
                log.warning("probe of %s got no answer; it stays unroutable until it registers again", entry.node_id)
                return
            request = self._request(entry, PROBE_PATH, body, answer[0], 0.0, answer[1])
            jobs.append(self._enqueue(entry.node_id, request, issued_at, probe=True))
        for job in jobs:
            await job.done.wait()
        # A node that ever failed an audit on this tracker stays refused, whatever a later probe says:
        # otherwise it would register again, pass the probe honestly, and switch back.
        passed = all(job.verdict is not None and job.verdict.outcome == "passed" for job in jobs)
        if passed and self.record(entry.node_id).failed == 0 and entry.announcement is announcement:
            entry.proof_blocked = False
            log.info("node %s passed its registration probe: routable", entry.node_id)

    async def _probe_answer(self, entry: NodeEntry, payload: dict[str, Any], body: bytes,
                            evidence_asked: bool) -> tuple[str, AnswerEvidence | None] | None:  # fmt: skip
        """One greedy answer asked the way a client's is routed (a signed route and a ledger row): its text and evidence."""
        request_id = f"req-{uuid.uuid4().hex}"
        max_tokens = self.routes.route_max_tokens(PROBE_PATH, payload)
        token = self.routes.sign_route(entry, request_id, PROBE_PATH, payload["model"], body, max_tokens)
        written = self.ledger.open_request_soon(request_id, entry.node_id, entry.announcement.model_id, PROBE_PATH, False,
                                                max_tokens=max_tokens, choices=1, body_bytes=len(body), prompt_ceiling=prompt_ceiling(payload))  # fmt: skip
        headers = {"content-type": "application/json", "accept-encoding": "identity", ROUTE_HEADER: token,
                   REQUEST_ID_HEADER: request_id, "x-request-id": request_id}  # fmt: skip
        capture, meter, status = AnswerCapture(stream=False, evidence_asked=evidence_asked), ForwardMeter(False, payload), None
        try:
            await written
            upstream = await self._send(entry, PROBE_PATH, headers, body)
            status = upstream.status
            try:
                async for chunk in upstream.iter_chunks():
                    meter.feed(chunk)
                    capture.feed(chunk)
            finally:
                await upstream.aclose()
        except Exception as exc:  # the node's fault or the network's: the probe gives up, the node stays unroutable
            log.warning("probe request to %s failed: %s", entry.node_id, exc)
        outcome = "complete" if status == 200 else "upstream_error"
        await self.ledger.finish_request(request_id, status, outcome, meter.counted(),
                                         completion_ceiling=meter.completion_ceiling(max_tokens or 0))  # fmt: skip
        text = capture.text() if status == 200 else None
        return None if text is None else (text, capture.evidence(text))
