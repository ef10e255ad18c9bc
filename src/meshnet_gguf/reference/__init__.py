"""The reference Meshnet services, the tracker and the relay, that prove the node's contract end to end.

They speak only the shared contract, never node internals, exactly as an outside implementation
would. Two packages, one service each, and neither imports the other: `tracker/` (its `__init__`
lists its modules by job) and `relay/`.

May import: common, contract.
"""
