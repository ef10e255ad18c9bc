"""llama-server's error hints said in the node's words where they name a flag only the node's operator can give.

llama-server answers an embeddings request it was not started for with "Start it
with `--embeddings`": true of llama-server, useless to a client of the node (it
cannot start anything) and wrong for the operator (the node's flag is
`--llama-arg=--embeddings`). Only that one body is rewritten; every other error
passes through as llama-server wrote it.
"""

from __future__ import annotations

import json

from meshnet_gguf.contract.errors import openai_error_body
from meshnet_gguf.contract.openai_paths import EMBEDDINGS_PATH

# llama-server's status for a route its flags turned off (501 Not Implemented, "not_supported_error").
NOT_SUPPORTED_STATUS = 501
LLAMA_EMBEDDINGS_FLAG = "--embeddings"
NODE_EMBEDDINGS_HINT = (
    "this node does not serve embeddings: its llama-server runs without --embeddings. "
    "The node's operator turns them on with `meshnet-gguf serve --llama-arg=--embeddings` and an embedding model "
    "(llama-server then serves embeddings only)"
)


def node_hint(path: str, status: int, body: bytes) -> bytes | None:
    """The node's own error body in place of llama-server's `body`, or None to pass `body` on unchanged."""
    if path != EMBEDDINGS_PATH or status != NOT_SUPPORTED_STATUS:
        return None
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(message, str) or LLAMA_EMBEDDINGS_FLAG not in message:
        return None
    return openai_error_body(NODE_EMBEDDINGS_HINT, "not_supported_error", NOT_SUPPORTED_STATUS)
