"""The one JSON-object parser for a client's request body, on the node and on the tracker alike.

Strict RFC 8259 in UTF-8, so that every reader of a body reads the same thing:

- no duplicate key in any object: a repeated key lets two readers differ (Python keeps the last,
  another parser the first), the way a second `max_tokens` or `model` would be smuggled past the
  tracker's metering to the node, or past the node to llama-server;
- no `NaN` / `Infinity`, no number a double cannot hold, no integer outside 64 bits, no lone
  surrogate escape, no bytes that are not UTF-8 (llama-server answers each with a 500);
- nesting at most `MAX_JSON_DEPTH` levels (never a RecursionError).

Every refusal is an `ApiError(400)` that says what is wrong.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from meshnet_gguf.contract.errors import ApiError

# Deep enough for any real tool schema or content list; far below Python's recursion limit.
MAX_JSON_DEPTH = 64
# A surrogate escape (\uD800-\uDFFF) anywhere in the text; only then are strings walked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# llama-server reads integers as 64-bit; a larger one overflows its parser (a 500).
_INT_MIN, _INT_END = -(2**63), 2**64


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


__all__ = ["MAX_JSON_DEPTH", "parse_json_object"]
