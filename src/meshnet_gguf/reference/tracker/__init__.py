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
- `registry`: the nodes registered, their health and load; `market`: the fair share among equal nodes;
  `node_speed`: a node's speed claim and the tracker's measurements of it.
- `metering`: the tracker's own count of a request's tokens, from what it forwarded and the request.
- `ledger`: the tracker's SQLite ledger (routes, usage, audits); `page`: the tracker's page and `pages/`.
- `node_address`, `node_clients`: how a node is reached, and the clients that reach it; `relay_dialer` and
  `relay_failover`: the tracker's way to a node through a relay.

Each name lives in one of these modules and is imported from there.
"""
