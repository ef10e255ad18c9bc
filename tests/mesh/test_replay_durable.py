"""Replay protection that survives a crash at any instant: a route's request id is on disk before
anything is forwarded, with the route's own expiry, and a restart refuses every id whose route
has not expired. Rows a crash left open are settled, once, at the next start."""

from __future__ import annotations

import base64
import json
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.protocol import ROUTE_HEADER, UsageRecord
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.ledger import LEDGER_FILE, UsageLedger
from meshnet_gguf.mesh.tracker_link import seed_replay_cache
from meshnet_gguf.mesh.meshed_mode import RouteGate
from meshnet_gguf.mesh.receipts import settle_interrupted
from meshnet_gguf.serving.admission_modes import RouteGrant
from support.billing_harness import MODEL_ID, TOTAL_LAYERS, LlamaChild, Tracker, serve_front

JSON = {"content-type": "application/json"}


def open_record(rid: str, prompt: int = 42) -> UsageRecord:
    return UsageRecord(request_id=rid, route="/v1/chat/completions", model="tiny", status=0, stream=True,
                       prompt_tokens=prompt, started_at=time.time())  # fmt: skip


def seeded_gate(state_dir: Path, tracker: Tracker, identity: NodeIdentity) -> RouteGate:
    """What a restarted tracker link does: a gate, then the replay cache seeded from the ledger."""
    gate = RouteGate(identity.node_id, MODEL_ID, TOTAL_LAYERS, tracker.key.public_key())
    ledger = UsageLedger.in_state_dir(state_dir)
    seed_replay_cache(gate.replay_cache, ledger)
    ledger.close()
    return gate


def test_an_open_row_refuses_its_route_after_a_restart(tmp_path: Path) -> None:
    tracker = Tracker()
    identity = NodeIdentity.load_or_create(tmp_path)
    ledger = UsageLedger.in_state_dir(tmp_path)
    expires = time.time() + 50
    assert ledger.open_request_sync(open_record("req-open"), expires)
    assert not ledger.open_request_sync(open_record("req-open"), expires)  # the id is taken, on disk
    ledger.close()  # the process dies here: the request was forwarded, never finished

    gate = seeded_gate(tmp_path, tracker, identity)
    with pytest.raises(ApiError) as refused:
        gate.claim(RouteGrant(request_id="req-open", expires_at=expires))
    assert (refused.value.status, refused.value.code) == (403, "route_replayed")
    gate.claim(RouteGrant(request_id="req-other", expires_at=expires))  # other routes still pass


def test_an_expired_route_is_not_kept_and_a_route_long_lived_is_kept_to_its_own_expiry(tmp_path: Path) -> None:
    ledger = UsageLedger.in_state_dir(tmp_path)
    now = time.time()
    ledger.open_request_sync(open_record("req-old"), now - 120)
    ledger.open_request_sync(open_record("req-new"), now + 55)
    assert [rid for rid, _ in ledger.unexpired_routes_sync(now)] == ["req-new"]
    assert ledger.unexpired_routes_sync(now)[0][1] == pytest.approx(now + 55)
    ledger.close()


def test_rows_left_open_are_settled_once_with_their_prompt(tmp_path: Path) -> None:
    identity = NodeIdentity.load_or_create(tmp_path)
    ledger = UsageLedger.in_state_dir(tmp_path)
    ledger.open_request_sync(open_record("req-cut", prompt=1500), time.time() + 30)
    assert ledger.pending_sync(10) == []  # an open row is not a receipt yet
    assert settle_interrupted(ledger, identity) == 1
    assert settle_interrupted(ledger, identity) == 0  # a second start settles nothing again
    [entry] = ledger.entries_sync()
    assert (entry.record.prompt_tokens, entry.record.finish_reason, entry.outbox_state) == (1500, "error", "pending")
    assert [r.request_id for r in ledger.pending_sync(10)] == ["req-cut"]
    ledger.close()


