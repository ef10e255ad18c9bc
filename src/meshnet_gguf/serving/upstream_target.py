"""Where llama-server answers right now, and the headers every call to it carries."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UpstreamTarget:
    """Where llama-server answers right now and the key it expects."""

    base_url: str
    api_key: str


def upstream_headers(target: UpstreamTarget, *, stream: bool = False) -> dict[str, str]:
    headers = {"authorization": f"Bearer {target.api_key}", "content-type": "application/json"}
    if stream:
        # llama-server closes the connection after every streamed answer; saying so up
        # front keeps the pool from handing that dead connection to the next request.
        headers["connection"] = "close"
    return headers


__all__ = ["UpstreamTarget", "upstream_headers"]
