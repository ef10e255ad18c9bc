"""The verdict on one answer, from the verifier's scores (`scoring.score_answer`): pure, no I/O.

Three checks, each returning a `Verdict` with the reason and the margin to its tolerance:
- `check_greedy`: every token of a greedy answer is the claimed model's best, up to near-ties;
- `check_evidence`: the node's committed top-k probabilities are the claimed model's, and
  cover exactly the answer's tokens;
- `check_sampled`: a sampled answer's log-likelihood at its temperature is what the claimed model's
  own samples score (a z-score over the tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshnet_gguf.contract.model_proof import (
    LOGPROB_STEP,
    AnswerEvidence,
    dequantize_logprob,
)
from meshnet_gguf.proof.scoring import Scored
from meshnet_gguf.proof.tolerance import (
    EVIDENCE_PROB_TOLERANCE,
    GREEDY_TIE_NATS,
    SAMPLED_MIN_TOKENS,
    SAMPLED_Z_REFUSE,
)


@dataclass(frozen=True)
class Verdict:
    passed: bool | None  # None: no verdict (too short, nothing to compare); never a refusal
    reason: str
    margin: float  # > 0: inside the tolerance by that much; < 0: outside
    positions: int


def check_greedy(scored: Scored, *, tolerance: float = GREEDY_TIE_NATS) -> Verdict:
    worst, where = 0.0, -1
    for i, position in enumerate(scored.positions):
        gap = position.gap()
        if gap > worst:
            worst, where = gap, i
    n = len(scored.positions)
    if worst > tolerance:
        return Verdict(False, f"token {where} is {worst:.3f} nats below the claimed model's best (ties up to {tolerance})",
                       tolerance - worst, n)  # fmt: skip
    return Verdict(True, f"every token is the claimed model's best or within {worst:.4f} nats of it", tolerance - worst, n)


def check_evidence(scored: Scored, evidence: AnswerEvidence, *, tolerance: float = EVIDENCE_PROB_TOLERANCE) -> Verdict:
    tokens = evidence.tokens
    answer = [p.token for p in scored.positions]
    if tokens[: len(answer)] != answer or len(tokens) < len(answer):
        return Verdict(False, "the evidence does not cover the answer's tokens", -math.inf, 0)
    # A probability moves at most as much as its log-probability (slope <= 1 below 0): the half step bounds both.
    allowed = tolerance + LOGPROB_STEP / 2
    worst, where = 0.0, -1
    pairs = [(ids, qs) for block in evidence.blocks for ids, qs in zip(block.top_ids, block.top_q)]
    for i, (position, (ids, qs)) in enumerate(zip(scored.positions, pairs)):
        # The committed best must be the verifier's best value (an evidence that leaves out the
        # model's favourite is caught here), and every committed entry must match.
        diffs = [abs(math.exp(position.top[0][1]) - math.exp(max(dequantize_logprob(q) for q in qs)))]
        for tid, q in zip(ids, qs):
            theirs = position.logprob_of(tid)
            # Not in the verifier's wider top: it can only be at or below its last entry.
            diffs.append(abs(math.exp(theirs) - math.exp(dequantize_logprob(q))) if theirs is not None
                         else max(0.0, math.exp(dequantize_logprob(q)) - math.exp(position.top[-1][1])))  # fmt: skip
        if max(diffs) > worst:
            worst, where = max(diffs), i
    n = len(scored.positions)
    if worst > allowed:
        return Verdict(False, f"token {where}: a committed probability is {worst:.3f} off the claimed model's "
                              f"(tolerance {tolerance})", allowed - worst, n)  # fmt: skip
    return Verdict(True, f"every committed probability within {worst:.4f} of the claimed model's", allowed - worst, n)


def sampling_distribution(top: tuple[tuple[int, float], ...], temperature: float) -> dict[int, float]:
    """The claimed model's distribution at `temperature` over the verifier's top-k (llama.cpp's
    default chain keeps its top 40): log-probabilities scaled by 1/T and renormalised."""
    scaled = [(tid, lp / temperature) for tid, lp in top]
    top_value = max(v for _, v in scaled)
    weights = {tid: math.exp(v - top_value) for tid, v in scaled}
    total = sum(weights.values())
    return {tid: w / total for tid, w in weights.items()}


def sampled_z(scored: Scored, temperature: float) -> float:
    """(observed - expected) / sd of the answer's log-likelihood under the claimed model at `temperature`."""
    observed = expected = variance = 0.0
    for position in scored.positions:
        dist = sampling_distribution(position.top, temperature)
        floor = min(dist.values())
        mean = sum(p * math.log(p) for p in dist.values())
        variance += sum(p * math.log(p) ** 2 for p in dist.values()) - mean * mean
        expected += mean
        observed += math.log(dist.get(position.token, floor / 2))  # outside the top-k: below its last
    return (observed - expected) / math.sqrt(variance) if variance > 0 else 0.0


def check_sampled(scored: Scored, temperature: float, *, z_refuse: float = SAMPLED_Z_REFUSE) -> Verdict:
    n = len(scored.positions)
    if n < SAMPLED_MIN_TOKENS:
        return Verdict(None, f"{n} tokens: too few for the sampled test (needs {SAMPLED_MIN_TOKENS})", 0.0, n)
    z = sampled_z(scored, temperature)
    if z < z_refuse:
        return Verdict(False, f"the answer is {-z:.1f} standard deviations less likely under the claimed model than "
                              f"its own samples at temperature {temperature}", z - z_refuse, n)  # fmt: skip
    return Verdict(True, f"the answer's likelihood is the claimed model's own (z = {z:.2f})", z - z_refuse, n)
