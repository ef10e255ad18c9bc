"""One audit from end to end, on the verifier: the wire's `AuditRequest` in, an `AuditVerdict` out.

The prompt's tokens come from the verifier's own llama-server (`/apply-template` for a chat, then
`/tokenize`, as llama-server does for the request itself). The answer's tokens are the evidence's,
once their text is checked to be the text the tracker forwarded (`/detokenize`); without evidence,
the forwarded text tokenized. Then the answer is scored (`scoring`) and judged (`check`): greedy
answers by the near-tie rule, sampled ones by the likelihood test, and evidence, when there is
some, against its commitment and value by value. Anything that stops the verifier from scoring
(its llama-server down, a body it cannot read) is `no_verdict`, which never counts against a node.
"""

from __future__ import annotations

import json
import math

import httpx

from meshnet_gguf.contract.model_proof import (
    EVIDENCE_TOP_K,
    VALUE_DRIFTS,
    AuditRequest,
    AuditVerdict,
    ValueWeights,
    unscoreable,
    value_weights,
)
from meshnet_gguf.proof.check import (
    Verdict,
    check_evidence,
    check_greedy,
    check_sampled,
)
from meshnet_gguf.proof.drift import answer_gaps, check_drift
from meshnet_gguf.proof.scoring import ScoringFailed, score_answer
from meshnet_gguf.proof.tolerance import GREEDY_TIE_NATS, VERIFIER_TOP_K_FACTOR
from meshnet_gguf.proof.values import check_values, value_gaps

# Wide enough for the sampled test: llama.cpp's default sampler chain keeps the top 40.
SAMPLED_TOP_K = 40
# An answer longer than this many tokens is not scored (no verdict, never a refusal): the verifier's cost grows with
# it (one decode of the answer, more per divergence), and its llama-server's context (the node's may be larger)
# must hold the prompt and the answer. Far above the tracker's bound on a captured answer's text, in tokens.
MAX_SCORED_TOKENS = 8192
# A verdict the checks call certain (evidence that does not cover the answer, say) has an infinite margin; the
# wire carries finite numbers only, so it goes as this many nats, beyond any measured margin.
CERTAIN_MARGIN_NATS = 1e6


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, object]) -> dict[str, object]:
    try:
        response = await client.post(path, json=body, timeout=60)
    except httpx.HTTPError as exc:
        raise ScoringFailed(f"verifier llama-server unreachable: {exc}") from exc
    if response.status_code != 200:
        raise ScoringFailed(f"verifier llama-server answered {path} with {response.status_code}")
    return response.json()


async def prompt_tokens(client: httpx.AsyncClient, path: str, body: dict[str, object]) -> list[int]:
    if path.endswith("/chat/completions"):
        rendered = await _post(client, "/apply-template", {k: v for k, v in body.items() if k != "stream"})
        prompt = rendered.get("prompt")
    else:
        prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if not isinstance(prompt, str):
        raise ScoringFailed("the request has no prompt the verifier can read")
    tokens = (await _post(client, "/tokenize", {"content": prompt, "add_special": True, "parse_special": True}))["tokens"]
    return [int(t) for t in tokens]  # type: ignore[union-attr]


async def answer_tokens(client: httpx.AsyncClient, request: AuditRequest) -> list[int] | str:
    """The answer's tokens, or why they cannot be the forwarded answer (a refusal)."""
    if request.evidence is None:
        tokens = (await _post(client, "/tokenize", {"content": request.answer_text, "add_special": False}))["tokens"]
        return [int(t) for t in tokens]  # type: ignore[union-attr]
    if request.commitment is not None and request.evidence.commitment() != request.commitment:
        return "the evidence is not the one the receipt committed to"
    if not request.evidence.blocks and request.answer_text:
        return "the answer came without the log-probabilities its tracker asked for"
    tokens = request.evidence.tokens
    text = (await _post(client, "/detokenize", {"tokens": tokens}))["content"]
    if text != request.answer_text:
        return "the evidence's tokens do not spell the answer that was forwarded"
    return tokens


def _verdict(request: AuditRequest, verdict: Verdict, drift: tuple[float, int] = (0.0, 0),
             values: tuple[float, int, ValueWeights] = (0.0, 0, "quantized")) -> AuditVerdict:  # fmt: skip
    outcome = "no_verdict" if verdict.passed is None else "passed" if verdict.passed else "failed"
    return AuditVerdict(audit_id=request.audit_id, outcome=outcome, reason=verdict.reason, margin_nats=wire_margin(verdict.margin),
                        positions_checked=verdict.positions, drift_gap_nats=drift[0], drift_tokens=drift[1],
                        value_gap_nats=values[0], value_tokens=values[1], value_weights=values[2])  # fmt: skip


