"""The shared contract: the wire models of docs/protocol.md, Ed25519 signing and JWTs, the node's
key-bound TLS, SSE framing, the relay's framing (`relay_framing`: its HTTP heads and one-line JSON messages,
for the relay, the node and the tracker), OpenAI error bodies, the bearer header, and the shape every part of a
node has (`NodePart`).
The reference tracker and relay speak only this.

May import: common.
"""
