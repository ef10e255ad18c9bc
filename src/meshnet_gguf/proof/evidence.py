"""The node's side: an answer's evidence from what llama-server reports with `n_probs` (native
`/completion`: `completion_probabilities`; OpenAI routes with `logprobs`: `choices[0].logprobs.content`).
Both list, per generated token, its `id` and `top_logprobs` (`id`, `logprob`), the raw softmax before
any sampler when `post_sampling_probs` is off.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from meshnet_gguf.contract.model_proof import (
    EVIDENCE_BLOCK_TOKENS,
    EVIDENCE_TOP_K,
    AnswerEvidence,
    EvidenceBlock,
    quantize_logprob,
)


def evidence_from_token_probs(entries: Iterable[Mapping[str, Any]], top_k: int = EVIDENCE_TOP_K) -> AnswerEvidence:
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
