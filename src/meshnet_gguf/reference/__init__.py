"""Reference Meshnet services (tracker; relay to come) that prove the node's contract end to end.

They import only the shared wire contract (`meshnet_gguf.protocol`) and the
floor-1 helpers (`signing`, `sse`, `errors`), never node internals, exactly as
an outside implementation would.
"""
