"""Forward at once, release at durability (protocol §6, rule 1): a meshed node sends a routed request
to llama-server while its ledger row is being synced, and holds the answer's first byte until the
row is on disk. The guard: a ledger whose commit takes 50 ms more, and a llama-server (the fake)
that notes when each request arrived. The request must arrive before the commit ends (the forward
did not wait for it), and the client's first byte after it (the answer did)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from meshnet_gguf.contract.protocol import ROUTE_HEADER
from meshnet_gguf.llama.binary import BinaryInfo
from support.billing_harness import LlamaChild, Tracker, serve_front

pytestmark = pytest.mark.anyio
JSON = {"content-type": "application/json"}
# Far above a loopback hop to llama-server (~0.2 ms) and below any timeout.
SLOW_COMMIT_S = 0.05


@pytest.mark.parametrize("stream", [True, False])
async def test_the_forward_does_not_wait_for_the_ledger_commit_and_the_first_byte_does(
    fake_llama: BinaryInfo, tiny_gguf: Path, tmp_path: Path, stream: bool
) -> None:
    request_log = tmp_path / "requests.jsonl"
    child = LlamaChild(fake_llama, tiny_gguf, env={"FAKE_LLAMA_REQUEST_LOG": str(request_log)})
    tracker = Tracker()
    commits_ended: list[float] = []
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream}).encode()
    try:
        async with serve_front(child.url, tracker=tracker, state_dir=tmp_path / "state") as front:
            assert front.identity is not None and front.ledger is not None
            # One request first: the upstream client's first use (its import, its first connection) is not
            # what this measures, and on a loaded machine it takes seconds.
            warm = tracker.route(front.identity.node_id, "/v1/chat/completions", body)
            async with httpx.AsyncClient(base_url=front.url, timeout=30) as client:
                assert (await client.post("/v1/chat/completions", content=body, headers={**JSON, ROUTE_HEADER: warm})).status_code == 200
            write = front.ledger.open_request_sync

            def slow_commit(*args: object) -> bool:
                time.sleep(SLOW_COMMIT_S)
                try:
                    return write(*args)  # type: ignore[arg-type]
                finally:
                    commits_ended.append(time.time())

            front.ledger.open_request_sync = slow_commit  # type: ignore[method-assign]
            token = tracker.route(front.identity.node_id, "/v1/chat/completions", body)
            async with httpx.AsyncClient(base_url=front.url, timeout=30) as client:
                async with client.stream("POST", "/v1/chat/completions", content=body, headers={**JSON, ROUTE_HEADER: token}) as answer:
                    first_byte_at = time.time()  # the status line and headers: the answer's first bytes
                    assert answer.status_code == 200
                    await answer.aread()
    finally:
        child.close()
    _, arrived = [json.loads(line)["at"] for line in request_log.read_text().splitlines()]
    [commit_ended] = commits_ended
    assert arrived < commit_ended, f"llama-server got the request {(arrived - commit_ended) * 1000:.1f} ms after the commit ended"
    assert first_byte_at >= commit_ended, (
        f"the client's first byte came {(commit_ended - first_byte_at) * 1000:.1f} ms before the commit ended"
    )
