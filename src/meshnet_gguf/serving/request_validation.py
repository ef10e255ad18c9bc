"""Strict checks of a client's request body, before anything reaches llama-server.

llama-server answers 500 for bodies it cannot parse (lone surrogate escapes,
`NaN`, numbers that overflow a double, bytes that are not UTF-8, UTF-16
bodies) and for some known keys with the wrong type (`"tools": false`). A
client error must get a 400 that says what is wrong, so the node refuses such
bodies itself:

- RFC 8259 JSON in UTF-8: no `NaN` / `Infinity`, no number a double cannot
  hold, no lone surrogate escape, no duplicate key in the top-level object
  (a repeated key would let the node's reading and llama-server's differ);
- nesting at most `MAX_JSON_DEPTH` levels (never a RecursionError);
- the types of the keys llama-server does not check itself;
- one completion per request: `n` / `n_cmpl` above 1 and lists of prompts are
  refused, since each would run several generations on one slot.

`rewrite_top_level` changes top-level keys of a valid body without
re-serialising the values it keeps, so a valid body never turns invalid on
its way upstream.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from meshnet_gguf.contract.errors import ApiError

# Deep enough for any real tool schema or content list; far below Python's recursion limit.
MAX_JSON_DEPTH = 64
# Keys whose value asks llama-server for several completions at once.
MULTIPLIER_KEYS = ("n", "n_cmpl")
# A surrogate escape (\uD800-\uDFFF) anywhere in the text; only then are strings walked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_DECODER = json.JSONDecoder()


def _refuse(code: str, message: str) -> ApiError:
    return ApiError(400, code, message)


def _no_constants(name: str) -> Any:
    raise _refuse("invalid_json", f"Request body is not valid JSON: {name} is not a JSON value (RFC 8259)")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _refuse("invalid_json", f"Number {text[:40]} is out of range for a double")
    return value


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _refuse("duplicate_key", f"Key {key!r} appears twice in one JSON object")
            seen.add(key)
    return out


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or `ApiError(400)` saying why it is not one."""
    try:
        text = body.decode("utf-8")  # strict: refuses encoded surrogates and UTF-16/32 bodies
    except UnicodeDecodeError as exc:
        raise _refuse("invalid_encoding", f"Request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        payload = json.loads(text, parse_constant=_no_constants, parse_float=_finite_float, object_pairs_hook=_unique_pairs)
    except ApiError:
        raise
    except RecursionError:  # the C scanner's own guard, far deeper than MAX_JSON_DEPTH
        raise _refuse("json_too_deep", f"JSON nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise _refuse("invalid_json", f"Request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise _refuse("invalid_json", "Request body must be a JSON object")
    _check_values(payload, check_strings=_SURROGATE_ESCAPE.search(text) is not None)
    return payload


# llama-server reads integers as 64-bit; a larger one overflows its parser (a 500).
_INT_MIN, _INT_END = -(2**63), 2**64


def _check_values(payload: dict[str, Any], *, check_strings: bool) -> None:
    """One iterative walk: nesting depth, integer range, and (when the text has surrogate
    escapes) strings that hold a lone surrogate, which has no UTF-8 form."""
    stack: list[tuple[Any, int]] = [(payload, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            if depth > MAX_JSON_DEPTH:
                raise _refuse("json_too_deep", f"JSON nests deeper than {MAX_JSON_DEPTH} levels")
            for key, sub in item.items():
                if check_strings:
                    _encodable(key)
                stack.append((sub, depth + 1))
        elif isinstance(item, list):
            if depth > MAX_JSON_DEPTH:
                raise _refuse("json_too_deep", f"JSON nests deeper than {MAX_JSON_DEPTH} levels")
            stack.extend((sub, depth + 1) for sub in item)
        elif isinstance(item, str):
            if check_strings:
                _encodable(item)
        elif isinstance(item, int) and not isinstance(item, bool) and not _INT_MIN <= item < _INT_END:
            raise _refuse("invalid_json", "An integer is out of the 64-bit range")


def _encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _refuse("invalid_unicode", "A string holds a lone surrogate escape (\\ud800-\\udfff without its pair)") from None


# --- known keys -------------------------------------------------------------------
def validate_request(path: str, payload: Mapping[str, Any]) -> None:
    """Refuse, with a 400 naming the key, what llama-server would answer with a 500 or run several times."""
    for key in MULTIPLIER_KEYS:
        if key in payload and payload[key] is not None:
            value = payload[key]
            if not _is_int(value) or value < 1:
                raise _refuse("invalid_type", f"'{key}' must be a positive integer")
            if value > 1:
                raise _refuse(
                    "multiple_completions_unsupported",
                    f"'{key}': {value} asks for several completions; this node runs one per request (send {value} requests)",
                )
    for key in ("stream",):
        if key in payload and not isinstance(payload[key], bool) and payload[key] is not None:
            raise _refuse("invalid_type", f"'{key}' must be true or false")
    options = payload.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _refuse("invalid_type", "'stream_options' must be an object")
        if "include_usage" in options and not isinstance(options["include_usage"], bool):
            raise _refuse("invalid_type", "'stream_options.include_usage' must be true or false")
    for key in ("max_tokens", "max_completion_tokens", "n_predict"):
        if key in payload and payload[key] is not None and not _is_int(payload[key]):
            raise _refuse("invalid_type", f"'{key}' must be an integer")
    if path == "/v1/chat/completions":
        _check_messages(payload.get("messages"))
        _check_tools(payload)
    elif path == "/v1/completions":
        _check_prompt(payload.get("prompt"))
    elif path == "/v1/embeddings":
        _check_input(payload.get("input"))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _refuse("invalid_type", "'messages' must be a non-empty array of message objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _refuse("invalid_type", f"'messages[{i}]' must be an object")
        if not isinstance(message.get("role"), str):
            raise _refuse("invalid_type", f"'messages[{i}].role' must be a string")


def _check_tools(payload: Mapping[str, Any]) -> None:
    tools = payload.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _refuse("invalid_type", "'tools' must be an array of tool objects")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
                raise _refuse("invalid_type", f"'tools[{i}]' must be an object with a string 'type'")
            function = tool.get("function")
            if tool["type"] == "function" and (not isinstance(function, dict) or not isinstance(function.get("name"), str)):
                raise _refuse("invalid_type", f"'tools[{i}].function' must be an object with a string 'name'")
    choice = payload.get("tool_choice")
    if choice is not None and not isinstance(choice, (str, dict)):
        raise _refuse("invalid_type", "'tool_choice' must be a string or an object")


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


def _check_prompt(prompt: Any) -> None:
    """One prompt: a string or a list of token ids (or a list holding exactly one of those)."""
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_token_list(prompt[0])):
        return
    if isinstance(prompt, str) or _is_token_list(prompt):
        return
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _refuse(
            "multiple_prompts_unsupported",
            f"'prompt' holds {len(prompt)} prompts; this node runs one per request (send one request per prompt)",
        )
    raise _refuse("invalid_type", "'prompt' must be a string or an array of token ids")


def _check_input(value: Any) -> None:
    if isinstance(value, str) or _is_token_list(value):
        return
    if isinstance(value, list) and value and all(isinstance(v, str) or _is_token_list(v) for v in value):
        return
    raise _refuse("invalid_type", "'input' must be a string, an array of strings, or token ids")


def single_prompt(path: str, payload: Mapping[str, Any]) -> Any:
    """What llama-server tokenizes as the prompt of a completion or embedding (after `validate_request`)."""
    value = payload.get("prompt" if path == "/v1/completions" else "input")
    if isinstance(value, list) and len(value) == 1 and not _is_int(value[0]):
        return value[0]
    return value


# --- rewriting without re-serialising -------------------------------------------
def rewrite_top_level(body: bytes, changes: Mapping[str, Any]) -> bytes:
    """The body with the top-level keys in `changes` set (added or replaced), every other value
    kept byte for byte. The body must have passed `parse_json_object` (valid, no duplicate keys)."""
    text = body.decode("utf-8")
    members: list[tuple[str, str]] = []
    i = _skip_ws(text, 0)
    assert text[i] == "{"
    i = _skip_ws(text, i + 1)
    if text[i] != "}":
        while True:
            key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
            i = _skip_ws(text, _skip_ws(text, i) + 1)  # past ':'
            _, end = _DECODER.raw_decode(text, i)
            members.append((key, text[i:end]))
            i = _skip_ws(text, end)
            if text[i] == "}":
                break
            i = _skip_ws(text, i + 1)  # past ','
    pending = dict(changes)
    parts = []
    for key, raw in members:
        if key in pending:
            raw = json.dumps(pending.pop(key), separators=(",", ":"), allow_nan=False)
        parts.append(json.dumps(key) + ":" + raw)
    parts += [json.dumps(k) + ":" + json.dumps(v, separators=(",", ":"), allow_nan=False) for k, v in pending.items()]
    return ("{" + ",".join(parts) + "}").encode()


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


__all__ = [
    "MAX_JSON_DEPTH",
    "MULTIPLIER_KEYS",
    "parse_json_object",
    "rewrite_top_level",
    "single_prompt",
    "validate_request",
]
