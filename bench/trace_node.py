#!/usr/bin/env python3
"""Run `meshnet-gguf ARGS` with timestamps on the streamed-request critical path (a diagnostic).

    python bench/trace_node.py serve --gguf ... ; on exit it writes a JSON summary to
    $MESHNET_BENCH_TRACE_OUT: per-segment p50/p90 in microseconds, from uvicorn seeing
    the request to the first body bytes written back to the client.

It wraps internals (uvicorn's httptools protocol, the listener's `RouteTable.__call__`, the upstream
clients' `send`), so it fails loudly if they are renamed. The wrappers cost a few
microseconds, so `bench_proxy.py` runs it as a separate pass from its measurements.
Only `/v1/chat/completions` requests are traced; the first `SKIP` are warm-up.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from typing import Any

from uvicorn.protocols.http import httptools_impl

from meshnet_gguf.llama.upstream.aiohttp_client import AiohttpUpstream
from meshnet_gguf.llama.upstream.httpx_client import HttpxUpstream
from meshnet_gguf.llama.upstream.raw import RawUpstream
from meshnet_gguf.mesh.ledger import UsageLedger
from meshnet_gguf.mesh.meshed_mode import MeshedMode
from meshnet_gguf.serving import routes
from meshnet_gguf.serving.admission_modes import StandaloneMode

# Warm-up requests left out of the summary (MESHNET_BENCH_TRACE_SKIP overrides).
SKIP = int(os.environ.get("MESHNET_BENCH_TRACE_SKIP", "100"))
pc = time.perf_counter
rows: list[dict[str, float]] = []
current: dict[str, Any] = {}

_begin = httptools_impl.HttpToolsProtocol.on_message_begin


def on_message_begin(self: Any) -> None:
    current["begin"] = pc()
    _begin(self)


httptools_impl.HttpToolsProtocol.on_message_begin = on_message_begin  # type: ignore[method-assign]

_call = routes.RouteTable.__call__


async def traced_call(self: Any, scope: dict, receive: Any, send: Any) -> None:
    if scope.get("type") != "http" or scope.get("path") != "/v1/chat/completions":
        await _call(self, scope, receive, send)
        return
    row: dict[str, float] = {"begin": current.get("begin", 0.0), "app": pc()}
    current["row"] = row

    async def traced_send(message: dict) -> None:
        if message["type"] == "http.response.start":
            row["start"] = pc()
        elif message["type"] == "http.response.body" and "body1" not in row:
            row["body1_in"] = pc()
            await send(message)
            row["body1"] = pc()
            return
        await send(message)

    await _call(self, scope, receive, traced_send)
    rows.append(row)


routes.RouteTable.__call__ = traced_call  # type: ignore[method-assign]


def _wrap(cls: type) -> None:
    original = cls.send

    async def send(self: Any, method: str, url: str, headers: dict, body: bytes | None) -> Any:
        row = current.get("row")
        t = pc()
        response = await original(self, method, url, headers, body)
        if row is not None and "up_send" not in row:
            row["up_send"], row["up_resp"] = t, pc()
        return response

    cls.send = send


_wrap(RawUpstream)
_wrap(AiohttpUpstream)
_wrap(HttpxUpstream)


def _time_call(cls: type, name: str, is_async: bool) -> None:
    """Record how long `cls.name` took, into the current request's row as `name` (microseconds)."""
    original = getattr(cls, name)
    if is_async:

        async def timed_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            t = pc()
            try:
                return await original(self, *args, **kwargs)
            finally:
                if (row := current.get("row")) is not None:
                    row[f"took:{cls.__name__}.{name}"] = pc() - t

        setattr(cls, name, timed_async)
    else:

        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            t = pc()
            try:
                return original(self, *args, **kwargs)
            finally:
                if (row := current.get("row")) is not None:
                    row[f"took:{cls.__name__}.{name}"] = pc() - t

        setattr(cls, name, timed)


# The admission steps of either mode, timed one by one.
for _mode in (StandaloneMode, MeshedMode):
    _time_call(_mode, "admit", False)
    _time_call(_mode, "check_body", False)
    _time_call(_mode, "commit", False)
_time_call(routes.Request, "body", True)
_time_call(UsageLedger, "open_request_soon", False)  # handing the row to the writer thread
# The synced row itself, on the writer thread (forwarding does not wait for it: only the first byte does).
_time_call(UsageLedger, "open_request_sync", False)

SEGMENTS = [
    ("uvicorn: request parsed, app called", "begin", "app"),
    ("proxy: admission, JSON, task group, until the hop's send()", "app", "up_send"),
    ("hop: send() until llama-server's response headers (client library + server + loopback)", "up_send", "up_resp"),
    ("proxy: response headers to response.start sent", "up_resp", "start"),
    ("hop: first chunk read, split and metered", "start", "body1_in"),
    ("uvicorn: first body write", "body1_in", "body1"),
    ("total: request seen to first body bytes written", "begin", "body1"),
]


def summary() -> dict[str, dict[str, float]]:
    done = [r for r in rows[SKIP:] if all(k in r for k in ("begin", "app", "up_send", "up_resp", "start", "body1_in", "body1"))]

    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return values[int((len(values) - 1) * q / 100)] * 1e6 if values else float("nan")

    out = {}
    for name, a, b in SEGMENTS:
        values = [r[b] - r[a] for r in done]
        out[name] = {"n": len(values), "p50_us": pct(values, 50), "p90_us": pct(values, 90)}
    for key in sorted({k for r in done for k in r if k.startswith("took:")}):
        values = [r[key] for r in done if key in r]
        out[f"  of which {key.removeprefix('took:')}"] = {"n": len(values), "p50_us": pct(values, 50), "p90_us": pct(values, 90)}
    return out


def _dump() -> None:
    path = os.environ.get("MESHNET_BENCH_TRACE_OUT")
    if path:
        with open(path, "w") as fh:
            json.dump(summary(), fh, indent=1)


atexit.register(_dump)

if __name__ == "__main__":
    from meshnet_gguf.cli import main

    sys.argv = ["meshnet-gguf", *sys.argv[1:]]
    main()
