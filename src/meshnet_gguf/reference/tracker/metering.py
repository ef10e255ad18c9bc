"""The tracker's own count of a request's tokens, from what it forwarded and the request it received.

Nothing the node says about its usage counts here: not the `usage` object, not
the `: meshnet-usage` comment, not the `X-Meshnet-Usage-*` headers. A node that
lies there would otherwise be compared with itself. Instead (docs/protocol.md,
section 11, T13):

- completion tokens are bounded by what went by: one per byte of generated text
  (content, reasoning, tool calls), streamed or in a whole answer, plus the
  per-choice slack of `completion_slack`, and never more than the route allowed.
  Bytes, not content events: llama-server holds back text (an incomplete UTF-8
  character, whitespace a grammar or parser has not settled) and sends several
  tokens in one event, so counting events flagged honest nodes. A
  token that reaches the answer's text adds at least one byte to it; the tokens
  that add none are bounded by the slack (see `completion_slack`);
- prompt tokens are bounded by the request: `PROMPT_BASE_ALLOWANCE_TOKENS`, plus
  `PROMPT_PER_MESSAGE_ALLOWANCE_TOKENS` per message (or input), plus one per
  byte of the request's text (a token id in a pre-tokenized prompt counts one).

These are ceilings: the bill is the node's signed receipt, capped by them.

A node chooses what it sends, so the copy is bounded: an event longer than
`MAX_METERED_EVENT_BYTES` ends the metering of that stream (the bytes are still
forwarded, and the completion ceiling falls back to the route's), and the
event search never rescans bytes it has already searched.
"""

from __future__ import annotations

import json
import re
from typing import Any

# The tracker's prompt bound lives in the contract, shared with the node's speed probe; read here as before.
from meshnet_gguf.contract.prompt_ceiling import PROMPT_BASE_ALLOWANCE_TOKENS as PROMPT_BASE_ALLOWANCE_TOKENS
from meshnet_gguf.contract.prompt_ceiling import PROMPT_PER_MESSAGE_ALLOWANCE_TOKENS as PROMPT_PER_MESSAGE_ALLOWANCE_TOKENS
from meshnet_gguf.contract.prompt_ceiling import prompt_ceiling as prompt_ceiling
from meshnet_gguf.contract.prompt_ceiling import text_size
from meshnet_gguf.contract.protocol import UsageCounts
from meshnet_gguf.contract.sse import DONE_DATA, event_data, is_comment

# One SSE event of llama-server is a token chunk or the usage chunk, well under 4 KiB; a tool
# call's arguments may be longer. A node sending more without a blank line is not metered further.
MAX_METERED_EVENT_BYTES = 256 * 1024
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
# The longest event terminator less one: a terminator split across two chunks is still found.
_TERMINATOR_OVERLAP = 3


