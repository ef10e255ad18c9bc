"""The tracker's `Auditor` alone, without a tracker around it: a registry of stand-in nodes that only carry
`proof_blocked`, and an auditor on a real ledger whose verdicts a test applies itself (`Auditor._apply`)."""

from __future__ import annotations

from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.reference.tracker.audits import Auditor, AuditPolicy
from meshnet_gguf.reference.tracker.ledger import TrackerLedger


class NodeStandIn:
    """What a verdict changes on a registered node: whether it is still routed."""

    proof_blocked = False


class RegistryStandIn:
    """The registry as `Auditor._apply` reads it: the nodes a test registered, by id."""

    def __init__(self, *node_ids: str) -> None:
        self.entries: dict[str, Any] = {node_id: NodeStandIn() for node_id in node_ids}

    def get(self, node_id: str) -> Any:
        return self.entries.get(node_id)


def auditor_on(ledger: TrackerLedger, registry: RegistryStandIn, model: str = "m") -> Auditor:
    """An auditor for `model` (its verifier never asked) on `ledger`, applying verdicts to `registry`'s nodes."""
    auditor = Auditor({model: "http://127.0.0.1:9"}, AuditPolicy(), Ed25519PrivateKey.generate(), "tracker", ledger, None, None)
    auditor.registry = registry
    return auditor
