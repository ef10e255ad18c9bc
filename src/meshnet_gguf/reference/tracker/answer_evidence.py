"""Proof of model's evidence, the tracker's way: every answer of an audited model comes with its log-probabilities.

A verifier judges a near quant of the claimed weights by the values the node's llama-server reported at each answer
token (`proof.values`), not by the tokens alone. So the tracker asks every node whose model has a verifier for its
top `EVIDENCE_TOP_K` log-probabilities on every answer (all of them, not only the drawn ones: a node that saw them
asked only sometimes would know which answers are audited), keeps them with a drawn answer's capture
(`audits.AnswerCapture`), and takes them out of what the client gets when the client did not ask for them itself.

The values come from the answer the node streamed to this tracker, over the node's pinned connection: it cannot
hand over others later, so no commitment is needed for them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from meshnet_gguf.contract.model_proof import EVIDENCE_TOP_K, AnswerEvidence, evidence_from_token_probs
from meshnet_gguf.contract.openai_paths import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH
from meshnet_gguf.contract.sse import SSESplitter, event_data


def client_asked(path: str, payload: Mapping[str, Any]) -> bool:
    """Whether the client asked for log-probabilities itself (then its answer keeps them, as they came)."""
    value = payload.get("logprobs")
    if path == COMPLETIONS_PATH:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value is True


def evidence_body(path: str, payload: Mapping[str, Any]) -> bytes | None:
    """The request body that asks the node for the evidence, or None to send the client's own unchanged (another path,
    or a client that asked for log-probabilities itself)."""
    if path not in (CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH) or client_asked(path, payload):
        return None
    asked = {"logprobs": EVIDENCE_TOP_K} if path == COMPLETIONS_PATH else {"logprobs": True, "top_logprobs": EVIDENCE_TOP_K}
    return json.dumps({**payload, **asked}, separators=(",", ":")).encode()


def _without_logprobs(document: dict[str, Any]) -> dict[str, Any]:
    for choice in document.get("choices") or ():
        if isinstance(choice, dict):
            choice.pop("logprobs", None)
    return document


class LogprobStripper:
    """Takes the log-probabilities the tracker asked for out of an answer the client did not ask them for.

    A stream is cut into events (`contract.sse.SSESplitter`); an event whose data carries them is written again
    without them, every other event goes as it came. A whole answer is held to its end and written again once."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self._events = SSESplitter()
        self._whole: list[bytes] = []

    def feed(self, chunk: bytes) -> bytes:
        if not self.stream:
            self._whole.append(chunk)
            return b""
        return b"".join(self._event(raw) for raw in self._events.feed(chunk))

    def end(self) -> bytes:
        """What is left once the node's answer ended: a whole answer, or a stream's unterminated tail, as it came."""
        if self.stream:
            return self._events.pending
        raw = b"".join(self._whole)
        try:
            document = json.loads(raw)
        except ValueError:
            return raw  # not JSON (an error page): nothing of ours in it
        return (
            json.dumps(_without_logprobs(document), separators=(",", ":"), ensure_ascii=False).encode()
            if isinstance(document, dict)
            else raw
        )

    @staticmethod
    def _event(raw: bytes) -> bytes:
        if b'"logprobs"' not in raw:
            return raw
        data = event_data(raw)
        try:
            document = json.loads(data) if data is not None else None
        except ValueError:
            return raw
        if not isinstance(document, dict):
            return raw
        return b"data: " + json.dumps(_without_logprobs(document), separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def evidence_of(documents: Iterable[Mapping[str, Any]], text: str) -> AnswerEvidence | None:
    """The first choice's evidence from an answer's documents (a whole answer, or a stream's events in order), or None
    when it has none to give (no log-probabilities, or a token without its top-1: a client that asked for them so).

    An answer that ended on the model's end token (or a stop string) lists that token with the rest, but its text does
    not hold it: tokens past the answer's `text` are left out, so the evidence spells what was forwarded."""
    entries: list[Mapping[str, Any]] = []
    for document in documents:
        choices = document.get("choices") or []
        logprobs = choices[0].get("logprobs") if choices and isinstance(choices[0], dict) else None
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        entries.extend(content or [])
    spelled = text.encode("utf-8")
    while entries and (not entries[-1].get("bytes") or len(_spelled(entries)) > len(spelled) >= len(_spelled(entries[:-1]))):
        entries.pop()  # an end token (it spells no bytes), or one past the text (a stop string's)
    if not entries or any(not entry.get("top_logprobs") for entry in entries):
        return None
    try:
        return evidence_from_token_probs(entries)
    except (KeyError, TypeError, ValueError):
        return None


def _spelled(entries: list[Mapping[str, Any]]) -> bytes:
    try:
        return b"".join(bytes(entry.get("bytes") or []) for entry in entries)
    except (TypeError, ValueError):
        return b""
