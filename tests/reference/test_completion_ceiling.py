"""The tracker's completion ceiling from the bytes it forwarded (docs/protocol.md §11, T13), on streams
shaped as llama-server sends them; through a real llama-server in tests/mesh/test_honest_ceiling.py."""

from __future__ import annotations

import json
from typing import Any

from meshnet_gguf.reference.tracker.metering import (
    COMPLETION_SLACK_TOKENS,
    REASONING_MARKUP_TOKENS,
    RESPONSE_FORMAT_STRIPPED_TOKENS,
    ForwardMeter,
)

ROUTE_CAP = 4096


def _stream(*deltas: dict[str, Any]) -> bytes:
    events = [{"choices": [{"delta": d, "index": 0}]} for d in deltas]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _ceiling(raw: bytes, request: dict[str, Any] | None = None) -> int:
    meter = ForwardMeter(True, request or {})
    for i in range(0, len(raw), 7):  # split anywhere, as the network does
        meter.feed(raw[i : i + 7])
    return meter.completion_ceiling(ROUTE_CAP)


def test_tokens_held_back_and_sent_in_one_event_stay_under_the_ceiling() -> None:
    # As seen with real clients: 14 tokens in 8 events (a grammar's whitespace held back, then sent at once), plus the end token.
    raw = _stream(*({"content": c} for c in ["{", "\n        ", '"', "a", '":', " ", "1", "}"]))
    assert _ceiling(raw) >= 14 + 1
    # A character split over 4 byte tokens arrives in one event: 4 tokens, 4 bytes.
    assert _ceiling(_stream({"content": "🪿"})) >= 4 + 1


def test_the_slack_grows_only_with_what_the_client_asked_or_the_answer_showed() -> None:
    hi = _stream({"content": "hi"})
    assert _ceiling(hi) == 2 + COMPLETION_SLACK_TOKENS
    # A stop string is cut from the text: one token per byte of the longest, per choice.
    assert _ceiling(hi, {"stop": ["\n", "<|im_end|>"], "n": 2}) == 2 + 2 * (COMPLETION_SLACK_TOKENS + len("<|im_end|>"))
    assert _ceiling(hi, {"response_format": {"type": "json_schema"}}) == 2 + COMPLETION_SLACK_TOKENS + RESPONSE_FORMAT_STRIPPED_TOKENS
    thought = _stream({"reasoning_content": "so"}, {"content": "hi"})
    assert _ceiling(thought) == 4 + COMPLETION_SLACK_TOKENS + REASONING_MARKUP_TOKENS


def test_a_lying_node_gains_nothing_from_the_bytes_bound() -> None:
    # "hi" and a claim of 4,096: the ceiling is the 2 bytes plus the slack, never the route's cap.
    assert _ceiling(_stream({"content": "hi"})) == 2 + COMPLETION_SLACK_TOKENS < ROUTE_CAP
    # Tool calls count every string the client got (id, type, name, arguments), as a whole answer does.
    call = {"tool_calls": [{"index": 0, "id": "c" * 32, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert _ceiling(_stream(call)) == 1 + 32 + len("function") + 1 + 2 + COMPLETION_SLACK_TOKENS
