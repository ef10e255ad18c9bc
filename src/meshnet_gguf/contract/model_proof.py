"""Proof of model on the wire: the evidence a node keeps for an answer, the commitment to it that its
receipt carries, and the audit a tracker asks of a verifier it trusts. No I/O here.

Evidence is, per generated token, its id and the claimed model's top-k next-token log-probabilities
at that position (ids, and values quantized to `LOGPROB_STEP` nats), in blocks of
`EVIDENCE_BLOCK_TOKENS` tokens. The commitment is a sha256 chained over the blocks' canonical bytes,
so a node that signed it cannot later hand over other evidence, and a receipt grows by 64 hex
characters and a count whatever the answer's length. A verifier recomputes the same top-k with the
claimed weights (`proof/`) and compares.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Literal

from pydantic import Field, model_validator

from meshnet_gguf.contract.protocol import WireModel

EVIDENCE_VERSION = "1"
# TOPLOC's block size: a verifier can check any block alone, and a digest per block bounds the work
# of finding where an evidence went wrong.
EVIDENCE_BLOCK_TOKENS = 32
# Top-k per token the node records. 4 is what bench/bench_model_proof.py needs to tell a requantized
# model apart by its values; more only grows the evidence (6 bytes per entry).
EVIDENCE_TOP_K = 4
# Log-probabilities are stored as round(-logprob / STEP) in 16 bits: 1/512 nat is ~10x finer than the
# smallest difference the bench measured between the same weights on two backends, and 16 bits
# reach 128 nats, far below any token a model would emit.
LOGPROB_STEP = 1.0 / 512
_MAX_Q = 0xFFFF
_DOMAIN = b"meshnet-evidence-v" + EVIDENCE_VERSION.encode()


def quantize_logprob(logprob: float) -> int:
    return max(0, min(_MAX_Q, round(-logprob / LOGPROB_STEP)))


def dequantize_logprob(q: int) -> float:
    return -q * LOGPROB_STEP


class EvidenceBlock(WireModel):
    """Up to `EVIDENCE_BLOCK_TOKENS` consecutive answer tokens and, for each, the top-k the node's
    model gave at that position: `top_ids[i]` best first, `top_q[i]` their quantized log-probabilities."""

    tokens: list[int] = Field(max_length=EVIDENCE_BLOCK_TOKENS)
    top_ids: list[list[int]]
    top_q: list[list[int]]

    @model_validator(mode="after")
    def _shapes(self) -> EvidenceBlock:
        if not (len(self.tokens) == len(self.top_ids) == len(self.top_q)):
            raise ValueError("tokens, top_ids and top_q must have one entry per token")
        for ids, qs in zip(self.top_ids, self.top_q):
            if len(ids) != len(qs) or not 0 < len(ids) <= EVIDENCE_TOP_K:
                raise ValueError(f"each position carries 1 to {EVIDENCE_TOP_K} (id, value) pairs")
            if any(not 0 <= q <= _MAX_Q for q in qs) or any(t < 0 for t in ids):
                raise ValueError("ids are non-negative and values 16-bit")
        return self

    def canonical_bytes(self) -> bytes:
        out = bytearray(struct.pack("<H", len(self.tokens)))
        for token, ids, qs in zip(self.tokens, self.top_ids, self.top_q):
            out += struct.pack("<IB", token, len(ids))
            for tid, q in zip(ids, qs):
                out += struct.pack("<IH", tid, q)
        return bytes(out)


class EvidenceCommitment(WireModel):
    """What a receipt carries: the chained digest and how many tokens it covers."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tokens: int = Field(ge=0)


class AnswerEvidence(WireModel):
    """The whole evidence of one answer, handed to an auditor on request."""

    version: Literal["1"] = EVIDENCE_VERSION
    blocks: list[EvidenceBlock]

    @model_validator(mode="after")
    def _full_blocks(self) -> AnswerEvidence:
        if any(len(b.tokens) != EVIDENCE_BLOCK_TOKENS for b in self.blocks[:-1]):
            raise ValueError(f"every block but the last holds {EVIDENCE_BLOCK_TOKENS} tokens")
        return self

    @property
    def tokens(self) -> list[int]:
        return [t for b in self.blocks for t in b.tokens]

    def commitment(self) -> EvidenceCommitment:
        digest = hashlib.sha256(_DOMAIN).digest()
        for block in self.blocks:
            digest = hashlib.sha256(digest + block.canonical_bytes()).digest()
        return EvidenceCommitment(sha256=digest.hex(), tokens=len(self.tokens))


AuditOutcome = Literal["passed", "failed", "no_verdict"]


class AuditRequest(WireModel):
    """Tracker -> verifier: check that `answer_text` (what the tracker forwarded) to the request
    `body` sent to `path` came from `model`, with the node's evidence if it kept one."""

    audit_id: str
    model: str
    path: str
    body: str = Field(description="the request body exactly as routed (UTF-8 JSON)")
    answer_text: str
    temperature: float = Field(0.0, ge=0.0, description="the request's; 0 means a greedy answer")
    commitment: EvidenceCommitment | None = None
    evidence: AnswerEvidence | None = None


class AuditVerdict(WireModel):
    """Verifier -> tracker. `no_verdict` (the verifier could not score) never counts against a node."""

    audit_id: str
    outcome: AuditOutcome
    reason: str
    # How far the answer stayed inside the tolerance (> 0, nats) or fell outside it (< 0).
    margin_nats: float
    positions_checked: int = Field(ge=0)


# Request fields that steer a sampler's pick beyond the model's own log-probabilities (a bias, a grammar, a schema,
# tool calls, a penalty on what came before). An answer made under them is not the claimed model's own continuation,
# and a verifier that re-generates from prompt + answer cannot apply them as the node did (a grammar or a penalty
# depends on the answer so far): such answers are not drawn for audit, and a verifier gives them no verdict.
STEERING_FIELDS = ("logit_bias", "grammar", "json_schema", "tools")
# Sampler settings that steer only away from their neutral value (llama-server's defaults).
NEUTRAL_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repeat_penalty": 1.0, "dry_multiplier": 0.0, "mirostat": 0}


def unscoreable(payload: dict[str, object]) -> str | None:
    """Why an answer to this request body cannot be audited by scoring it, or None when it can."""
    for name in STEERING_FIELDS:
        if payload.get(name):
            return f"the request's {name} steers the sampler"
    response_format = payload.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "the request's response_format constrains the answer"
    for name, neutral in NEUTRAL_PENALTIES.items():
        value = payload.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != neutral:
            return f"the request's {name} steers the sampler"
    return None


# Where a verifier takes audits, and the header carrying the tracker's signed token for one: claims
# `iss` (the tracker), `sub` = AUDIT_TOKEN_SUBJECT, `jti` (the audit id), `iat`, `exp` and
# `body_sha256` of the AuditRequest as sent, so a verifier spends its llama-server only on a tracker's asks.
AUDIT_PATH = "/v1/proof/audit"
AUDIT_TOKEN_HEADER = "X-Meshnet-Audit"
AUDIT_TOKEN_SUBJECT = "audit"
