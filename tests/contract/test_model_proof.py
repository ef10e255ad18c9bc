"""The evidence's wire form: its commitment binds every id and value, and its shape is checked."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from meshnet_gguf.contract.model_proof import (
    EVIDENCE_BLOCK_TOKENS,
    AnswerEvidence,
    EvidenceBlock,
    dequantize_logprob,
    quantize_logprob,
)


def _evidence(n: int) -> AnswerEvidence:
    blocks = []
    for start in range(0, n, EVIDENCE_BLOCK_TOKENS):
        tokens = list(range(start, min(n, start + EVIDENCE_BLOCK_TOKENS)))
        blocks.append(EvidenceBlock(tokens=tokens, top_ids=[[t, t + 1] for t in tokens], top_q=[[10, 900] for _ in tokens]))
    return AnswerEvidence(blocks=blocks)


def test_the_commitment_changes_with_any_id_or_value_and_survives_the_wire() -> None:
    evidence = _evidence(70)
    commitment = evidence.commitment()
    assert commitment.tokens == 70
    assert AnswerEvidence.model_validate_json(evidence.model_dump_json()).commitment() == commitment
    for change in ("tokens", "top_ids", "top_q"):
        altered = evidence.model_copy(deep=True)
        block = altered.blocks[2]
        if change == "tokens":
            block.tokens[1] += 1
        else:
            getattr(block, change)[1][1] += 1
        assert altered.commitment() != commitment, change


def test_malformed_evidence_is_refused() -> None:
    with pytest.raises(ValidationError):
        EvidenceBlock(tokens=[1, 2], top_ids=[[1]], top_q=[[1]])  # one entry short
    with pytest.raises(ValidationError):
        EvidenceBlock(tokens=[1], top_ids=[[1, 2, 3, 4, 5]], top_q=[[1, 1, 1, 1, 1]])  # more than the top-k
    with pytest.raises(ValidationError):
        EvidenceBlock(tokens=[1], top_ids=[[1]], top_q=[[70000]])  # not 16 bits
    short = EvidenceBlock(tokens=[1], top_ids=[[1]], top_q=[[1]])
    with pytest.raises(ValidationError):
        AnswerEvidence(blocks=[short, short])  # only the last block may be short


def test_logprobs_round_trip_within_half_a_step() -> None:
    for lp in (0.0, -0.001, -1.2345, -30.0):
        assert abs(dequantize_logprob(quantize_logprob(lp)) - lp) <= 1 / 1024 + 1e-12
    assert quantize_logprob(-1e9) == 0xFFFF and quantize_logprob(0.5) == 0
