"""The OpenAI paths of the mesh, written once: which a node serves and a tracker forwards, and what
each carries. The node's proxy (`serving`) and the reference tracker (`reference/tracker`) both read
this table, so a path added here is served and forwarded alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
MODELS_PATH = "/v1/models"
# `GET /v1/models/{id}` (the openai SDK's `models.retrieve`): the id may hold slashes (`owner/name:Q4_K_M`).
MODEL_PATH_PREFIX = MODELS_PATH + "/"

# The inference paths (POST, a JSON body naming its model), each with the field holding its input:
# the minimum llama-server needs.
INFERENCE_PATHS: Mapping[str, str] = MappingProxyType(
    {CHAT_COMPLETIONS_PATH: "messages", COMPLETIONS_PATH: "prompt", EMBEDDINGS_PATH: "input"}
)
# The inference paths that generate tokens: their answers may stream, and a route bounds their tokens.
GENERATING_PATHS = frozenset({CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH})

__all__ = [
    "CHAT_COMPLETIONS_PATH",
    "COMPLETIONS_PATH",
    "EMBEDDINGS_PATH",
    "GENERATING_PATHS",
    "INFERENCE_PATHS",
    "MODELS_PATH",
    "MODEL_PATH_PREFIX",
]
