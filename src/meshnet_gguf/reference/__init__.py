"""The reference Meshnet services, the tracker and the relay, that prove the node's contract end to end.

They speak only the shared contract, never node internals, exactly as an outside
implementation would.

May import: common, contract.
"""
