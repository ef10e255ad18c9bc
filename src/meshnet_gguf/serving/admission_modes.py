"""How a request earns its way to llama-server: one small interface, one object per way of running.

A standalone node admits by API key (when one is set) and refuses what a web page in the
operator's browser could send it. A meshed node admits only tracker-signed routes and
records each request durably before forwarding it; that mode lives with the mesh
(`mesh/meshed_mode.py`) and implements `AdmissionMode` below. The proxy calls the same
three steps either way, in this order, so nothing costly happens for a request that is
refused, and nothing is used up by a request refused for another reason:

1. `admit(headers, path)`, before a byte of the body is read;
2. `check_body(grant, body)`, once it is;
3. `commit(grant, usage, body)`, just before forwarding: from here the request runs. It uses the
   grant up at once, in memory, and only *starts* recording the request: the proxy forwards
   meanwhile and holds the answer's first byte until the returned `Recording` is durable
   (protocol §6, rule 1);
4. `prompt_counted(request_id, tokens)`, when a prompt had to be counted (its answer did not say) and the count lands.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.protocol import UsageRecord
from meshnet_gguf.serving.access import answered_hosts, check_api_key, check_host

JSON_CONTENT_TYPE = "application/json"


@dataclass(frozen=True)
class RouteGrant:
    """What a route allows: the request id to bill under, a completion-token cap, and until when
    the route could be presented (its id must stay refused that long, across restarts too)."""

    request_id: str | None = None
    max_tokens: int | None = None
    expires_at: float | None = None
    body_sha256: str | None = None


class Recording(Protocol):
    """What `commit` started: the request's record on its way to where billing needs it."""

    async def durable(self) -> None:
        """Returns once the record is durable; raises `ApiError` when it never will be: the answer
        then reaches nobody and the request is billed nothing. Safe to await more than once."""


class _NothingToRecord:
    async def durable(self) -> None:
        return None


# A standalone node records nothing before answering.
NOTHING_TO_RECORD: Recording = _NothingToRecord()


class AdmissionMode(Protocol):
    """The way this node admits requests; each step raises `ApiError` to refuse."""

    @property
    def keeps_request_body(self) -> bool:
        """True when `commit` keeps the request body where the prompt can be counted later, even
        after a crash (a ledger row): the proxy then counts a prompt only when the answer does not
        carry llama-server's count. False: a stream's prompt is counted beside it, while
        llama-server is surely there to answer."""
        ...

    def admit_listing(self, headers: Mapping[str, str]) -> None:
        """`GET /v1/models`: may this caller list the model?"""

    def admit(self, headers: Mapping[str, str], path: str) -> RouteGrant:
        """May this request send a body? Decided from its headers alone."""
        ...

    def check_body(self, grant: RouteGrant, body: bytes) -> None:
        """Is this the body the grant was given for?"""

    def commit(self, grant: RouteGrant, usage: Callable[[], UsageRecord], body: bytes) -> Recording:
        """The request is about to be forwarded: use up its grant now, and start recording it
        (`usage()`, and the body its prompt can be counted from) where billing needs it."""
        ...

    async def prompt_counted(self, request_id: str, prompt_tokens: int) -> None:
        """The prompt's count landed: record it where billing needs it."""


def unavailable(message: str, retry_after_s: int) -> ApiError:
    return ApiError(503, "unavailable", message, headers={"retry-after": str(retry_after_s)})


class StandaloneMode:
    """A node on its own: an optional API key, and only requests addressed to it, sent as JSON.

    A web page in the operator's browser can reach loopback: with a rebound DNS name (the
    Host header then carries that name) or with a form post (which cannot carry
    Content-Type: application/json without a CORS preflight this node never grants).
    Nothing is recorded before forwarding.
    """

    keeps_request_body = False

    def __init__(self, *, api_key: str | None = None, allowed_hosts: Sequence[str] = ()) -> None:
        self._api_key = api_key
        self._allowed_hosts = answered_hosts(allowed_hosts)

    def admit_listing(self, headers: Mapping[str, str]) -> None:
        check_host(headers, self._allowed_hosts)
        check_api_key(headers, self._api_key)

    def admit(self, headers: Mapping[str, str], path: str) -> RouteGrant:
        check_host(headers, self._allowed_hosts)
        content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != JSON_CONTENT_TYPE:
            raise ApiError(415, "unsupported_media_type", f"Content-Type must be {JSON_CONTENT_TYPE}")
        check_api_key(headers, self._api_key)
        return RouteGrant()

    def check_body(self, grant: RouteGrant, body: bytes) -> None:
        return None

    def commit(self, grant: RouteGrant, usage: Callable[[], UsageRecord], body: bytes) -> Recording:
        return NOTHING_TO_RECORD

    async def prompt_counted(self, request_id: str, prompt_tokens: int) -> None:
        return None


__all__ = ["NOTHING_TO_RECORD", "AdmissionMode", "Recording", "RouteGrant", "StandaloneMode", "unavailable"]
