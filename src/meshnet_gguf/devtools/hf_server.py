"""A small Hugging Face-compatible hub serving repos from a local folder, for tests and development.

`ROOT/<owner>/<name>/...` is served as model repo `owner/name` on 127.0.0.1,
reached by pointing `HF_ENDPOINT` (or an explicit `endpoint=`) at it. It speaks
enough of the hub's HTTP API for huggingface_hub's `model_info`,
`list_repo_tree`, `get_paths_info`, `get_hf_file_metadata` and `hf_hub_download`:

- `GET /api/models/{repo}[/revision/{rev}]`, `GET /api/models/{repo}/tree/{rev}[/{path}]`,
  `POST /api/models/{repo}/paths-info/{rev}` with sizes and LFS sha256 (`*.gguf` files are LFS);
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}` with `ETag`, `X-Repo-Commit`,
  `X-Linked-Etag`, `X-Linked-Size`, `Accept-Ranges` and single `Range` requests (206);
- gated repos: `/resolve` answers 401 without a token and 403 with an unknown one
  (`X-Error-Code: GatedRepo`), while metadata stays public, as on the hub.

For tests it counts the bytes it serves per file, can stall a download at a
byte offset (to kill a client mid-shard deterministically) and can corrupt a
served byte while still advertising the true sha256.

Why not the PyPI `olah` mirror: measured (see design/FACTS.md) it ignores HTTP
`Range` and answers 200 with the whole file, so resuming a partial shard, the
behaviour under test, cannot be exercised through it; its `model_info` carries
no sizes; it needs git repositories with LFS objects rather than a plain folder;
and it has no hooks for counting bytes, stalling or corrupting. This server is
a few hundred lines of starlette + uvicorn, the stack the node already uses.

Run by hand: `python -m meshnet_gguf.devtools.hf_server ROOT [--port N] [--gated owner/name --token T]`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import AsyncIterator, Iterable, Literal
from urllib.parse import parse_qs

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from meshnet_gguf.models.gguf_names import shard_file_name
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model

LOOPBACK = "127.0.0.1"
DEFAULT_REVISION = "main"
SERVE_CHUNK_BYTES = 16 * 1024  # small, so a stall offset lands mid-file even for tiny test shards
STALL_POLL_S = 0.02
START_TIMEOUT_S = 10.0
# Streams still open at stop (a stalled download) are cut after this, so stop() never hangs a test.
SHUTDOWN_GRACE_S = 2.0
LFS_POINTER_SIZE = 134
LFS_SUFFIXES = (".gguf",)

Layout = Literal["root-file", "root-split", "folder-split"]


@dataclass(frozen=True)
class _FileInfo:
    path: str  # in-repo path, "/"-separated
    size: int
    sha256: str
    is_lfs: bool

    @property
    def oid(self) -> str:
        # Stands in for the git blob id; only its stability matters to clients.
        return hashlib.sha1(f"{self.path}:{self.sha256}".encode()).hexdigest()

    def tree_entry(self) -> dict[str, object]:
        entry: dict[str, object] = {"type": "file", "oid": self.oid, "size": self.size, "path": self.path}
        if self.is_lfs:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": LFS_POINTER_SIZE}
        return entry


def _directory_entry(path: str) -> dict[str, object]:
    """A folder as the hub's tree listing shows one (its oid: any stable hash of the path)."""
    return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}