async def claimed_weights(client: httpx.AsyncClient) -> ValueWeights:
    """Whether the claimed file the verifier's llama-server holds stores its matrices as floats or quantized (its
    `/v1/models` meta's `ftype`): the allowance its committed values get (`contract.model_proof.VALUE_DRIFTS`)."""
    try:
        response = await client.get("/v1/models", timeout=60)
        ftype = response.json()["data"][0]["meta"]["ftype"] if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ScoringFailed(f"verifier llama-server did not say its model's weights: {exc}") from exc
    return value_weights(ftype if isinstance(ftype, str) else None)


def wire_margin(margin: float) -> float:
    """The margin as the wire carries it (finite numbers only): a certain verdict's infinite margin, or
    one that is not a number, becomes ±CERTAIN_MARGIN_NATS, so it is never lost to a refused verdict."""
    if math.isnan(margin):
        return -CERTAIN_MARGIN_NATS
    return max(-CERTAIN_MARGIN_NATS, min(CERTAIN_MARGIN_NATS, margin))


async def audit(client: httpx.AsyncClient, request: AuditRequest) -> AuditVerdict:
    """Check one answer against the claimed model served at `client`'s base URL."""
    try:
        body = json.loads(request.body)
        if isinstance(body, dict) and (why := unscoreable(body)) is not None:
            return _verdict(request, Verdict(None, f"no verdict: {why}", 0.0, 0))
        prompt = await prompt_tokens(client, request.path, body)
        answer = await answer_tokens(client, request)
        if isinstance(answer, str):
            return _verdict(request, Verdict(False, answer, float("-inf"), 0))
        if not answer:
            return _verdict(request, Verdict(None, "an empty answer proves nothing", 0.0, 0))
        if len(answer) > MAX_SCORED_TOKENS:
            return _verdict(
                request, Verdict(None, f"no verdict: {len(answer)} tokens, more than {MAX_SCORED_TOKENS} are not scored", 0.0, 0)
            )
        greedy = request.temperature == 0.0
        top_k = EVIDENCE_TOP_K * VERIFIER_TOP_K_FACTOR if greedy or request.evidence else SAMPLED_TOP_K
        # A request with ignore_eos (llama-server's own field) let the node go on past the model's end.
        ends_ignored = body.get("ignore_eos") is True
        scored = await score_answer(client, prompt, answer, top_k=max(top_k, SAMPLED_TOP_K if not greedy else 0),
                                    give_up_gap=GREEDY_TIE_NATS if greedy else None, ends_ignored=ends_ignored)  # fmt: skip
        weights = await claimed_weights(client) if request.evidence is not None else "quantized"
    except (ScoringFailed, ValueError) as exc:
        return _verdict(request, Verdict(None, f"no verdict: {exc}", 0.0, 0))
    verdicts = [check_greedy(scored) if greedy else check_sampled(scored, request.temperature)]
    drift = (0.0, 0)
    if greedy:
        # The whole answer (proof.drift): its figures go to the tracker, which adds them to the node's CUSUM.
        gaps = answer_gaps(scored, len(answer))
        verdicts.append(check_drift(gaps))
        if verdicts[-1].passed is not None:
            drift = (gaps.gap_nats, gaps.tokens)
    values: tuple[float, int, ValueWeights] = (0.0, 0, "quantized")
    if request.evidence is not None:
        verdicts.append(check_evidence(scored, request.evidence))
        # The committed values over the whole answer (proof.values), greedy or sampled: to the node's other CUSUM.
        value_figures = value_gaps(scored, request.evidence, VALUE_DRIFTS[weights])
        verdicts.append(check_values(value_figures))
        if verdicts[-1].passed is not None:
            values = (value_figures.gap_nats, value_figures.tokens, weights)
    failed = [v for v in verdicts if v.passed is False]
    # A check that could not judge (the whole-answer test on a short answer) neither passes nor refuses the answer.
    judged = [v for v in verdicts if v.passed is not None] or verdicts
    return _verdict(request, min(failed or judged, key=lambda v: v.margin), drift, values)
