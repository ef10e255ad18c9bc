"""The reference Meshnet services, the tracker and the relay, that prove the node's contract end to end.

They speak only the shared contract, never node internals, exactly as an outside
implementation would. The tracker is the package `tracker/`, split by job (its `__init__` lists
them); the relay keeps its tunnels and splice in `relay`, who may hold what in `relay_admission`
(keyed by source network, `relay_networks`; admitted nodes remembered in `relay_admitted`),
who is who in `relay_proofs`, and frames its messages with the contract's `relay_framing`.

May import: common, contract.
"""
