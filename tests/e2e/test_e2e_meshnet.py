"""End to end on loopback: the reference tracker (`meshnet-gguf dev tracker`) in front of a real node
(`meshnet-gguf serve --tracker`) running the real llama-server on a tiny model, driven by the
official openai SDK. Both ledgers must agree; nothing may bypass the tracker; crashes of either
side lose nothing and double nothing."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.contract.protocol import ROUTE_HEADER
from meshnet_gguf.contract.signing import (
    body_sha256,
    encode_token,
    load_or_create_private_key,
    tracker_issuer_for,
)
from meshnet_gguf.mesh.tracker_client import TRACKER_KEY_PIN_FILE
from meshnet_gguf.reference.tracker.app import TRACKER_KEY_FILE
from support.relay_processes import billed_rows, node_ledger
from support.tracker_process import (  # noqa: F401
    MESSAGES,
    TrackerProcess,
    sdk,
    start_meshed_node,
    tracker,
    wait_for,
)

pytestmark = [pytest.mark.real_llama, pytest.mark.slow]


def test_openai_sdk_through_the_tracker_and_both_ledgers_agree(real_llama, tracker, tiny_gguf, start_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # No key configured: the node learns and pins the tracker's key on first contact (loopback).
    node = start_meshed_node(start_node, tracker, tiny_gguf, tmp_path / "node", **tracker.enrolment())
    assert (node.state_dir / TRACKER_KEY_PIN_FILE).read_text().strip() == tracker.public_key()
    assert tracker.serve_line()["MESHNET_TRACKER_PUBLIC_KEY"] == tracker.public_key()
    [announced] = [n["announcement"] for n in httpx.get(tracker.url + "/v1/nodes").json()]
    assert announced["shards"] == [
        {"name": tiny_gguf.name, "sha256": hashlib.sha256(tiny_gguf.read_bytes()).hexdigest(), "size": tiny_gguf.stat().st_size}
    ]
    assert (announced["first_layer"], announced["last_layer"], announced["total_layers"]) == (0, 1, 2)
    assert announced["hardware"]["summary"] and announced["llama_build"] and announced["slots"] == 2
    assert announced["model_aliases"] == [tiny_gguf.name] and announced["max_tokens_cap"] == 8192
    client = sdk(tracker)
    model = tiny_gguf.stem
    assert [m.id for m in client.models.list()] == [model]
    # Any name the node answers to is routed (here its file name, in other case), on a route for the node's own id.
    by_alias = client.chat.completions.create(model=tiny_gguf.name.upper(), messages=MESSAGES, max_tokens=2)
    assert by_alias.choices

    # ignore_eos: the random tiny model may sample its end token early, and these counts must be exact.
    exact = {"extra_body": {"ignore_eos": True}}
    plain = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, max_tokens=8, **exact)
    answer = plain.parse()
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    plain_id = plain.headers["x-meshnet-request-id"]

    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, stream=True))
    assert chunks and all(c.usage is None for c in chunks)  # the in-band meshnet-usage comment is invisible
    with_usage = list(
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=5, stream=True, stream_options={"include_usage": True}, **exact
        )
    )
    assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 5
    completion = client.completions.create(model=model, prompt="abc", max_tokens=4, **exact)
    assert completion.usage is not None and completion.usage.completion_tokens == 4

    wait_for(lambda: len(node_ledger(node.state_dir)) == 5 and all(r["reported"] for r in node_ledger(node.state_dir).values()),
             "every receipt acknowledged", node.log_path)  # fmt: skip
    ledger = node_ledger(node.state_dir)
    usage = {u["request_id"]: u for u in tracker.usage()}
    assert set(usage) == set(ledger) and plain_id in ledger
    for rid, row in ledger.items():
        assert usage[rid]["agreement"] == "agree", usage[rid]
        assert usage[rid]["billed"] == {"prompt_tokens": row["prompt"], "completion_tokens": row["completion"]}
    assert sorted(tracker.receipt_rows()) == sorted(ledger)
    assert httpx.get(f"{tracker.url}/v1/usage/{plain_id}").json()["node"]["completion_tokens"] == 8
    # Every receipt acknowledged: the node's own /metrics says its outbox is empty.
    assert "meshnet_billing_outbox_depth 0.0" in httpx.get(node.url + "/metrics", timeout=10).text

    usage_cli = subprocess.run(
        [sys.executable, "-m", "meshnet_gguf", "usage", "--state-dir", str(node.state_dir), "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    report = json.loads(usage_cli.stdout)
    assert report["totals"]["requests"] == 5 and report["totals"]["reported"] == 5 and report["totals"]["pending"] == 0

    node.signal(signal.SIGTERM)  # drain: the tracker hears `draining`, then the deregistration
    assert node.wait_exit() == 0
    assert httpx.get(tracker.url + "/v1/nodes").json() == []


def test_requests_that_did_not_come_through_the_tracker_never_reach_llama_server(  # type: ignore[no-untyped-def]
    real_llama, tracker, tiny_gguf, start_node, tmp_path
) -> None:
    # DEBUG: llama-server's routine lines (one `launch_slot_` per task) are what this test counts.
    node = start_meshed_node(start_node, tracker, tiny_gguf, tmp_path / "node", **tracker.serve_line(), MESHNET_LOG_LEVEL="DEBUG")
    node_id = httpx.get(tracker.url + "/v1/nodes").json()[0]["node_id"]
    # The test plays the tracker with its own key file, so it can mint every kind of bad route.
    tracker_key = load_or_create_private_key(tracker.state_dir / TRACKER_KEY_FILE)
    path = "/v1/chat/completions"
    # With the tracker gone, routes it signed still verify against the pinned key: the node keeps serving.
    tracker.kill()
    body = json.dumps({"model": tiny_gguf.stem, "messages": MESSAGES, "max_tokens": 4}, separators=(",", ":")).encode()
    tampered = body.replace(b'"max_tokens":4', b'"max_tokens":400')
    assert tampered != body

    def route(key: Ed25519PrivateKey = tracker_key, body_for: bytes = body, **over: Any) -> str:
        now = int(time.time())
        claims = {
            "iss": tracker_issuer_for(tracker_key.public_key()), "sub": node_id, "jti": f"req-{time.perf_counter_ns()}",
            "iat": now, "exp": now + 30, "path": path, "model": tiny_gguf.stem,
            "hops": [{"node_id": node_id, "first_layer": 0, "last_layer": 1}],
            "body_sha256": body_sha256(body_for), "max_tokens": 4,
        }  # fmt: skip
        return encode_token({**claims, **over}, key)

    def post(token: str | None, content: bytes = body) -> httpx.Response:
        headers = {"content-type": "application/json", **({ROUTE_HEADER: token} if token else {})}
        return httpx.post(node.url + path, content=content, headers=headers, timeout=30)

    def llama_tasks() -> int:
        return node.log_text().count("launch_slot_")

    before = llama_tasks()
    now = int(time.time())
    replayed = route()
    assert post(replayed).status_code == 200  # a proper route works (and is now used up)
    refusals = {
        "direct": (post(None), 401, "route_missing"),
        "forged": (post(route(key=Ed25519PrivateKey.generate())), 401, "route_bad_signature"),
        "expired": (post(route(iat=now - 60, exp=now - 30)), 401, "route_expired"),
        "replayed": (post(replayed), 403, "route_replayed"),
        "wrong node": (post(route(sub="node-someone-else")), 403, "route_wrong_node"),
        "tampered": (post(route(), content=tampered), 403, "route_body_mismatch"),
        "wrong model": (post(route(model="other")), 403, "route_wrong_model"),
        "partial": (post(route(hops=[{"node_id": node_id, "first_layer": 0, "last_layer": 0}])), 403, "route_coverage_mismatch"),
    }
    for name, (response, status, code) in refusals.items():
        assert (response.status_code, response.json().get("error", {}).get("code")) == (status, code), (name, response.text[:300])
    time.sleep(0.5)  # llama-server's log lines reach the node's log asynchronously
    assert llama_tasks() == before + 1, "only the properly routed request may reach llama-server"
    assert node.health().json()["usage"]["requests"] == 1
    assert len(node_ledger(node.state_dir)) == 1


def test_kill_9_with_unreported_usage_then_restart_reports_every_record_once(  # type: ignore[no-untyped-def]
    real_llama, tracker, tiny_gguf, start_node, tmp_path
) -> None:
    workdir = tmp_path / "node"
    serve_env = tracker.serve_line()
    # Receipts batch for ten minutes: they are certainly still unreported when the node dies.
    node = start_meshed_node(start_node, tracker, tiny_gguf, workdir, **serve_env, MESHNET_USAGE_REPORT_INTERVAL_S="600")
    client = sdk(tracker)
    for i in range(3):
        client.chat.completions.create(model=tiny_gguf.stem, messages=MESSAGES, max_tokens=3 + i, stream=bool(i % 2))
    # Settled, not just opened: a row is opened before forwarding, and one killed open is billed
    # its prompt only (its answer's tokens were never counted), which this test is not about.
    wait_for(lambda: [r["settled"] for r in node_ledger(node.state_dir).values()] == [True] * 3, "three settled rows", node.log_path)
    assert not any(r["reported"] for r in node_ledger(node.state_dir).values())
    node.signal(signal.SIGKILL)
    node.wait_exit()
    assert tracker.receipt_rows() == []

    restarted = start_meshed_node(start_node, tracker, tiny_gguf, workdir, **serve_env)
    wait_for(lambda: all(r["reported"] for r in node_ledger(restarted.state_dir).values()), "the backlog reported", restarted.log_path)
    ledger = node_ledger(restarted.state_dir)
    receipts = tracker.receipt_rows()
    assert sorted(receipts) == sorted(ledger) and len(receipts) == 3
    assert {u["request_id"]: u["agreement"] for u in tracker.usage()} == {rid: "agree" for rid in ledger}


def test_tracker_stopped_during_traffic_then_started_loses_and_doubles_nothing(  # type: ignore[no-untyped-def]
    real_llama, tracker, tiny_gguf, start_node, tmp_path
) -> None:
    node = start_meshed_node(start_node, tracker, tiny_gguf, tmp_path / "node", **tracker.serve_line())
    client = sdk(tracker)
    stop = threading.Event()
    outcomes: list[str] = []

    def traffic() -> None:
        while not stop.is_set():
            try:
                chunks = client.chat.completions.create(model=tiny_gguf.stem, messages=MESSAGES, max_tokens=24, stream=True)
                for _ in chunks:
                    pass
                outcomes.append("ok")
            except openai.OpenAIError:
                outcomes.append("failed")  # expected while the tracker is down
                time.sleep(0.05)

    workers = [threading.Thread(target=traffic) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        wait_for(lambda: outcomes.count("ok") >= 4, "traffic flowing")
        tracker.kill()  # mid-stream: relays die with it
        time.sleep(1.0)
        tracker.start()
        wait_for(lambda: tracker.models() == [tiny_gguf.stem], "the node re-registered", node.log_path)
        ok_before = outcomes.count("ok")
        wait_for(lambda: outcomes.count("ok") >= ok_before + 4, "traffic flowing again")
    finally:
        stop.set()
        for w in workers:
            w.join(30)
    assert "failed" in outcomes or any(u["outcome"] == "in_flight" for u in tracker.usage()), "the kill should hit traffic"

    wait_for(lambda: all(r["reported"] or r["rejected"] for r in node_ledger(node.state_dir).values()), "every receipt delivered",
             node.log_path)  # fmt: skip
    ledger = billed_rows(node_ledger(node.state_dir))
    receipts = tracker.receipt_rows()
    assert len(receipts) == len(set(receipts)) == len(ledger)  # nothing doubled
    assert set(receipts) == set(ledger)  # nothing lost
    usage = {u["request_id"]: u for u in tracker.usage()}
    assert set(ledger) <= set(usage)  # every request the node served was routed by the tracker
    assert not [u for u in usage.values() if u["agreement"] == "mismatch"]
    complete = [u for u in usage.values() if u["outcome"] == "complete"]
    assert len(complete) >= 8 and all(u["agreement"] == "agree" for u in complete)