class BoundedEventSplitter:
    """Complete raw SSE events out of a byte stream, with a bounded buffer and linear work.

    Returns None once the unterminated tail exceeds `max_event_bytes`: the stream is
    then no longer split (the caller stops metering it).
    """

    def __init__(self, max_event_bytes: int = MAX_METERED_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._buffer = bytearray()
        self._searched = 0
        self.overflowed = False

    def feed(self, chunk: bytes) -> list[bytes] | None:
        if self.overflowed:
            return None
        self._buffer += chunk
        events: list[bytes] = []
        start = 0
        search_from = max(0, self._searched - _TERMINATOR_OVERLAP)
        while (match := _EVENT_END.search(self._buffer, search_from)) is not None:
            events.append(bytes(self._buffer[start : match.end()]))
            start = search_from = match.end()
        del self._buffer[:start]
        self._searched = len(self._buffer)
        if len(self._buffer) > self._max:
            self.overflowed = True
            self._buffer.clear()
        return events


# A whole answer is read for its generated text only up to this size; past it, the route's cap bounds it.
MAX_METERED_BODY_BYTES = 16 * 1024 * 1024
# Tokens an honest node counts that add no byte to the text the client gets, per choice. llama-server counts
# every sampled token (`timings.predicted_n`); a token's text is its piece, never empty except:
# - the end-of-generation token (EOS, <end_of_turn>): a control token, rendered empty, sampled once at the end;
END_OF_GENERATION_TOKENS = 1
# - an incomplete UTF-8 character at a length cut: its bytes are held back and never sent; a UTF-8
#   character is at most 4 bytes, so at most 3 are held, and every token holding them added at least one.
INCOMPLETE_UTF8_TOKENS = 3
# Together, the slack every answer gets (docs/protocol.md §11, T13). Some requests and answers add more:
COMPLETION_SLACK_TOKENS = END_OF_GENERATION_TOKENS + INCOMPLETE_UTF8_TOKENS
# - the markers a reasoning parser strips (`<think>`, `</think>`, the line breaks it trims after them), where
#   the model writes them as text tokens: allowed only to a choice that carried reasoning text.
REASONING_MARKUP_TOKENS = 4
# - the whitespace (and a ```json fence) that llama-server's grammar lets a model write around a structured
#   answer (`response_format` json_schema / json_object) and its parser then strips from the content, one
#   token per byte at most. Its grammar (b10434, logged at -v) is
#     root ::= gen-prompt space space ("```json" space answer space "```" | space answer space)
#     space ::= | " " | "\n"{1,2} [ \t]{0,20}
#   so at most four `space`s (22 bytes each) and the fence's 10 bytes: measured, 9 leading and 9 trailing
#   whitespace tokens around `{...}` gave 45 tokens for 40 bytes (bench/RESULTS.md).
GRAMMAR_SPACE_MAX_BYTES = 22
RESPONSE_FORMAT_STRIPPED_TOKENS = 4 * GRAMMAR_SPACE_MAX_BYTES + len("```json") + len("```")
# A stop string the client asked for is cut from the text, and so is a partial match held back when a length
# cut ends the answer: every token in it added at least one of its bytes, so one token per byte of the
# longest stop string. (A tool call's markup is covered by its id, which llama-server makes up and sends:
# 32 bytes no token produced, counted with the call's name and arguments.)
# A node that lies is billed at most this slack above the bytes it sent: `completion_slack` sums it.


def completion_slack(request: dict[str, Any], *, reasoning: bool = False) -> int:
    """Tokens an honest node may count beyond the bytes of text it sent, for this request.

    Per choice: `COMPLETION_SLACK_TOKENS`, one per byte of the longest stop string the request names,
    `RESPONSE_FORMAT_STRIPPED_TOKENS` when it asks for structured output, and `REASONING_MARKUP_TOKENS`
    when the answer carried reasoning text. The request is the client's, so a node
    cannot widen it.
    """
    per_choice = COMPLETION_SLACK_TOKENS + _longest_stop_bytes(request.get("stop"))
    if _asks_structured_output(request):
        per_choice += RESPONSE_FORMAT_STRIPPED_TOKENS
    if reasoning:
        per_choice += REASONING_MARKUP_TOKENS
    return per_choice * requested_choices(request)


def requested_choices(request: dict[str, Any]) -> int:
    """How many choices the request asks for (`n`): each has its own end token and stop match."""
    n = request.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def _asks_structured_output(request: dict[str, Any]) -> bool:
    response_format = request.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    return kind in ("json_schema", "json_object") or isinstance(request.get("json_schema"), dict)


def _longest_stop_bytes(stop: Any) -> int:
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    return max((len(s.encode("utf-8", "surrogatepass")) for s in stops if isinstance(s, str)), default=0)


class ForwardMeter:
    """Counts what the tracker forwards: the bytes of generated text (and content events) of a stream, or the
    generated text of a whole answer. `request` is the client's request, for the slack it allows."""

    def __init__(self, event_stream: bool, request: dict[str, Any] | None = None) -> None:
        self.event_stream = event_stream
        self._splitter = BoundedEventSplitter() if event_stream else None
        self._request = request or {}
        self.content_events = 0
        # UTF-8 bytes of the text the stream's deltas carried: content, reasoning, tool calls, completion text.
        self.generated_bytes = 0
        self._reasoning_seen = False
        self._body = bytearray()
        self._body_too_big = False
        self.done = False
        self.error = False

    def feed(self, chunk: bytes) -> None:
        if self._splitter is None:
            if len(self._body) + len(chunk) > MAX_METERED_BODY_BYTES:
                self._body_too_big = True
                self._body.clear()
            elif not self._body_too_big:
                self._body += chunk
            return
        for event in self._splitter.feed(chunk) or ():
            self._meter_event(event)

    def completion_ceiling(self, route_ceiling: int) -> int:
        """The most completion tokens what went by can hold, within the route's own ceiling."""
        if self._splitter is not None:
            if self._splitter.overflowed:
                return route_ceiling
            seen, reasoning = self.generated_bytes, self._reasoning_seen
        else:
            if self._body_too_big:
                return route_ceiling
            answer = _json(bytes(self._body))
            seen, reasoning = _generated_text_bytes(answer), _carries_reasoning(answer)
        return min(route_ceiling, seen + completion_slack(self._request, reasoning=reasoning))

    def counted(self) -> UsageCounts:
        """What the tracker itself counted: content events of a stream; it counts no prompt tokens."""
        return UsageCounts(prompt_tokens=None, completion_tokens=self.content_events if self.event_stream else None)

    def _meter_event(self, event: bytes) -> None:
        if is_comment(event):
            return
        data = event_data(event)
        if data is None:
            return
        if data == DONE_DATA:
            self.done = True
            return
        chunk = _json(data)
        if isinstance(chunk, dict):
            if "error" in chunk:
                self.error = True
            if _carries_a_token(chunk):
                self.content_events += 1
                self.generated_bytes += _delta_text_bytes(chunk)
                self._reasoning_seen = self._reasoning_seen or _carries_reasoning(chunk)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _generated_text_bytes(answer: Any) -> int:
    """Bytes of the text a whole answer generated: message content, reasoning, tool calls, completion text."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        return 0
    total = 0
    for choice in answer["choices"]:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        if isinstance(message, dict):
            total += text_size([message.get("content"), message.get("reasoning_content"), message.get("tool_calls")])
        total += text_size(choice.get("text"))
    return total


def _delta_text_bytes(chunk: dict[str, Any]) -> int:
    """Bytes of the text one stream chunk generated, counted as `_generated_text_bytes` counts a whole answer."""
    total = 0
    for choice in chunk["choices"]:  # a list: `_carries_a_token` checked it
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            total += text_size([delta.get("content"), delta.get("reasoning_content"), delta.get("tool_calls")])
        total += text_size(choice.get("text"))
    return total


def _carries_reasoning(answer: Any) -> bool:
    """Whether a chunk's deltas or a whole answer's messages hold reasoning text."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        return False
    for choice in answer["choices"]:
        if isinstance(choice, dict):
            for part in (choice.get("delta"), choice.get("message")):
                if isinstance(part, dict) and part.get("reasoning_content"):
                    return True
    return False


def _carries_a_token(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")):
            return True
        if choice.get("text"):
            return True
    return False
