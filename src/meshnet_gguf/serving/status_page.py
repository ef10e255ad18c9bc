"""The node's own pages: a status page at `/`, the JSON it polls, and llama-server's chat UI at `/chat/`.

`NodePages` is an ASGI app in front of the proxy. It answers its own few paths
and hands every other request to the proxy unchanged, so the OpenAI routes,
`/health` and `/metrics` behave exactly as without it.

- `/` (with `/node.js`, `/node.css`): static files shipped in `pages/`. They
  carry no data, so a browser may load them without a key; the page's script
  polls `/status.json` every `STATUS_POLL_S` and sends the key it was given
  in a login field (kept in the tab's sessionStorage) as a bearer header.
- `/status.json`: the health report plus what only an operator should see (the
  plan, the last requests). `/health` stays public for trackers and load
  balancers, so this lives beside it, under the node's rules (`PageAccess`).
- `/chat/...`: llama-server's web UI. Its static files come from llama-server
  (which serves them gzipped only); its chat and model calls are rewritten to
  the proxy's own routes, so they pass admission, the API key and metering
  like any client's. Standalone nodes only: a meshed node's slots are the
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

from meshnet_gguf.common.asgi import JSON_HEADER, AsgiApp, Receive, Scope, Send, forwardable, request_headers, respond
from meshnet_gguf.common.page_files import PAGE_SECURITY_HEADERS, read_page_file, static_files
from meshnet_gguf.contract.error_answer import send_error
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.protocol import HealthReport, UsageRecord
from meshnet_gguf.llama.upstream import UpstreamClient, UpstreamError
from meshnet_gguf.serving.access import PageAccess
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
# The web UI's own API calls, each answered by the proxy route of the same name (after the prefix).
_CHAT_PROXIED = {"v1/chat/completions": "POST", "v1/models": "GET"}
# The web UI's read-only look at the server (model, context size, modalities), behind the key.
_CHAT_PROPS = "props"


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

    def document(self) -> dict[str, Any]:
        return {
            "health": self.health().model_dump(mode="json"),
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
    """The ASGI app the listener serves: the node's pages, then everything else to the proxy."""

    def __init__(self, proxy: AsgiApp, *, status: StatusSource, access: PageAccess, chat: ChatUi | None = None) -> None:
        self._proxy = proxy
        self._status = status
        self._access = access
        self._chat = chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._proxy(scope, receive, send)
            return
        path: str = scope["path"]
        method: str = scope["method"]
        try:
            if path in STATIC_FILES and method in ("GET", "HEAD"):
                file, content_type = STATIC_FILES[path]
                await respond(send, 200, read_page_file(file), [(b"content-type", content_type.encode()), *_PAGE_SECURITY_HEADERS])
            elif path == STATUS_JSON_PATH and method == "GET":
                self._access.check(scope, request_headers(scope))
                body = json.dumps(self._status.document()).encode()
                await respond(send, 200, body, [JSON_HEADER, (b"cache-control", b"no-store")])
            elif path == CHAT_PREFIX.rstrip("/") and self._chat is not None:
                await respond(send, 308, b"", [(b"location", CHAT_PREFIX.encode())])
            elif path.startswith(CHAT_PREFIX) and self._chat is not None:
                await self._serve_chat(scope, receive, send, path.removeprefix(CHAT_PREFIX))
            else:
                await self._proxy(scope, receive, send)
        except ApiError as exc:
            await send_error(send, exc)

    async def _serve_chat(self, scope: Scope, receive: Receive, send: Send, rest: str) -> None:
        assert self._chat is not None
        method: str = scope["method"]
        if _CHAT_PROXIED.get(rest) == method:
            # The proxy's own route: admission, key, validation and metering as for any client.
            await self._proxy({**scope, "path": "/" + rest, "raw_path": ("/" + rest).encode()}, receive, send)
            return
        if method != "GET":
            raise ApiError(404, "not_found", f"No route {method} {scope['path']} on this node")
        headers = request_headers(scope)
        if rest == _CHAT_PROPS:
            self._access.check(scope, headers)
        elif not _CHAT_STATIC.match(rest) or ".." in rest:
            raise ApiError(404, "not_found", f"No route GET {scope['path']} on this node")
        await self._chat.serve(rest, headers, send)


def plan_line(plan_text: str | None, slots: int) -> str:
    """The launch plan in one line, as the page shows it."""
    if not plan_text:
        return f"{slots} slots (llama-server decides the rest)"
    return plan_text.splitlines()[0].removeprefix("plan: ")


__all__ = ["ChatUi", "NodePages", "RecentRequests", "StatusSource", "plan_line"]
