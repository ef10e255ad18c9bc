"""The verdict from a whole answer, and from a node's audits in a row: a one-sided CUSUM on the per-token gap.

`check.check_greedy` refuses an answer with one token far below the claimed model's best (a tie broken past
`GREEDY_TIE_NATS`). A cheaper quant of the same weights breaks no such tie: its error is small on every token. But it
is there on many tokens, and always the same way: the served tokens fall below the claimed model's best by a little,
often. Another backend running the claimed file falls below it rarely, and by less (near-ties only). So over an
answer's tokens, and over a node's audits in a row, the statistic is the sum of the gaps (each capped at the tie: a
larger one is the per-token check's) less an allowance per token, kept from falling below zero (Page's CUSUM):

    S <- max(0, S + sum(gaps) - DRIFT_ALLOWANCE_NATS_PER_TOKEN * tokens)

and a node is refused when S passes `DRIFT_REFUSE_NATS`. One answer alone is judged by the same rule from S = 0.
An honest node's gaps stay under the allowance on average, so S keeps returning to 0 and its audits never add up;
a cheaper quant's stay over it, so S grows with every audited token until it passes the bound.

The rule over a node's audits is the tracker's, so it and its bounds live in the contract (`contract.model_proof`:
`AnswerGaps`, `NodeDrift`, the `DRIFT_*` constants, with the measurements they come from); here is the verifier's
side, an answer's figures from its scores. Only greedy answers are judged this way (a sampled answer's gaps are the
sampler's choice, not the model's error). Pure: no I/O.
"""

from __future__ import annotations

from meshnet_gguf.contract.model_proof import (
    DRIFT_ALLOWANCE_NATS_PER_TOKEN,
    DRIFT_MIN_TOKENS,
    DRIFT_REFUSE_NATS,
    AnswerGaps,
    NodeDrift,
    answer_refused,
)
from meshnet_gguf.proof.check import Verdict
from meshnet_gguf.proof.scoring import Scored

__all__ = ["AnswerGaps", "NodeDrift", "answer_gaps", "answer_refused", "check_drift"]


def answer_gaps(scored: Scored, answer_tokens: int) -> AnswerGaps:
    return AnswerGaps.of([p.gap() for p in scored.positions], answer_tokens)


def check_drift(gaps: AnswerGaps) -> Verdict:
    """The whole-answer verdict of a greedy answer's figures: None (not judged) when too short or when a token broke
    the tie (the per-token check gives that answer its verdict)."""
    if gaps.tie_broken:
        return Verdict(None, "a token past the tie: the per-token check judges this answer", 0.0, gaps.tokens)
    if not gaps.judged():
        return Verdict(None, f"{gaps.tokens} tokens: too few for the whole-answer test (needs {DRIFT_MIN_TOKENS})", 0.0, gaps.tokens)
    margin = DRIFT_REFUSE_NATS - gaps.excess()
    if margin < 0:
        return Verdict(False, f"the answer's tokens fall {gaps.gap_nats:.3f} nats in all below the claimed model's best over "
                              f"{gaps.tokens} tokens: past the allowance of {DRIFT_ALLOWANCE_NATS_PER_TOKEN} nats a token by "
                              f"{-margin + DRIFT_REFUSE_NATS:.3f}, beyond the bound {DRIFT_REFUSE_NATS}", margin, gaps.tokens)  # fmt: skip
    return Verdict(True, f"the answer's gaps add up to {gaps.gap_nats:.4f} nats over {gaps.tokens} tokens", margin, gaps.tokens)
