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
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

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


def evidence_from_token_probs(entries: Iterable[Mapping[str, Any]], top_k: int = EVIDENCE_TOP_K) -> AnswerEvidence:
    """An answer's evidence from what llama-server reports with `n_probs` (native `/completion`:
    `completion_probabilities`; OpenAI routes with `logprobs`: `choices[0].logprobs.content`). Both list, per generated
    token, its `id` and `top_logprobs` (`id`, `logprob`), the raw softmax before any sampler when `post_sampling_probs`
    is off."""
    blocks: list[EvidenceBlock] = []
    tokens: list[int] = []
    ids: list[list[int]] = []
    qs: list[list[int]] = []
    for entry in entries:
        top = list(entry["top_logprobs"])[:top_k]
        tokens.append(int(entry["id"]))
        ids.append([int(t["id"]) for t in top])
        qs.append([quantize_logprob(float(t["logprob"])) for t in top])
        if len(tokens) == EVIDENCE_BLOCK_TOKENS:
            blocks.append(EvidenceBlock(tokens=tokens, top_ids=ids, top_q=qs))
            tokens, ids, qs = [], [], []
    if tokens:
        blocks.append(EvidenceBlock(tokens=tokens, top_ids=ids, top_q=qs))
    return AnswerEvidence(blocks=blocks)


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
    # The whole-answer statistic (`proof.drift`) of a greedy answer it judged: the sum of its tokens' gaps below the
    # claimed model's best, each capped at DRIFT_GAP_CAP_NATS, over `drift_tokens` tokens. 0 tokens: not judged by it
    # (sampled, too short): such a verdict adds nothing to the node's CUSUM (`NodeDrift`).
    drift_gap_nats: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    drift_tokens: int = Field(0, ge=0)
    # The same from the evidence's values (`proof.values`, greedy and sampled answers alike): the sum of its tokens'
    # value gaps, each capped at VALUE_GAP_CAP_NATS, over `value_tokens` tokens. 0 tokens: no evidence, or too short.
    value_gap_nats: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    value_tokens: int = Field(0, ge=0)
    # Whose allowance they get: the claimed file's weights, as the verifier's own llama-server reports them.
    value_weights: ValueWeights = "quantized"


# --- The whole-answer and node-level verdict (proof of quant: a cheaper quant of the claimed weights) ---
# A tracker judges a node's judged audits in a row by a one-sided CUSUM on the per-token gap (`NodeDrift`), so the
# rule and its bounds are the protocol's: here, beside the verdict that carries the figures (a tracker needs only the
# contract). `proof.drift` computes an answer's figures; bench/RESULTS.md ("Proof of quant") has the measurements.
#
# Each token's gap counts at most this much (= proof.tolerance.GREEDY_TIE_NATS, held equal by tests/proof): one past
# it is the per-token check's refusal, and one token must not carry a whole answer's drift.
DRIFT_GAP_CAP_NATS = 2.0
# The allowance per judged token (nats). Measured (bench/RESULTS.md, "Proof of quant"; greedy answers against a CPU
# verifier): the claimed file on another thread count and batch on the CPU 0 exactly; on lavapipe Vulkan the tiny
# model 0.00001 a token, the demo's Q8_0 0.0038 (9 near-ties in 240 tokens); on an H100's CUDA build the demo's
# Q4_K_M 0.0070 a token (292 near-ties in 6,400 tokens, up to 1.25 nats each), 0.031 in its worst answer of 40
# tokens. 0.025 is 3.6x CUDA's honest mean: an honest node's S steps up where one answer holds a large near-tie and
# falls back at 0.018 nats a token. It was 0.01 until CUDA was measured (a bound set from lavapipe alone). Cheaper
# quants whose mean gap is above it are caught (the demo's Q3_K_M and Q2_K served as its Q4_K_M, 0.164 and 0.268 a
# token; its Q5_K_M as its F16, 0.035; the tiny model's Q4_0 as its F16, 0.031); one whose rounding moves the answers
# less than an honest CUDA node's does (the demo's Q8_0, Q6_K, Q4_K_M as its F16: 0.0024-0.0057) cannot be told from
# one, and is not refused.
DRIFT_ALLOWANCE_NATS_PER_TOKEN = 0.025
# A node is refused when its S passes this (nats). Set by a bootstrap of the widest honest spread (the demo's Q4_K_M on
# CUDA: its 6,400 measured tokens drawn token by token into 32-token answers, 20,000 nodes x 1,000 audits in a row
# each): S passed 2.0 for 0.7 % of them, 3.0 for 0.015 %, 4.0 for none (bench/bench_model_proof.py --honest-table on
# bench/gpu/results/claims_proof_h100_cuda/whole/honest_cuda.jsonl). It was 2.0 with the 0.01 allowance, where the
# same CUDA answers passed 2.0 for 2.7 % of nodes. A quant whose answers drift 0.01 nats a token past the allowance
# needs ~13 audited answers of 32 tokens to pass it.
DRIFT_REFUSE_NATS = 4.0
# An answer with fewer judged tokens adds nothing to S and gets no whole-answer verdict (the per-token check still
# judges it): below it one near-tie is the whole answer.
DRIFT_MIN_TOKENS = 8

