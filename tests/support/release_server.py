"""llama.cpp's release site on 127.0.0.1, for tests: GitHub's release API and its downloads, from archives in memory.

    GET /api/repos/<owner>/<name>/releases/latest        the last release added: tag_name, assets (name, size, digest)
    GET /api/repos/<owner>/<name>/releases/tags/<tag>    one release
    GET /download/<owner>/<name>/releases/download/<tag>/<asset>

`env()` gives the variables that point `llama/release_fetch` at it. With `missing`
set, every path answers 404 (a release site without these builds); with
`no_listing`, only the API does. The server
runs in a thread of the test's process and is shut down when the `with` ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from meshnet_gguf.llama.release_assets import GITHUB_API_ENV_VAR, GITHUB_ENV_VAR, REPO_ENV_VAR

REPO = "ggml-org/llama.cpp"
SHUTDOWN_POLL_S = 0.05


@dataclass
class LoopbackReleases:
    # tag -> asset name -> bytes; the last tag added is "latest".
    releases: dict[str, dict[str, bytes]] = field(default_factory=dict)
    # Sizes the listing claims where they differ from the bytes served (a listing and a file that disagree).
    listed_sizes: dict[str, int] = field(default_factory=dict)
    missing: bool = False
    # The API answers 404 (GitHub's rate limit answers 403): downloads still work.
    no_listing: bool = False
    requests: list[str] = field(default_factory=list)
    url: str = ""

    def env(self) -> dict[str, str]:
        return {GITHUB_ENV_VAR: f"{self.url}/download", GITHUB_API_ENV_VAR: f"{self.url}/api", REPO_ENV_VAR: REPO}

    def listing(self, tag: str) -> dict[str, object]:
        assets = [
            {"name": name, "size": self.listed_sizes.get(name, len(data)), "digest": f"sha256:{hashlib.sha256(data).hexdigest()}"}
            for name, data in self.releases[tag].items()
        ]
        return {"tag_name": tag, "assets": assets}


def _handler(site: LoopbackReleases) -> type[BaseHTTPRequestHandler]:
    api = f"/api/repos/{REPO}/releases/"
    download = f"/download/{REPO}/releases/download/"

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            site.requests.append(self.path)
            body, kind = self._answer()
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _answer(self) -> tuple[bytes | None, str]:
            if site.missing or not site.releases:
                return None, ""
            if site.no_listing and self.path.startswith(api):
                return None, ""
            if self.path == api + "latest":
                return json.dumps(site.listing(list(site.releases)[-1])).encode(), "application/json"
            if self.path.startswith(api + "tags/"):
                tag = self.path.removeprefix(api + "tags/")
                return (json.dumps(site.listing(tag)).encode() if tag in site.releases else None), "application/json"
            if self.path.startswith(download):
                tag, _, name = self.path.removeprefix(download).partition("/")
                return site.releases.get(tag, {}).get(name), "application/octet-stream"
            return None, ""

        def log_message(self, *_args: object) -> None:
            pass

    return Handler


@contextlib.contextmanager
def serve_releases(site: LoopbackReleases) -> Iterator[LoopbackReleases]:
    """Serve `site` on 127.0.0.1 (a free port) until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(site))
    server.daemon_threads = True
    site.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL_S,), name="release-site", daemon=True)
    thread.start()
    try:
        yield site
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
