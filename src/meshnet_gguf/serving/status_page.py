"""The node's own pages: a status page at `/`, the JSON it polls, and llama-server's chat UI at `/chat/`.

`NodePages` gives the listener's table (`serving/node_surface`) its rows for these
few paths; the OpenAI routes, `/health` and `/metrics` are other rows of that table.

- `/` (with `/node.js`, `/node.css`): static files shipped in `pages/`. They
  carry no data, so a browser may load them without a key; the page's script
  polls `/status.json` every `STATUS_POLL_S` and sends the key it was given
  in a login field (kept in the tab's sessionStorage) as a bearer header.
- `/status.json`: the health report plus what only an operator should see (the
  plan, the last requests). `/health` stays public for trackers and load
  balancers, so this lives beside it, under the node's rules (`PageAccess`).
- `/chat/...`: llama-server's web UI. Its static files come from llama-server
  (which serves them gzipped only); its chat and model calls are rows of the
  table answered by the proxy's own handlers, so they pass admission, the API
  key and metering like any client's. Standalone nodes only: a meshed node's slots are the
  tracker's to fill.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshnet_gguf.common.asgi import JSON_HEADER, Send, forwardable, respond
from meshnet_gguf.common.page_files import PAGE_SECURITY_HEADERS, read_page_file, static_files
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.protocol import HealthReport, UsageRecord
from meshnet_gguf.llama.upstream import UpstreamClient, UpstreamError
from meshnet_gguf.serving.access import PageAccess
from meshnet_gguf.serving.routes import Request, Route, no_route, open_to_all
from meshnet_gguf.serving.upstream_target import UpstreamTarget

PAGES_DIR = Path(__file__).parent / "pages"
STATUS_JSON_PATH = "/status.json"
CHAT_PREFIX = "/chat/"
# How often the page asks for /status.json. One request is a dict copy and ~2 KB of
# JSON; once a second keeps a loading bar moving without costing a slot anything.
STATUS_POLL_S = 1.0
# The last requests the page lists (a ring: memory stays bounded on a busy node).
RECENT_REQUESTS_KEPT = 20
# The page's files, path -> (file, content type).
STATIC_FILES = static_files(PAGES_DIR, "node")
_PAGE_SECURITY_HEADERS = [(name.encode(), value.encode()) for name, value in PAGE_SECURITY_HEADERS.items()]
# Paths under /chat/ that are llama-server's web UI files (no data in them): its index,
# its bundle and its icons. Anything else of llama-server's (slots, metrics, props) is not.
_CHAT_STATIC = re.compile(r"^(|_app/[A-Za-z0-9_./-]+|[A-Za-z0-9_-]+\.(?:ico|svg|png|webmanifest)|(?:build|_app/version)\.json)$")
# The web UI's read-only look at the server (model, context size, modalities), behind the key.
CHAT_PROPS_PATH = CHAT_PREFIX + "props"


class RecentRequests:
    """A usage sink that keeps the last few requests for the page."""

    def __init__(self, kept: int = RECENT_REQUESTS_KEPT) -> None:
        self._records: deque[UsageRecord] = deque(maxlen=kept)

    async def record(self, usage: UsageRecord) -> None:
        self._records.append(usage)

    def latest_first(self) -> list[dict[str, Any]]:
        return [
            {
                "request_id": r.request_id,
                "route": r.route,
                "started_at": r.started_at,
                "status": r.status,
                "outcome": r.finish_reason,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "ttft_s": r.ttft_s,
                "decode_tokens_per_s": r.decode_tokens_per_s,
            }
            for r in reversed(self._records)
        ]


@dataclass(frozen=True)
class StatusSource:
    """What /status.json shows: the live health report and the facts fixed at launch."""

    health: Callable[[], HealthReport]
    recent: RecentRequests
    plan: str
    tracker: str | None = None
    chat: bool = False  # whether /chat/ is served here
    llama_server: str = ""  # the binary, its build and what it can do (web UI, RPC, Vulkan)
    # Which installed llama-server serves and why, with each one's measured figures (`BinaryChoice.to_dict`).
    llama_server_choice: dict[str, Any] | None = None
    # Each model the node serves with its state, pid, idle time, requests and memory (`meshnet-gguf ps` reads it).
    models: Callable[[], list[dict[str, Any]]] | None = None

    def document(self) -> dict[str, Any]:
        return {
            "health": self.health().model_dump(mode="json"),
            **({"models": self.models()} if self.models is not None else {}),
            "plan": self.plan,
            "llama_server": self.llama_server,
            "llama_server_choice": self.llama_server_choice,
            "tracker": self.tracker,
            "recent_requests": self.recent.latest_first(),
            "chat": self.chat,
            "poll_interval_s": STATUS_POLL_S,
        }


class ChatUi:
    """llama-server's web UI, fetched from it with the internal key and handed over as it came."""

    def __init__(self, upstream: Callable[[], UpstreamTarget | None], client: UpstreamClient) -> None:
        self._upstream = upstream
        self._client = client

    async def serve(self, rest: str, headers: dict[str, str], send: Send) -> None:
        target = self._upstream()
        if target is None:
            raise ApiError(503, "unavailable", "llama-server is not ready; the chat opens once the model is loaded")
        upstream_headers = {"authorization": f"Bearer {target.api_key}"}
        # llama-server keeps its UI gzipped and answers 415 to a client that cannot take that.
        if "accept-encoding" in headers:
            upstream_headers["accept-encoding"] = headers["accept-encoding"]
        for name in ("if-none-match", "accept"):
            if name in headers:
                upstream_headers[name] = headers[name]
        try:
            response = await self._client.send("GET", f"{target.base_url}/{rest}", upstream_headers, None)
            try:
                body = await response.read()
            finally:
                await response.aclose()
        except UpstreamError as exc:
            raise ApiError(503, "unavailable", f"llama-server did not answer: {exc}") from None
        await respond(send, response.status, body, forwardable(response.headers))


