"""The reference Meshnet relay: it reaches nodes behind NAT for the tracker. Run it with `meshnet-gguf dev relay`.

- `server`: the relay's tunnels (a node's attach) and the splice of a CONNECT into one; `create_app`.
- `admission`: who may hold what, keyed by source network (`networks`); admitted nodes remembered in `admitted`.
- `proofs`: who is who (a node's attach proof, the tracker's CONNECT tokens).
- `config`: `RelayConfig` and its defaults.

It frames its messages with the contract's `relay_framing`. Each name lives in one of these modules and
is imported from there.
"""