def _error(status: int, code: str, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status, headers={"X-Error-Code": code, "X-Error-Message": message})


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """A single `bytes=a-b` / `bytes=a-` range as inclusive (start, end); None for no/unsupported range."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    start_text, _, end_text = header[len("bytes=") :].partition("-")
    # Suffix ranges are not used by huggingface_hub; like any invalid range they are ignored (RFC 9110).
    if not start_text.isdigit() or (end_text and not end_text.isdigit()):
        return None
    start = int(start_text)
    end = int(end_text) if end_text else size - 1
    return start, min(end, size - 1)


class LocalHub:
    """The server; use as a context manager (`with LocalHub(root) as hub: hub.endpoint`)."""

    def __init__(self, root: Path, *, gated: Iterable[str] = (), tokens: Iterable[str] = (), port: int = 0) -> None:
        self.root = Path(root)
        self.gated = set(gated)
        self.tokens = set(tokens)
        self._port = port
        self._lock = threading.Lock()
        self._bytes_served: Counter[tuple[str, str]] = Counter()
        self._requests: list[tuple[str, str, str | None]] = []
        self._stalls: dict[tuple[str, str], int] = {}
        self._released = threading.Event()
        self._corruptions: dict[tuple[str, str], int] = {}
        self._hash_cache: dict[tuple[Path, int, int], str] = {}
        self._closing = False
        # False mimics mirrors that ignore Range and answer 200 with the whole file (olah does).
        self.honour_range = True
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.endpoint = ""

    # ---- test controls ---------------------------------------------------
    def bytes_served(self, repo_id: str, path: str | None = None) -> int:
        with self._lock:
            if path is not None:
                return self._bytes_served[(repo_id, path)]
            return sum(n for (repo, _), n in self._bytes_served.items() if repo == repo_id)

    def requests(self) -> list[tuple[str, str, str | None]]:
        """(method, url path, Range header) of every request so far."""
        with self._lock:
            return list(self._requests)

    def reset_counters(self) -> None:
        with self._lock:
            self._bytes_served.clear()
            self._requests.clear()

    def stall(self, repo_id: str, path: str, after_bytes: int) -> None:
        """Serve `path` up to byte offset `after_bytes`, then hold the stream open until `release()` cuts it."""
        self._released.clear()
        with self._lock:
            self._stalls[(repo_id, path)] = after_bytes

    def release(self) -> None:
        with self._lock:
            self._stalls.clear()
        self._released.set()

    def corrupt(self, repo_id: str, path: str, offset: int | None = None) -> None:
        """Flip one served byte of `path` (default: the middle one); listings keep the true sha256."""
        size = self._repo_dir(repo_id).joinpath(path).stat().st_size
        with self._lock:
            self._corruptions[(repo_id, path)] = size // 2 if offset is None else offset

    def heal(self) -> None:
        with self._lock:
            self._corruptions.clear()

    # ---- lifecycle -------------------------------------------------------
    def start(self) -> LocalHub:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, self._port))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("local hub did not start")
            time.sleep(0.01)
        self.endpoint = f"http://{LOOPBACK}:{port}"
        return self

    def stop(self) -> None:
        self._closing = True
        self._released.set()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=SHUTDOWN_GRACE_S + 5)

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- repo data -------------------------------------------------------
    def _repo_dir(self, repo_id: str) -> Path:
        return self.root / repo_id

    def _files(self, repo_id: str) -> list[_FileInfo] | None:
        repo_dir = self._repo_dir(repo_id)
        if not repo_dir.is_dir():
            return None
        infos = []
        for p in sorted(repo_dir.rglob("*")):
            rel = p.relative_to(repo_dir).as_posix()
            if not p.is_file() or any(part.startswith(".") for part in rel.split("/")):
                continue
            infos.append(_FileInfo(rel, p.stat().st_size, self._sha256(p), rel.lower().endswith(LFS_SUFFIXES)))
        return infos

    def _sha256(self, path: Path) -> str:
        st = path.stat()
        key = (path, st.st_size, st.st_mtime_ns)
        with self._lock:
            cached = self._hash_cache.get(key)
        if cached is None:
            digest = hashlib.sha256()
            with path.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
            cached = digest.hexdigest()
            with self._lock:
                self._hash_cache[key] = cached
        return cached

    @staticmethod
    def _commit(files: list[_FileInfo]) -> str:
        return hashlib.sha1("\n".join(f"{f.path} {f.sha256}" for f in files).encode()).hexdigest()

    def _lookup(self, request: Request) -> tuple[str, list[_FileInfo], str] | Response:
        """Record the request, then find its repo and revision: (repo id, files, commit), or the hub's 404."""
        self._record(request)
        repo_id = f"{request.path_params['owner']}/{request.path_params['name']}"
        files = self._files(repo_id)
        if files is None:
            return _error(404, "RepoNotFound", f"Repository not found: {repo_id}")
        commit = self._commit(files)
        revision = request.path_params.get("revision", DEFAULT_REVISION)
        if revision not in (DEFAULT_REVISION, commit):
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo_id, files, commit

    def _record(self, request: Request) -> None:
        with self._lock:
            self._requests.append((request.method, request.url.path, request.headers.get("range")))

    # ---- endpoints -------------------------------------------------------
    async def _model_info(self, request: Request) -> Response:
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        repo_id, files, commit = found
        with_blobs = request.query_params.get("blobs", "").lower() == "true"
        siblings = []
        for f in files:
            sibling: dict[str, object] = {"rfilename": f.path}
            if with_blobs:
                sibling.update(size=f.size, blobId=f.oid)
                if f.is_lfs:
                    sibling["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": LFS_POINTER_SIZE}
            siblings.append(sibling)
        now = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        return JSONResponse(
            {
                "_id": commit[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0],
                "sha": commit,
                "private": False,
                "gated": "manual" if repo_id in self.gated else False,
                "disabled": False,
                "tags": ["gguf"],
                "library_name": "gguf",
                "siblings": siblings,
                "lastModified": now,
                "createdAt": now,
            }
        )

    async def _tree(self, request: Request) -> Response:
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        _, files, _ = found
        prefix = request.path_params.get("path", "").strip("/")
        recursive = request.query_params.get("recursive", "").lower() == "true"
        under = [f for f in files if not prefix or f.path.startswith(prefix + "/")]
        if prefix and not under:
            return _error(404, "EntryNotFound", f"{prefix} does not exist on {DEFAULT_REVISION}")
        entries: list[dict[str, object]] = []
        folders: set[str] = set()
        for f in under:
            rest = f.path[len(prefix) + 1 :] if prefix else f.path
            parts = rest.split("/")
            for depth in range(1, len(parts)):
                if depth > 1 and not recursive:
                    break
                folder = "/".join(filter(None, [prefix, *parts[:depth]]))
                if folder not in folders:
                    folders.add(folder)
                    entries.append(_directory_entry(folder))
            if recursive or len(parts) == 1:
                entries.append(f.tree_entry())
        return JSONResponse(entries)

    async def _paths_info(self, request: Request) -> Response:
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        _, files, _ = found
        form = parse_qs((await request.body()).decode())
        wanted = set(form.get("paths", []))
        by_path = {f.path: f for f in files}
        entries: list[dict[str, object]] = [by_path[p].tree_entry() for p in sorted(wanted) if p in by_path]
        folders = {p for p in wanted if p not in by_path and any(f.path.startswith(p + "/") for f in files)}
        entries += [_directory_entry(p) for p in sorted(folders)]
        return JSONResponse(entries)

    async def _resolve(self, request: Request) -> Response:
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        repo_id, files, commit = found
        if repo_id in self.gated:
            auth = request.headers.get("authorization", "")
            token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
            if token is None:
                return _error(
                    401,
                    "GatedRepo",
                    f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it. Please log in.",
                )
            if token not in self.tokens:
                return _error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not in the authorized list.")
        path = request.path_params["path"]
        info = next((f for f in files if f.path == path), None)
        if info is None:
            return _error(404, "EntryNotFound", f"{path} does not exist on {DEFAULT_REVISION}")
        etag = f'"{info.sha256 if info.is_lfs else info.oid}"'
        headers = {
            "ETag": etag,
            "X-Repo-Commit": commit,
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f'attachment; filename="{path.rsplit("/", 1)[-1]}"',
        }
        if info.is_lfs:
            headers.update({"X-Linked-Etag": etag, "X-Linked-Size": str(info.size)})
        byte_range = _parse_range(request.headers.get("range"), info.size) if self.honour_range else None
        start, end, status = 0, info.size - 1, 200
        if byte_range is not None:
            start, end = byte_range
            if start >= info.size:
                return Response(status_code=416, headers={"Content-Range": f"bytes */{info.size}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{info.size}"
        headers["Content-Length"] = str(end - start + 1)
        if request.method == "HEAD":
            return Response(status_code=status, headers=headers)
        body = self._stream(repo_id, path, self._repo_dir(repo_id) / path, start, end)
        return StreamingResponse(body, status_code=status, headers=headers)

    async def _stats(self, request: Request) -> Response:
        with self._lock:
            served = [{"repo": r, "path": p, "bytes": n} for (r, p), n in sorted(self._bytes_served.items())]
        return JSONResponse({"bytes_served": served})

    async def _stream(self, repo_id: str, path: str, file: Path, start: int, end: int) -> AsyncIterator[bytes]:
        key = (repo_id, path)
        position = start
        with file.open("rb") as fh:
            fh.seek(start)
            while position <= end:
                with self._lock:
                    stall_at = self._stalls.get(key)
                    flip_at = self._corruptions.get(key)
                limit = end + 1
                if stall_at is not None and position >= stall_at:
                    while not (self._released.is_set() or self._closing):
                        await asyncio.sleep(STALL_POLL_S)
                    # A released stall is a cut connection: its client is gone (the tests kill it),
                    # and bytes sent into the dead socket must not count against the next request.
                    return
                if stall_at is not None:
                    limit = min(limit, stall_at)
                chunk = fh.read(min(SERVE_CHUNK_BYTES, limit - position))
                if not chunk:
                    return
                if flip_at is not None and position <= flip_at < position + len(chunk):
                    data = bytearray(chunk)
                    data[flip_at - position] ^= 0xFF
                    chunk = bytes(data)
                yield chunk
                with self._lock:
                    self._bytes_served[key] += len(chunk)
                position += len(chunk)

    def app(self) -> Starlette:
        repo = "/{owner}/{name}"
        return Starlette(
            routes=[
                Route("/_meshnet/stats", self._stats),
                Route(f"/api/models{repo}", self._model_info),
                Route(f"/api/models{repo}/revision/{{revision}}", self._model_info),
                Route(f"/api/models{repo}/tree/{{revision}}", self._tree),
                Route(f"/api/models{repo}/tree/{{revision}}/{{path:path}}", self._tree),
                Route(f"/api/models{repo}/paths-info/{{revision}}", self._paths_info, methods=["POST"]),
                Route(f"{repo}/resolve/{{revision}}/{{path:path}}", self._resolve, methods=["GET", "HEAD"]),
            ]
        )


# ---- tiny repos ----------------------------------------------------------
def _split_max_tensors_for(shards: int, spec: TinyModelSpec) -> int:
    """The `split_max_tensors` that makes the gguf writer produce exactly `shards` files."""
    tensors = 3 + 9 * spec.n_layers  # embeddings, output norm, output + 9 per layer (see tiny_model)
    for per_shard in range(1, tensors + 1):
        if -(-tensors // per_shard) == shards:
            return per_shard
    raise ValueError(f"a {spec.n_layers}-layer tiny model cannot be split into {shards} shards")


def write_tiny_repo(
    root: Path,
    repo_id: str,
    quants: Iterable[str],
    *,
    layout: Layout = "root-file",
    shards: int = 1,
    stem: str = "Tiny",
    spec: TinyModelSpec = TinyModelSpec(),
) -> list[Path]:
    """Write one tiny real GGUF per quant label into `root/repo_id` in one of the layouts seen on the hub.

    `root-file`: `Tiny-Q4_K_M.gguf`; `root-split`: `Tiny-Q8_0-00001-of-00003.gguf`;
    `folder-split`: `UD-Q4_K_XL/Tiny-UD-Q4_K_XL-00001-of-00003.gguf`. Returns every file written.
    Each quant gets its own seed, so files differ (the labels are names only: weights stay F32).
    """
    repo_dir = Path(root) / repo_id
    written: list[Path] = []
    for i, quant in enumerate(quants):
        quant_spec = TinyModelSpec(**{**spec.__dict__, "seed": spec.seed + i, "name": f"{stem}-{quant}"})
        if layout == "root-file":
            written.append(write_tiny_model(repo_dir / f"{stem}-{quant}.gguf", quant_spec))
            continue
        folder = repo_dir if layout == "root-split" else repo_dir / quant
        base = f"{stem}-{quant}"
        write_tiny_model(folder / f"{base}.gguf", quant_spec, split_max_tensors=_split_max_tensors_for(shards, quant_spec))
        written += [folder / shard_file_name(base, k, shards) for k in range(1, shards + 1)]
    (repo_dir / "README.md").write_text(f"# {repo_id}\n\nTiny generated GGUF models for tests.\n")
    missing = [p for p in written if not p.is_file()]
    if missing:
        raise RuntimeError(f"tiny repo writer did not produce {missing}")
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve ROOT/<owner>/<name>/ as a local Hugging Face hub on 127.0.0.1")
    parser.add_argument("root", type=Path)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--gated", action="append", default=[], help="repo id that needs a token (repeatable)")
    parser.add_argument("--token", action="append", default=[], help="token accepted for gated repos (repeatable)")
    args = parser.parse_args(argv)
    with LocalHub(args.root, gated=args.gated, tokens=args.token, port=args.port) as hub:
        print(json.dumps({"endpoint": hub.endpoint}), flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
