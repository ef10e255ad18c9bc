"""Checks of a client's request body past its JSON, before anything reaches llama-server.

The body is parsed by `contract/strict_json.parse_json_object` (the tracker's parser too: RFC 8259 in
UTF-8, no duplicate key, no `NaN`, bounded nesting). llama-server also answers 500 for some known keys
with the wrong type (`"tools": false`); a client error must get a 400 that says what is wrong, so the
node refuses such bodies itself:

- the types of the keys llama-server does not check itself;
- one completion per request: `n` / `n_cmpl` above 1 and lists of prompts are
  refused, since each would run several generations on one slot.

`rewrite_top_level` changes top-level keys of a valid body without
re-serialising the values it keeps, so a valid body never turns invalid on
its way upstream.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.openai_paths import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH

# Keys whose value asks llama-server for several completions at once.
MULTIPLIER_KEYS = ("n", "n_cmpl")
_DECODER = json.JSONDecoder()


def _refuse(code: str, message: str) -> ApiError:
    return ApiError(400, code, message)


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
    if path == CHAT_COMPLETIONS_PATH:
        _check_messages(payload.get("messages"))
        _check_tools(payload)
    elif path == COMPLETIONS_PATH:
        _check_prompt(payload.get("prompt"))
    elif path == EMBEDDINGS_PATH:
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
    value = payload.get("prompt" if path == COMPLETIONS_PATH else "input")
    if isinstance(value, list) and len(value) == 1 and not _is_int(value[0]):
        return value[0]
    return value


# --- rewriting without re-serialising -------------------------------------------
def rewrite_top_level(body: bytes, changes: Mapping[str, Any]) -> bytes:
    """The body with the top-level keys in `changes` set (added or replaced), every other value
    kept byte for byte. The body must have passed `contract/strict_json.parse_json_object` (valid, no duplicate keys)."""
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
    "MULTIPLIER_KEYS",
    "rewrite_top_level",
    "single_prompt",
    "validate_request",
]
