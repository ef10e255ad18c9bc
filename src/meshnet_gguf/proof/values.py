"""The whole-answer verdict from the values a node's evidence committed: proof of quant that sees a near quant.

`drift` judges which tokens a greedy answer picked. A near quant of the claimed weights (the demo's Q4_K_M served as
its Q8_0) picks the claimed model's tokens but at near-ties, and an honest node on CUDA breaks more near-ties than it
does, so no rule over the picks can tell them apart. The evidence says more: at every answer token the node commits
its top-k log-probabilities, the raw softmax before any sampler. A cheaper quant moves those values on nearly every
token; the claimed file on another backend moves them far less (bench/RESULTS.md, "Proof of quant from the committed
values"). Per token the figure is |committed log-probability of the node's top-1 - the claimed model's value for that
token|, capped at `VALUE_GAP_CAP_NATS` (one token must not carry a whole answer's drift), and an answer's
figures go into the same CUSUM as `drift`'s, with their own bounds (`contract.model_proof.VALUE_DRIFTS`, by whether the claimed file's
weights are floats or quantized).

The values are the model's before the sampler, so sampled answers are judged as greedy ones are. Pure: no I/O.
"""

from __future__ import annotations

from meshnet_gguf.contract.model_proof import VALUE_DRIFT, AnswerEvidence, AnswerGaps, DriftRule, dequantize_logprob
from meshnet_gguf.proof.check import Verdict
from meshnet_gguf.proof.scoring import Scored


def value_gaps(scored: Scored, evidence: AnswerEvidence, rule: DriftRule = VALUE_DRIFT) -> AnswerGaps:
    """An answer's figures under `rule` (the claimed file's kind of weights, `contract.model_proof.VALUE_DRIFTS`): per
    scored position, how far the committed top-1's value lies from the claimed model's. A top-1 the verifier's wider top
    does not hold lies below its last entry: at least that far, counted at the cap."""
    gaps: list[float] = []
    committed = [(ids[0], qs[0]) for block in evidence.blocks for ids, qs in zip(block.top_ids, block.top_q)]
    for position, (top_id, q) in zip(scored.positions, committed):
        theirs = position.logprob_of(top_id)
        gaps.append(rule.cap_nats if theirs is None else abs(theirs - dequantize_logprob(q)))
    # Capped, not broken: one value far off counts at most the cap (`check.check_evidence` judges each entry).
    return AnswerGaps.of([min(g, rule.cap_nats) for g in gaps], rule=rule)


def check_values(gaps: AnswerGaps) -> Verdict:
    """The whole-answer verdict on the committed values: None (not judged) when too short."""
    rule = gaps.rule
    if not gaps.judged():
        return Verdict(None, f"{gaps.tokens} tokens: too few for the committed values' test (needs {rule.min_tokens})", 0.0, gaps.tokens)
    margin = rule.refuse_nats - gaps.excess()
    if margin < 0:
        return Verdict(False, f"the committed log-probabilities lie {gaps.gap_nats:.3f} nats in all from the claimed model's over "
                              f"{gaps.tokens} tokens: past the allowance of {rule.allowance_nats_per_token} nats a token by "
                              f"{gaps.excess():.3f}, beyond the bound {rule.refuse_nats}", margin, gaps.tokens)  # fmt: skip
    return Verdict(True, f"the committed log-probabilities lie {gaps.gap_nats:.4f} nats in all from the claimed model's over "
                         f"{gaps.tokens} tokens", margin, gaps.tokens)  # fmt: skip
