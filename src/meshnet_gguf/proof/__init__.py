"""Proof of model: whether an answer came from the weights a node claims. The node's evidence of an
answer (`evidence`: per token, the top-k log-probabilities llama-server reported), the verifier's own
scores of the answer from a llama-server it trusts running the claimed model (`scoring`), the pure
checks that turn both into a verdict with its reason and margin (`check`), the whole-answer figures
of a greedy answer and their verdict (`drift`: a cheaper quant of the claimed weights), their tolerances as
measured (`tolerance`), and one audit from end to end (`audit`: the wire's `AuditRequest` in, an
`AuditVerdict` out). The wire format itself is `contract/model_proof`, so a tracker needs only the
contract to ask for an audit.

May import: common, contract.
"""
