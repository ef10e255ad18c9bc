"""The reference Meshnet tracker, by job: it registers nodes, routes each OpenAI request to one
whole-model node with a signed single-hop route, forwards the answer unbuffered, and keeps its own
usage ledger. It speaks only the contract in `docs/protocol.md`; it knows nothing of how a node
works inside. Run it with `meshnet-gguf dev tracker`.

- `app`: `Tracker` (the composition root: every part built in order), its routes and lifespan, the
  node watch and health polls; `create_app`.
- `config`: `TrackerConfig` and its defaults.
- `enrolment`: register, prove control, heartbeat, deregister; the enrolment secret.
- `receipts`: a node's signed receipts checked against the route, billed, mismatches flagged; usage.
- `routing`: what the tracker signs (routes, CONNECT tokens) and the route's token ceiling.
- `forwarding`: the inference endpoint: pick a node, record, send, pump the answer, settle.
- `reach`: the clients that reach nodes while the app runs.
- `node_calls`: a node's signed calls checked, each token once.
- `request_io`: bounded bodies and headers, parsing, JSON answers.

Each name lives in one of these modules and is imported from there.
"""
