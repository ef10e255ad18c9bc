"""The node: the composition root, where every part a running node has is built in one place and run together.

`prepare/pipeline.prepare_launch()` has decided everything that can fail before a port opens, and
`node_keys()` has settled the node's key and the tracker key it trusts (the first-contact check),
once per run. `build_node()` then builds the parts, one builder call per wing, and `Node.run()` runs
them in one task group until a signal, drains, closes them in order and returns the exit code.

- `root`: `build_node`, and the parts of the node itself (state dir lock, model files held,
  systemd, llama-server's supervisor, metrics).
- `listener`: the node's one listener, its app chain and the routes handed to the proxy.
- `mesh`: the node's keys (`node_keys`; `node_key` and `existing_node_key`, the one reader of the
  key file), the tracker link and the relay links.
- `pool`: the LAN pool's monitor and `pool_status_tokens`, the token every reader of a worker's
  status port sends (serve, doctor, models).
- `run`: `Node`, the run loop: start, drain, close in order.

May import: common, contract, models, llama, hardware, prepare, serving, mesh, ops, proof.
"""

from __future__ import annotations

from meshnet_gguf.node.listener import build_proxy
from meshnet_gguf.node.mesh import NodeKeys, build_tracker_link, existing_node_key, node_key, node_keys, trust_tracker
from meshnet_gguf.node.pool import pool_status_tokens
from meshnet_gguf.node.root import build_node
from meshnet_gguf.node.run import Node

__all__ = [
    "Node",
    "NodeKeys",
    "build_node",
    "build_proxy",
    "build_tracker_link",
    "existing_node_key",
    "node_key",
    "node_keys",
    "pool_status_tokens",
    "trust_tracker",
]
