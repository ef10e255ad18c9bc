"""The shared contract: the wire models of docs/protocol.md, Ed25519 signing and JWTs, the node's
key-bound TLS, SSE framing, OpenAI error bodies, the bearer header, and the shape every part of a node has (`NodePart`).
The reference tracker and relay speak only this.

May import: common.
"""