# --- The same from the values a node's evidence committed (protocol 12 rule 11) ---
# A node's evidence carries, per answer token, its top-k log-probabilities (what its llama-server reported before any
# sampler). A cheaper quant of the claimed weights moves them on nearly every token; another backend running the
# claimed file moves them less (bench/RESULTS.md, "Proof of quant from the committed values"). Per token the figure is
# how far the committed top-1's log-probability lies from the claimed model's value for that token (`proof.values`),
# each capped here (one token must not carry a whole answer's drift).
VALUE_GAP_CAP_NATS = 1.0
# How far the same file moves on another backend depends on how its weights are stored: a quantized matrix is
# multiplied with the activations quantized too (q8_1 on a GPU, q8_0 or q8_K on the CPU), each backend its own way,
# while float weights meet float activations everywhere. So the verifier says what its claimed file holds
# (`AuditVerdict.value_weights`, from llama-server's `ftype`), and each kind has its allowance per judged token (nats),
# set from its measured honest spread (bench/RESULTS.md, "Proof of quant from the committed values": the demo
# gemma-3-270m, 32-token greedy answers, a CPU verifier; per-token means over each pair's answers):
# - float weights (its F16): honest 0.0012 on an H100's CUDA, 0.0006 on its Vulkan, 0.0012 on lavapipe; its Q8_0,
#   Q6_K, Q4_K_M served as the F16 0.035-0.058 (the tiny model's Q5_0 0.026; its Q8_0, 0.005, is not told apart);
# - Q8_0: honest 0.033 on the H100's CUDA (its worst answer 0.067), 0.027 on its Vulkan, 0.034 on lavapipe; its
#   Q4_K_M served as the Q8_0 0.066 on CUDA and 0.059 on the CPU, its Q6_K 0.054 on the CPU;
# - other quantized files: the demo's own Q4_K_M honest 0.073 on the H100's CUDA (its worst answer 0.113) and 0.045 on
#   its Vulkan, so a near quant of a claimed Q4_K_M cannot be told apart by its values; 0.15 (2x CUDA's honest mean)
#   keeps such claims from ever refusing an honest node, and the greedy tokens still catch the far quants (Q3_K_M and
#   Q2_K served as the Q4_K_M: rule 9). Types not measured get this widest one.
VALUE_ALLOWANCE_FLOAT_NATS_PER_TOKEN = 0.01
VALUE_ALLOWANCE_Q8_0_NATS_PER_TOKEN = 0.05
VALUE_ALLOWANCE_QUANTIZED_NATS_PER_TOKEN = 0.15
# A node is refused when its CUSUM over the values passes this (nats). A bootstrap of the honest answers above
# (2,000 nodes x 1,000 audits in a row each, answers drawn whole): the highest CUSUM any reached was 1.61 (Q8_0 on
# CUDA), 0 for every other honest pair; the Q8_0's Q4_K_M served on CUDA passes it within 10 audited answers 80 % of
# the time, within 50 always (bench_quant_evidence.py --detection).
VALUE_REFUSE_NATS = 4.0
# An answer with fewer judged tokens adds nothing (one token's value is noise, not a drift).
VALUE_MIN_TOKENS = 8
# llama-server's `ftype` names of files whose matrices are stored as floats.
FLOAT_FTYPES = frozenset({"all F32", "F32", "F16", "BF16"})
ValueWeights = Literal["float", "q8_0", "quantized"]


@dataclass(frozen=True)
class DriftRule:
    """One whole-answer statistic's bounds: each token counts at most `cap_nats`, an answer adds its sum less
    `allowance_nats_per_token` x its tokens to a node's CUSUM, which refuses past `refuse_nats`; an answer of fewer than
    `min_tokens` judged tokens adds nothing."""

    name: str
    cap_nats: float
    allowance_nats_per_token: float
    refuse_nats: float
    min_tokens: int