class NodePages:
    """The node's pages as rows of the listener's table: the static files, `/status.json` and, with a
    chat, llama-server's web UI under `/chat/` (its API calls are the proxy's rows: `serving/node_surface`)."""

    def __init__(self, *, status: StatusSource, access: PageAccess, chat: ChatUi | None = None) -> None:
        self._status = status
        self.access = access
        self.chat = chat

    def rows(self) -> list[Route]:
        rows = [Route(method, path, open_to_all, self._serve_file) for path in STATIC_FILES for method in ("GET", "HEAD")]
        rows.append(Route("GET", STATUS_JSON_PATH, self.access, self._serve_status))
        if self.chat is not None:
            rows += [
                Route("GET", CHAT_PREFIX.rstrip("/"), open_to_all, _redirect_to_chat),
                Route("GET", CHAT_PROPS_PATH, self.access, self._serve_chat_file),
                # Only llama-server's web UI files pass (no data in them); anything else of its own is not served.
                Route("GET", CHAT_PREFIX, open_to_all, self._serve_chat_file, prefix=True),
            ]
        return rows

    async def _serve_file(self, request: Request) -> None:
        file, content_type = STATIC_FILES[request.path]
        await respond(request.send, 200, read_page_file(file), [(b"content-type", content_type.encode()), *_PAGE_SECURITY_HEADERS])

    async def _serve_status(self, request: Request) -> None:
        body = json.dumps(self._status.document()).encode()
        await respond(request.send, 200, body, [JSON_HEADER, (b"cache-control", b"no-store")])

    async def _serve_chat_file(self, request: Request) -> None:
        assert self.chat is not None
        rest = request.path.removeprefix(CHAT_PREFIX)
        if request.path != CHAT_PROPS_PATH and (not _CHAT_STATIC.match(rest) or ".." in rest):
            raise no_route(request.method, request.path)
        await self.chat.serve(rest, request.headers, request.send)


async def _redirect_to_chat(request: Request) -> None:
    await respond(request.send, 308, b"", [(b"location", CHAT_PREFIX.encode())])


def plan_line(plan_text: str | None, slots: int) -> str:
    """The launch plan in one line, as the page shows it."""
    if not plan_text:
        return f"{slots} slots (llama-server decides the rest)"
    return plan_text.splitlines()[0].removeprefix("plan: ")


__all__ = ["ChatUi", "NodePages", "RecentRequests", "StatusSource", "plan_line"]
