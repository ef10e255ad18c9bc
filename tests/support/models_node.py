"""A node serving several models, as the tracker sees one: its real key and signed calls (`TrackerClient`, the
control proof, receipts), announcing models with their states, and answering each routed request at once with the
model its route names, on real HTTP on loopback. It stands in for the multi-model node's serving side, which the
node does not wire yet: the tracker's side of "several models per node" is tested against it.

A request for a model in `hold` waits until the test releases it: it keeps one of that model's slots busy.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.contract.protocol import (
    NODE_CONTROL_NONCE_PARAM,
    NODE_CONTROL_PATH,
    REQUEST_ID_HEADER,
    ROUTE_HEADER,
    AnnouncedModel,
    HealthReport,
    NodeAnnouncement,
    NodeControlProof,
    NodeLoad,
    UsageRecord,
)
from meshnet_gguf.mesh.announced_models import state_reports
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.tracker_client import TrackerClient
from support.loopback import serve_asgi
from support.mesh_tracker import SECRET

ANSWER_TOKENS = 3
# A streamed answer: enough content events, far enough apart, for the tracker to time its decode.
STREAM_EVENTS = 6
STREAM_EVENT_GAP_S = 0.005


async def _events(model: str, first_token_after_s: float = 0.0) -> AsyncIterator[bytes]:
    await anyio.sleep(first_token_after_s)
    for _ in range(STREAM_EVENTS):
        chunk = {"object": "chat.completion.chunk", "model": model, "choices": [{"index": 0, "delta": {"content": "a "}}]}
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        await anyio.sleep(STREAM_EVENT_GAP_S)
    yield b"data: [DONE]\n\n"


def route_claims(token: str) -> dict[str, Any]:
    """The claims of a route token, read without checking its signature (the node's route gate is tested elsewhere)."""
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


class ModelsNode:
    def __init__(self, state_dir: Path, tracker_url: str, models: list[AnnouncedModel], *, slots: int = 4) -> None:
        self.identity = NodeIdentity.load_or_create(state_dir)
        self.port = free_local_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.models = models
        self.slots = slots
        self.client = TrackerClient(tracker_url, self.identity, enrolment_secret=SECRET)
        self.answered: list[dict[str, Any]] = []  # each routed request: its route's model and request id
        self.hold: dict[str, anyio.Event] = {}  # model id -> released when set
        self.held = 0
        self.load_s: dict[str, float] = {}  # model id -> how long its next request waits before its first token, once
        self.app = Starlette(
            routes=[
                Route(NODE_CONTROL_PATH, self._control, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/chat/completions", self._answer, methods=["POST"]),
            ]
        )

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    def announcement(self, **over: Any) -> NodeAnnouncement:
        fields: dict[str, Any] = {
            "node_id": self.node_id, "public_key": self.identity.public_key_text, "advertised_url": self.url,
            "model_id": self.models[0].model_id, "model_aliases": self.models[0].aliases, "first_layer": 0,
            "last_layer": 1, "total_layers": 2, "slots": self.slots, "node_version": "test", "state": "online",
            "models": self.models,
        }  # fmt: skip
        return NodeAnnouncement.model_validate({**fields, **over})

    async def register(self, **over: Any) -> None:
        self.client.audience = (await self.client.info()).issuer
        await self.client.register(self.announcement(**over))

    async def heartbeat(self) -> None:
        await self.client.heartbeat("online", NodeLoad(slots_total=self.slots, models=state_reports(self.models)))

    async def keep_beating(self, every_s: float) -> None:
        """Heartbeats until cancelled, as a node does: the tracker keeps it past its TTL."""
        while True:
            await self.heartbeat()
            await anyio.sleep(every_s)

    async def send_receipts(self) -> Any:
        receipts = [
            self.identity.sign_receipt(
                UsageRecord(
                    request_id=a["request_id"],
                    route="/v1/chat/completions",
                    model=a["model"],
                    status=200,
                    stream=False,
                    prompt_tokens=1,
                    completion_tokens=ANSWER_TOKENS,
                    finish_reason="stop",
                    started_at=time.time(),
                )
            )
            for a in self.answered
        ]
        return await self.client.send_receipts(receipts)

    async def _control(self, request: Request) -> Response:
        nonce = request.query_params.get(NODE_CONTROL_NONCE_PARAM, "")
        assert self.client.audience is not None
        return Response(NodeControlProof(token=self.identity.sign_control_proof(nonce, self.client.audience)).model_dump_json())

    async def _health(self, request: Request) -> Response:
        report = HealthReport(state="ready", model=self.models[0].model_id, slots_total=self.slots, slots_busy=self.held)
        return Response(report.model_dump_json(), media_type="application/json")

    async def _answer(self, request: Request) -> Response:
        claims = route_claims(request.headers[ROUTE_HEADER])
        request_id = request.headers[REQUEST_ID_HEADER]
        model = claims["model"]
        payload = await request.json()
        self.answered.append({"model": model, "request_id": request_id, "requested": payload["model"]})
        if (release := self.hold.get(model)) is not None:
            self.held += 1
            try:
                await release.wait()
            finally:
                self.held -= 1
        if payload.get("stream") is True:
            events = _events(model, self.load_s.pop(model, 0.0))
            return StreamingResponse(events, media_type="text/event-stream", headers={REQUEST_ID_HEADER: request_id})
        answer = {
            "id": request_id, "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": ANSWER_TOKENS, "total_tokens": 1 + ANSWER_TOKENS},
        }  # fmt: skip
        return JSONResponse(answer, headers={REQUEST_ID_HEADER: request_id})

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ModelsNode]:
        async with serve_asgi(self.app, self.port):
            try:
                yield self
            finally:
                for release in self.hold.values():
                    release.set()
                with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                    await self.client.aclose()