# Which tokens a greedy answer picked (`AuditVerdict.drift_*`, protocol 12 rule 9).
TOKEN_DRIFT = DriftRule("token", DRIFT_GAP_CAP_NATS, DRIFT_ALLOWANCE_NATS_PER_TOKEN, DRIFT_REFUSE_NATS, DRIFT_MIN_TOKENS)
# The values the node's evidence committed (`AuditVerdict.value_*`, protocol 12 rule 11), by the claimed file's weights.
VALUE_DRIFTS: dict[str, DriftRule] = {
    "float": DriftRule("value", VALUE_GAP_CAP_NATS, VALUE_ALLOWANCE_FLOAT_NATS_PER_TOKEN, VALUE_REFUSE_NATS, VALUE_MIN_TOKENS),
    "q8_0": DriftRule("value", VALUE_GAP_CAP_NATS, VALUE_ALLOWANCE_Q8_0_NATS_PER_TOKEN, VALUE_REFUSE_NATS, VALUE_MIN_TOKENS),
    "quantized": DriftRule("value", VALUE_GAP_CAP_NATS, VALUE_ALLOWANCE_QUANTIZED_NATS_PER_TOKEN, VALUE_REFUSE_NATS, VALUE_MIN_TOKENS),
}
VALUE_DRIFT = VALUE_DRIFTS["quantized"]  # a node's values CUSUM: its bound (the same for every kind)


def value_weights(ftype: str | None) -> ValueWeights:
    """Which allowance a claimed file's values get, from llama-server's `ftype` (unknown: the wider, quantized one)."""
    return "float" if ftype in FLOAT_FTYPES else "q8_0" if ftype == "Q8_0" else "quantized"


@dataclass(frozen=True)
class AnswerGaps:
    """What one answer adds to a statistic: the sum of its tokens' gaps (each capped at its rule's cap) over `tokens`
    judged tokens; `tie_broken`: a token past the cap, or the answer not scored to its end (the per-token check
    refuses it). `rule`: whose bounds (default: the greedy tokens' drift)."""

    gap_nats: float
    tokens: int
    tie_broken: bool = False
    rule: DriftRule = TOKEN_DRIFT

    @classmethod
    def of(cls, gaps: list[float] | tuple[float, ...], answer_tokens: int | None = None, rule: DriftRule = TOKEN_DRIFT) -> AnswerGaps:
        capped = [min(max(g, 0.0), rule.cap_nats) for g in gaps]
        broken = any(g > rule.cap_nats for g in gaps) or (answer_tokens is not None and len(gaps) < answer_tokens)
        return cls(sum(capped), len(capped), broken, rule)

    def excess(self) -> float:
        """The answer's step of the CUSUM: its gaps less the allowance over its tokens (nats)."""
        return self.gap_nats - self.rule.allowance_nats_per_token * self.tokens

    def judged(self) -> bool:
        return self.tokens >= self.rule.min_tokens

    def bounded(self, most_tokens: int) -> AnswerGaps | None:
        """These figures as a tracker may count them, or None when they cannot be: finite, not negative, the tokens
        at most `most_tokens` (what the audited answer's text can hold: a verdict claiming more tokens would buy
        allowance, and so lower a node's CUSUM, with tokens the answer never had), the gaps at most the cap a token."""
        if not math.isfinite(self.gap_nats) or self.gap_nats < 0 or self.tokens < 0:
            return None
        tokens = min(self.tokens, max(most_tokens, 0))
        return AnswerGaps(min(self.gap_nats, self.rule.cap_nats * tokens), tokens, self.tie_broken, self.rule)


def answer_refused(gaps: AnswerGaps) -> bool:
    """One answer alone: a token past the tie, or its drift alone past the bound (the CUSUM's first step)."""
    return gaps.tie_broken or (gaps.judged() and gaps.excess() > gaps.rule.refuse_nats)


@dataclass
class NodeDrift:
    """A node's CUSUM over its judged audits in the order they were decided: S <- max(0, S + excess), refused past
    the rule's bound. `started_at`: the issue time of the first audited answer of the run S is in (0 when S is 0),
    so a refusal flags the answers since the drift began."""

    s: float = 0.0
    answers: int = 0
    started_at: float = 0.0
    rule: DriftRule = TOKEN_DRIFT

    def add(self, gaps: AnswerGaps, issued_at: float = 0.0) -> bool:
        """Count one judged answer's figures; whether the node is now past the bound. Unjudged figures change nothing."""
        if not gaps.judged():
            return self.refused()
        before = self.s
        self.s = max(0.0, self.s + gaps.excess())
        self.answers += 1
        if self.s == 0.0:
            self.started_at = 0.0
        elif before == 0.0:
            self.started_at = issued_at
        return self.refused()

    def refused(self) -> bool:
        return self.s > self.rule.refuse_nats


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
