"""Proof of quant from the committed values (`proof.values`, `reference/tracker/answer_evidence`, the tracker's second
CUSUM): the log-probabilities a node's llama-server reported at each answer token, asked by the tracker on every answer
and kept from clients that did not ask, judged against the claimed model's over the whole answer and over a node's
audits in a row. Attacker tests: a node that withholds them is refused, a verdict cannot buy allowance with tokens
the evidence never had, and the figures survive a restart. No llama-server here (tests/proof/test_proof_wiring.py
runs the real one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.audit_harness import RegistryStandIn, auditor_on

from meshnet_gguf.contract.model_proof import (
    EVIDENCE_TOP_K,
    VALUE_DRIFT,
    VALUE_DRIFTS,
    AnswerEvidence,
    AnswerGaps,
    AuditRequest,
    AuditVerdict,
    NodeDrift,
    evidence_from_token_probs,
    value_weights,
)
from meshnet_gguf.contract.openai_paths import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH
from meshnet_gguf.proof.audit import audit
from meshnet_gguf.proof.scoring import Position, Scored
from meshnet_gguf.proof.values import check_values, value_gaps
from meshnet_gguf.reference.tracker.answer_evidence import LogprobStripper, evidence_body, evidence_of
from meshnet_gguf.reference.tracker.audits import AnswerCapture, Auditor, _Job
from meshnet_gguf.reference.tracker.ledger import TrackerLedger

pytestmark = pytest.mark.anyio

TOKENS = 32


def _entry(token: int, logprob: float, text: str = "a") -> dict[str, Any]:
    top = [{"id": token, "token": text, "bytes": list(text.encode()), "logprob": logprob},
           {"id": token + 1, "token": "b", "bytes": [98], "logprob": logprob - 1.0}]  # fmt: skip
    return {"id": token, "token": text, "bytes": list(text.encode()), "logprob": logprob, "top_logprobs": top}


def _evidence(offsets: list[float]) -> AnswerEvidence:
    """A node's evidence where token 1 is its top-1 at every position, its value `-0.5 + offset`."""
    return evidence_from_token_probs([_entry(1, -0.5 + o) for o in offsets])


def _scored(n: int) -> Scored:
    """The claimed model's view: token 1 at -0.5, token 2 at -1.5, at every position."""
    return Scored(tuple(Position(1, ((1, -0.5), (2, -1.5))) for _ in range(n)), 1)


# --- the verifier's figures -------------------------------------------------------------------------------


def test_an_answer_whose_values_match_adds_nothing_and_one_off_on_every_token_is_past_its_allowance() -> None:
    rule = VALUE_DRIFTS["float"]
    honest = value_gaps(_scored(TOKENS), _evidence([0.0] * TOKENS), rule)
    assert honest.tokens == TOKENS and honest.gap_nats < 0.01 and check_values(honest).passed is True
    # A near quant: each value 3x the allowance off, alternately high and low (no direction to average away).
    off = 3 * rule.allowance_nats_per_token
    quant = value_gaps(_scored(TOKENS), _evidence([off if i % 2 else -off for i in range(TOKENS)]), rule)
    assert quant.excess() == pytest.approx(2 * rule.allowance_nats_per_token * TOKENS, abs=LOGPROB_SLACK)
    node = NodeDrift(rule=VALUE_DRIFT)
    answers = 0
    while not node.add(quant):
        answers += 1
        assert answers < 20
    honest_node = NodeDrift(rule=VALUE_DRIFT)
    assert not any(honest_node.add(honest) for _ in range(1000)) and honest_node.s == 0.0


def test_a_committed_top1_the_claimed_model_does_not_rank_counts_at_the_cap() -> None:
    forged = evidence_from_token_probs([_entry(77, -0.01)] * TOKENS)  # a token the claimed model's wide top lacks
    figures = value_gaps(_scored(TOKENS), forged, VALUE_DRIFTS["quantized"])
    assert figures.gap_nats == pytest.approx(VALUE_DRIFT.cap_nats * TOKENS) and not figures.tie_broken
    assert check_values(figures).passed is False


def test_the_claimed_files_weights_pick_the_allowance() -> None:
    assert value_weights("F16") == value_weights("BF16") == value_weights("all F32") == "float"
    assert value_weights("Q8_0") == "q8_0"
    assert value_weights("Q4_K - Medium") == value_weights("IQ3_XXS - 3.0625 bpw") == value_weights(None) == "quantized"
    allowances = [VALUE_DRIFTS[w].allowance_nats_per_token for w in ("float", "q8_0", "quantized")]
    assert allowances == sorted(allowances) and len(set(allowances)) == 3


