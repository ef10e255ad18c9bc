"""Wire models shared by the node, the reference tracker and the relay. No I/O here.

`docs/protocol.md` is the prose contract; these models are its machine form.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

PROTOCOL_VERSION = "1"

FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "error", "rejected", "unknown"]
NodeState = Literal["starting", "loading", "ready", "restarting", "draining", "stopped", "failed"]


class UsageRecord(BaseModel):
    """What one proxied request used. Exactly one per request, whatever its end."""

    request_id: str
    route: str = Field(description="API path, e.g. /v1/chat/completions")
    model: str
    status: int = Field(description="HTTP status the client received")
    stream: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason = "unknown"
    started_at: float = Field(description="Unix time the request was admitted")
    duration_s: float = 0.0
    ttft_s: float | None = Field(None, description="Time to first token (first content byte for streams)")
    decode_tokens_per_s: float | None = None


class UsageTotals(BaseModel):
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    cancelled: int = 0


class HealthReport(BaseModel):
    """`GET /health` body. 200 only when `state == "ready"`."""

    protocol_version: str = PROTOCOL_VERSION
    state: NodeState
    detail: str | None = None
    model: str | None = None
    quant: str | None = None
    slots_total: int = 0
    slots_busy: int = 0
    uptime_s: float = 0.0
    restarts: int = 0
    recent_tokens_per_s: float | None = None
    load_progress: float | None = Field(None, description="0..1 while loading, when llama-server says")
    usage: UsageTotals = Field(default_factory=UsageTotals)
    node_version: str | None = None
    llama_build: str | None = None
