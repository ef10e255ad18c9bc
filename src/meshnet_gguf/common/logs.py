"""Logging for the node: readable on a terminal, JSON lines for the journal, never a secret.

- `configure_logging("auto")` picks text on a TTY and JSON lines under
  systemd (`JOURNAL_STREAM` / `INVOCATION_ID`), where a log shipper parses them.
- `request_id_var` carries the request id through a request's task; every
  record logged inside it gets `request_id`.
- llama-server's output is logged under `LLAMA_LOGGER` and tagged
  `source=llama-server`, so its lines are told apart from the node's.
- `register_secret()` adds a string (the internal llama-server key, API keys)
  that is replaced by `[REDACTED]` in every formatted line, tracebacks included.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO, Literal

LogFormat = Literal["auto", "text", "json"]

LLAMA_LOGGER = "meshnet_gguf.llama"
LLAMA_SOURCE = "llama-server"
REDACTED = "[REDACTED]"

request_id_var: ContextVar[str | None] = ContextVar("meshnet_request_id", default=None)

# Libraries that log every HTTP exchange at INFO: on the hot path of the proxy
# that is a line per request the operator did not ask for.
_NOISY_LOGGERS = ("httpx", "httpcore", "httpx2", "httpcore2", "hpack", "urllib3", "gguf")
_SYSTEMD_MARKERS = ("JOURNAL_STREAM", "INVOCATION_ID")
# Attributes every LogRecord has; anything else came from `extra=` and goes into JSON.
# (uvicorn adds `color_message`, its message with terminal colours: never wanted in JSON.)
_STANDARD_ATTRS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "request_id", "source", "tags", "color_message"}

_secrets: set[str] = set()
_secret_pattern: re.Pattern[str] | None = None


def register_secret(secret: str | None) -> None:
    """Never print `secret` again (nor its JSON-escaped form) in any log line."""
    global _secret_pattern
    if not secret:
        return
    _secrets.update({secret, json.dumps(secret)[1:-1]})
    # Longest first, so a secret containing another is replaced whole.
    _secret_pattern = re.compile("|".join(re.escape(s) for s in sorted(_secrets, key=len, reverse=True)))


def forget_secrets() -> None:
    """Drop every registered secret (tests; a node that rotates its key registers the new one)."""
    global _secret_pattern
    _secrets.clear()
    _secret_pattern = None


def redact(text: str) -> str:
    pattern = _secret_pattern
    return pattern.sub(REDACTED, text) if pattern is not None else text


@contextmanager
def bound_request_id(request_id: str) -> Iterator[None]:
    """Tag every record logged in this block (this task) with `request_id`."""
    token = request_id_var.set(request_id)
    try:
        yield
    finally:
        request_id_var.reset(token)


# llama-server's informational lines (load details, `print_timing` after every request)
# are routine: the node states what matters itself (ready, restarts, usage). They go
# to DEBUG; its warnings and errors keep their level.
_LLAMA_LEVELS = {"E": logging.ERROR, "W": logging.WARNING, "I": logging.DEBUG, "D": logging.DEBUG}
# llama-server's own prefix: `0.00.078.593 W srv  llama_server: ...` (timestamp, level letter).
_LLAMA_LEVEL_RE = re.compile(r"^\s*(?:\d+\.\d+\.\d+\.\d+\s+)?([EWID])\s")
# Lines printed without a level (`AMX is not ready to be used!`, a crash's own words):
# routine unless they read like a failure.
_UNLEVELLED_FAILURE_WORDS = ("error", "failed", "fatal", "abort", "exception", "what():", "assert", "segmentation", "illegal")


# Warnings llama-server prints in normal serving, a few per request: a prompt-cache hit
# ("need to evaluate at least 1 token for each active slot" and "n_past was set to", measured
# on b10434: two lines per request that reuses a cached prompt) or a cache it could not reuse.
# Nothing is wrong and nothing is to be done, so they go to DEBUG with the routine lines.
ROUTINE_LLAMA_WARNINGS = (
    "need to evaluate at least 1 token for each active slot",
    "n_past was set to",
    "forcing full prompt re-processing due to lack of cache data",
)


def llama_log_level(line: str) -> int:
    """The logging level of one llama-server output line: from its level letter, else by its words."""
    match = _LLAMA_LEVEL_RE.match(line)
    if match:
        level = _LLAMA_LEVELS[match.group(1)]
        if level == logging.WARNING and any(phrase in line for phrase in ROUTINE_LLAMA_WARNINGS):
            return logging.DEBUG
        return level
    lowered = line.lower()
    return logging.WARNING if any(word in lowered for word in _UNLEVELLED_FAILURE_WORDS) else logging.DEBUG


class _ContextFilter(logging.Filter):
    """Adds `request_id` and `source` to every record passing the handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        if not hasattr(record, "source"):
            is_llama = record.name == LLAMA_LOGGER or record.name.startswith(LLAMA_LOGGER + ".")
            record.source = LLAMA_SOURCE if is_llama else "node"
        return True


class TextFormatter(logging.Formatter):
    """`2026-11-30 14:33:01 INFO  meshnet_gguf.serving.proxy [req 4f2a] message`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-5s %(name)s%(tags)s %(message)s", "%Y-%m-%d %H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        tags = ""
        if getattr(record, "source", None) == LLAMA_SOURCE:
            tags += f" [{LLAMA_SOURCE}]"
        if getattr(record, "request_id", None):
            tags += f" [req {record.request_id}]"
        record.tags = tags
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, source, msg, request_id, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": _iso_utc(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "source": getattr(record, "source", "node"),
            "msg": record.getMessage(),
        }
        if getattr(record, "request_id", None):
            entry["request_id"] = record.request_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return redact(json.dumps(entry, default=str, ensure_ascii=False))


def _iso_utc(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def resolve_format(
    log_format: LogFormat, stream: IO[str] | None = None, environ: Mapping[str, str] | None = None
) -> Literal["text", "json"]:
    """`auto`: text for a person at a terminal, JSON lines under systemd, text otherwise."""
    if log_format != "auto":
        return log_format
    stream = sys.stderr if stream is None else stream
    env = os.environ if environ is None else environ
    if _isatty(stream):
        return "text"
    return "json" if any(env.get(marker) for marker in _SYSTEMD_MARKERS) else "text"


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _NodeHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler `configure_logging` installed, so a second call replaces it."""


def configure_logging(
    log_format: LogFormat = "auto",
    level: str | int = "INFO",
    *,
    stream: IO[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Literal["text", "json"]:
    """Route every logger through one handler on the root logger. Returns the format chosen."""
    stream = sys.stderr if stream is None else stream
    chosen = resolve_format(log_format, stream, environ)
    handler = _NodeHandler(stream)
    handler.setFormatter(JsonFormatter() if chosen == "json" else TextFormatter())
    handler.addFilter(_ContextFilter())

    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _NodeHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    return chosen