def _fake_llama(answer: list[int], ftype: str = "F16") -> httpx.MockTransport:
    """A verifier's llama-server: token 1 at -0.5 and token 2 at -1.5 everywhere; the answer spells "a" per token."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "meta": {"ftype": ftype}}]})
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [9]})
        if request.url.path == "/detokenize":
            return httpx.Response(200, json={"content": "a" * len(body["tokens"])})
        done = len(body["prompt"]) - 1
        probs = [{"id": 1, "top_logprobs": [{"id": 1, "logprob": -0.5}, {"id": 2, "logprob": -1.5}]} for _ in answer[done:]]
        return httpx.Response(200, json={"completion_probabilities": probs})

    return httpx.MockTransport(handle)


async def _audit(evidence: AnswerEvidence, temperature: float = 0.0, ftype: str = "F16", text: str = "a" * TOKENS) -> AuditVerdict:
    request = AuditRequest(audit_id="a", model="m", path=COMPLETIONS_PATH, body=json.dumps({"prompt": "hi"}),
                           answer_text=text, temperature=temperature, evidence=evidence)  # fmt: skip
    async with httpx.AsyncClient(base_url="http://verifier", transport=_fake_llama([1] * TOKENS, ftype)) as client:
        return await audit(client, request)


async def test_a_verdict_carries_the_values_figures_for_greedy_and_sampled_answers_with_the_files_weights() -> None:
    for temperature in (0.0, 0.8):
        verdict = await _audit(_evidence([0.002] * TOKENS), temperature)
        assert verdict.outcome == "passed" and verdict.value_tokens == TOKENS and verdict.value_weights == "float"
        assert verdict.value_gap_nats == pytest.approx(0.002 * TOKENS, abs=LOGPROB_SLACK)
    assert (await _audit(_evidence([0.002] * TOKENS), ftype="Q8_0")).value_weights == "q8_0"
    assert (await _audit(_evidence([0.002] * TOKENS), ftype="Q4_K - Medium")).value_weights == "quantized"


LOGPROB_SLACK = TOKENS / 512  # the evidence's values are kept to 1/512 nat


async def test_an_answer_whose_values_alone_pass_the_bound_is_refused() -> None:
    off = (VALUE_DRIFT.refuse_nats / TOKENS) + VALUE_DRIFTS["float"].allowance_nats_per_token + 0.05
    verdict = await _audit(_evidence([off] * TOKENS))
    assert verdict.outcome == "failed" and "log-probabilities" in verdict.reason


async def test_a_node_that_withholds_the_log_probabilities_asked_of_it_is_refused() -> None:
    # Attacker: a node that drops the values from its answers would escape the values' test; the tracker asked for
    # them on every answer, and an honest llama-server always sends them.
    capture = AnswerCapture(stream=False, evidence_asked=True)
    capture.feed(json.dumps({"choices": [{"text": "a" * TOKENS, "index": 0}]}).encode())
    evidence = capture.evidence("a" * TOKENS)
    assert evidence is not None and evidence.blocks == []
    verdict = await _audit(evidence)
    assert verdict.outcome == "failed" and "without the log-probabilities" in verdict.reason
    # A client that asked for none itself (the tracker did not either): no evidence, the token tests alone.
    unasked = AnswerCapture(stream=False)
    unasked.feed(json.dumps({"choices": [{"text": "a", "index": 0}]}).encode())
    assert unasked.evidence("a") is None


# --- the tracker: asking, stripping, capturing --------------------------------------------------------------


def test_the_tracker_asks_every_answer_of_an_audited_model_for_its_top_k_unless_the_client_did() -> None:
    chat = json.loads(evidence_body(CHAT_COMPLETIONS_PATH, {"model": "m", "messages": []}) or b"{}")
    assert chat["logprobs"] is True and chat["top_logprobs"] == EVIDENCE_TOP_K
    legacy = json.loads(evidence_body(COMPLETIONS_PATH, {"model": "m", "prompt": "x", "logprobs": 0}) or b"{}")
    assert legacy["logprobs"] == EVIDENCE_TOP_K
    assert evidence_body(COMPLETIONS_PATH, {"prompt": "x", "logprobs": 2}) is None  # the client's own, left alone
    assert evidence_body(CHAT_COMPLETIONS_PATH, {"messages": [], "logprobs": True}) is None
    assert evidence_body(EMBEDDINGS_PATH, {"input": "x"}) is None


def _stream(pieces: list[str]) -> bytes:
    events = [{"choices": [{"index": 0, "delta": {"content": p}, "logprobs": {"content": [_entry(i + 1, -0.25, p)]}}]}
              for i, p in enumerate(pieces)]  # fmt: skip
    tail = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "logprobs": {"content": [_entry(99, -0.1, "")]}}]}
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in [*events, tail]) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("cut", [1, 7, 64, 10_000])
def test_a_streams_log_probabilities_are_taken_out_event_by_event_wherever_its_reads_are_cut(cut: int) -> None:
    raw = _stream(["Hel", "lo", " wor", "ld"])
    stripper = LogprobStripper(stream=True)
    out = b"".join(stripper.feed(raw[i : i + cut]) for i in range(0, len(raw), cut)) + stripper.end()
    assert b"logprobs" not in out and out.endswith(b"data: [DONE]\n\n")
    deltas = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert "".join(d or "" for d in deltas) == "Hello world"


def test_a_whole_answers_log_probabilities_are_taken_out_and_an_error_body_passes_as_it_came() -> None:
    whole = {"choices": [{"index": 0, "text": "hi", "logprobs": {"content": [_entry(1, -0.2, "hi")]}}], "usage": {"completion_tokens": 1}}
    stripper = LogprobStripper(stream=False)
    assert stripper.feed(json.dumps(whole).encode()) == b""
    kept = json.loads(stripper.end())
    assert "logprobs" not in kept["choices"][0] and kept["usage"] == whole["usage"] and kept["choices"][0]["text"] == "hi"
    broken = LogprobStripper(stream=False)
    broken.feed(b"<html>bad gateway</html>")
    assert broken.end() == b"<html>bad gateway</html>"


def test_the_evidence_spells_the_forwarded_text_without_the_end_token() -> None:
    raw = _stream(["Hel", "lo"])
    documents = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    evidence = evidence_of(documents, "Hello")
    assert evidence is not None and evidence.tokens == [1, 2]  # the end token (no bytes) is not the answer's
    assert evidence_of(documents, "Hello")
    no_tops = [{"choices": [{"logprobs": {"content": [{**_entry(1, -0.2), "top_logprobs": []}]}}]}]
    assert evidence_of(no_tops, "a") is None


# --- the tracker's second CUSUM -------------------------------------------------------------------------------


def _job(issued_at: float, temperature: float = 0.8, tokens: int = TOKENS) -> _Job:
    request = AuditRequest(audit_id=f"audit-{issued_at}", model="m", path=COMPLETIONS_PATH, body="{}", answer_text="a" * tokens,
                           temperature=temperature, evidence=_evidence([0.0] * tokens))  # fmt: skip
    return _Job("node", request, issued_at)


def _verdict(job: _Job, gaps: AnswerGaps, weights: str = "float") -> AuditVerdict:
    return AuditVerdict(audit_id=job.request.audit_id, outcome="passed", reason="within", margin_nats=0.1,  # type: ignore[arg-type]
                        positions_checked=gaps.tokens, value_gap_nats=gaps.gap_nats, value_tokens=gaps.tokens,
                        value_weights=weights)  # fmt: skip


async def test_the_tracker_refuses_a_node_whose_sampled_answers_values_drift_and_keeps_it_across_a_restart(
    ledger: TrackerLedger, tmp_path: Path
) -> None:
    registry = RegistryStandIn("node")
    auditor = auditor_on(ledger, registry)
    quant = AnswerGaps(3 * VALUE_DRIFTS["float"].allowance_nats_per_token * TOKENS, TOKENS, rule=VALUE_DRIFTS["float"])
    applied = 0
    while not registry.entries["node"].proof_blocked:
        applied += 1
        job = _job(float(applied))  # sampled: the token drift cannot judge these, the values can
        await auditor._apply(job, _verdict(job, quant))
        assert applied < 60
    record = auditor.record("node")
    assert record.failed == 1 and record.drift.s == 0.0 and "log-probabilities" in record.last_verdict.reason  # type: ignore[union-attr]
    ledger.close()
    again = TrackerLedger(tmp_path / "tracker.sqlite")
    try:
        restarted = auditor_on(again, RegistryStandIn())
        await restarted.load()
        assert restarted.record("node").values.s == pytest.approx(record.values.s) and restarted.record("node").failed == 1
    finally:
        again.close()


async def test_a_forged_verdict_cannot_buy_allowance_with_tokens_the_evidence_never_had(ledger: TrackerLedger) -> None:
    # Attacker: zero drift over a million tokens would wipe a drifting node's values CUSUM. The tracker counts at most
    # the tokens the audit's evidence holds, and the verifier's kind of weights picks only one of the two allowances.
    auditor = auditor_on(ledger, RegistryStandIn())
    quant = AnswerGaps(2 * VALUE_DRIFTS["float"].allowance_nats_per_token * TOKENS, TOKENS, rule=VALUE_DRIFTS["float"])
    for i in range(1, 7):
        job = _job(float(i))
        await auditor._apply(job, _verdict(job, quant))
    s = auditor.record("node").values.s
    forged = _job(10.0)
    await auditor._apply(forged, _verdict(forged, AnswerGaps(0.0, 1_000_000, rule=VALUE_DRIFTS["float"]), weights="q8_0"))
    assert s - VALUE_DRIFTS["q8_0"].allowance_nats_per_token * TOKENS > 0
    assert auditor.record("node").values.s >= s - VALUE_DRIFTS["q8_0"].allowance_nats_per_token * TOKENS - 1e-9
    without = _job(11.0)
    bare = without.request.model_copy(update={"evidence": None})
    assert Auditor.counted_values(_Job("node", bare, 11.0), _verdict(without, quant)) is None
