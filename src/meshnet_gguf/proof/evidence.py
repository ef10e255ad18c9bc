"""The node's side: an answer's evidence from what llama-server reports with `n_probs`. The builder is the contract's
(`contract.model_proof.evidence_from_token_probs`), since a tracker that captures the values builds it too."""

from __future__ import annotations

from meshnet_gguf.contract.model_proof import evidence_from_token_probs

__all__ = ["evidence_from_token_probs"]
