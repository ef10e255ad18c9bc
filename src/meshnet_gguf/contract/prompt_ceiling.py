"""The prompt ceiling (docs/protocol.md, section 11, T13): the most prompt tokens a request can hold, whatever
the tokenizer, from its bytes. The tracker bills and times prompts by it (`reference/tracker/metering`,
`reference/tracker/node_speed`); a node states its prefill speed in it (`llama/speed_probe`), so both read a prompt's
length alike.
"""

from __future__ import annotations

from typing import Any

# What a chat template adds around a prompt: BOS, a default system prompt, the generation prompt.
PROMPT_BASE_ALLOWANCE_TOKENS = 128
# Role markers and separators a template puts around each message (or each embeddings input).
PROMPT_PER_MESSAGE_ALLOWANCE_TOKENS = 16
# The request fields a prompt is made of; every string leaf counts its bytes, every number one token.
_PROMPT_FIELDS = ("messages", "prompt", "input", "tools", "functions", "system")
# Bounds the walk over a request's JSON (it is already depth-limited by the parser).
_MAX_WALK_ITEMS = 1_000_000


def prompt_ceiling(payload: dict[str, Any]) -> int:
    """The most prompt tokens the request can hold, whatever the tokenizer."""
    pieces = 0
    for field in ("messages", "input", "prompt"):
        value = payload.get(field)
        if isinstance(value, list):
            pieces += len(value)
        elif value is not None:
            pieces += 1
    return (
        PROMPT_BASE_ALLOWANCE_TOKENS
        + PROMPT_PER_MESSAGE_ALLOWANCE_TOKENS * pieces
        + sum(text_size(payload[f]) for f in _PROMPT_FIELDS if f in payload)
    )


def text_size(value: Any) -> int:
    """The bytes of every string in `value` (walked through lists and dicts), one per number."""
    size, stack, seen = 0, [value], 0
    while stack and seen < _MAX_WALK_ITEMS:
        item = stack.pop()
        seen += 1
        if isinstance(item, str):
            size += len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, (int, float)):
            size += 1
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return size


__all__ = ["PROMPT_BASE_ALLOWANCE_TOKENS", "PROMPT_PER_MESSAGE_ALLOWANCE_TOKENS", "prompt_ceiling", "text_size"]