def test_a_version_1_ledger_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / LEDGER_FILE
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE usage (request_id TEXT PRIMARY KEY, recorded_at REAL NOT NULL, started_at REAL NOT NULL,"
        " model TEXT NOT NULL, route TEXT NOT NULL, status INTEGER NOT NULL, stream INTEGER NOT NULL,"
        " prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,"
        " finish_reason TEXT NOT NULL, record_json TEXT NOT NULL, receipt TEXT NOT NULL, reported_at REAL, rejected TEXT);"
        "PRAGMA user_version=1;"
    )
    record = open_record("req-v1")
    db.execute("INSERT INTO usage VALUES (?, ?, ?, 'tiny', '/v1/chat/completions', 200, 1, 1, 0, 1, 'stop', ?, 'tok', NULL, NULL)",
               ("req-v1", time.time(), time.time(), record.model_dump_json()))  # fmt: skip
    db.commit()
    db.close()
    ledger = UsageLedger(path)
    assert [r.request_id for r in ledger.pending_sync(10)] == ["req-v1"]
    assert ledger.open_request_sync(open_record("req-v2"), time.time() + 30)
    ledger.close()


@pytest.mark.anyio
async def test_a_served_route_is_kept_to_its_own_expiry_and_an_unwritable_ledger_delivers_and_bills_nothing(
    fake_llama: BinaryInfo, tiny_gguf: Path, tmp_path: Path
) -> None:
    request_log = tmp_path / "requests.jsonl"
    child = LlamaChild(fake_llama, tiny_gguf, env={"FAKE_LLAMA_REQUEST_LOG": str(request_log)})
    tracker = Tracker()
    state_dir = tmp_path / "state"
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    try:
        async with serve_front(child.url, tracker=tracker, state_dir=state_dir) as front:
            assert front.identity is not None and front.ledger is not None
            token = tracker.route(front.identity.node_id, "/v1/chat/completions", body)
            async with httpx.AsyncClient(base_url=front.url, timeout=30) as client:
                first = await client.post("/v1/chat/completions", content=body, headers={**JSON, ROUTE_HEADER: token})
                again = await client.post("/v1/chat/completions", content=body, headers={**JSON, ROUTE_HEADER: token})
            assert first.status_code == 200
            assert (again.status_code, again.json()["error"]["code"]) == (403, "route_replayed")
            [(rid, expires)] = front.ledger.unexpired_routes_sync(time.time())
            claims_exp = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "==").decode())["exp"]
            assert rid == first.headers["x-meshnet-request-id"] and expires == claims_exp
            # A disk that fails: the request was forwarded while its row was being written (protocol
            # §6, rule 1), but no byte of its answer reaches the client and no usage is recorded.
            front.ledger.close()
            second = tracker.route(front.identity.node_id, "/v1/chat/completions", body)
            async with httpx.AsyncClient(base_url=front.url, timeout=30) as client:
                refused = await client.post("/v1/chat/completions", content=body, headers={**JSON, ROUTE_HEADER: second})
            assert refused.status_code == 503 and b"choices" not in refused.content
            assert [r.request_id for r in front.sink.records] == [first.headers["x-meshnet-request-id"]]
    finally:
        child.close()
    assert len(request_log.read_text().splitlines()) == 2


@pytest.mark.anyio
async def test_a_replayed_route_is_refused_before_its_prompt_is_counted_or_a_slot_taken(
    fake_llama: BinaryInfo, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshnet_gguf.serving.slots import Slots
    from meshnet_gguf.serving.prompt_count import PromptCounter

    work: list[str] = []
    counted, acquire = PromptCounter.count, Slots.try_acquire

    async def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        work.append("prompt counted")
        return await counted(self, *args, **kwargs)

    def acquiring(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        work.append("slot taken")
        return acquire(self, *args, **kwargs)

    monkeypatch.setattr(PromptCounter, "count", counting)
    monkeypatch.setattr(Slots, "try_acquire", acquiring)
    child = LlamaChild(fake_llama, tiny_gguf)
    tracker = Tracker()
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    try:
        async with serve_front(child.url, tracker=tracker, state_dir=tmp_path / "state") as front:
            assert front.identity is not None
            token = tracker.route(front.identity.node_id, "/v1/chat/completions", body)
            async with httpx.AsyncClient(base_url=front.url, timeout=30) as client:
                assert (await client.post("/v1/chat/completions", content=body, headers={**JSON, ROUTE_HEADER: token})).status_code == 200
                done_by_first = list(work)
                # Its answer carried llama-server's prompt count: nothing was counted, a slot was taken.
                assert done_by_first == ["slot taken"]
                again = await client.post("/v1/chat/completions", content=body, headers={**JSON, ROUTE_HEADER: token})
            assert (again.status_code, again.json()["error"]["code"]) == (403, "route_replayed")
            assert work == done_by_first  # the replay cost the node no count and no slot
    finally:
        child.close()
