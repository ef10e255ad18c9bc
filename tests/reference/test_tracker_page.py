"""The tracker's page: in headless Chromium against a real `dev tracker` and a node that registers,
and its JSON in process for what a browser test cannot stage (a flagged disagreement)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from meshnet_gguf.contract.protocol import TrackerUsage, UsageCounts, UsageRecord
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.reference.tracker.ledger import TRACKER_LEDGER_FILE, NodeEarnings, TrackerLedger
from meshnet_gguf.reference.tracker.page import dashboard_document
from support.browser import Browser, screenshot_target
from support.node_process import StartNode
from support.tracker_process import MESSAGES, TrackerProcess, sdk, start_meshed_node, tracker  # noqa: F401


@pytest.mark.real_llama
@pytest.mark.slow
def test_the_tracker_page_lists_a_node_that_registers_and_the_requests_it_routed(  # type: ignore[no-untyped-def]
    browser: Browser, real_llama: BinaryInfo, tracker: TrackerProcess, tiny_gguf: Path, start_node: StartNode, tmp_path: Path
) -> None:
    browser.goto(tracker.url + "/")
    browser.wait_for("document.getElementById('summary').textContent === '0 node(s), 0 online'")

    node = start_meshed_node(start_node, tracker, tiny_gguf, tmp_path / "node")
    browser.wait_for("document.getElementById('nodes').innerText.includes('online')")
    nodes = browser.text_of("nodes", "innerText")
    assert "tiny" in nodes and "direct" in nodes and "0 / 2" in nodes
    assert "not audited" in nodes  # this tracker names no verifier: proof of model says so in words

    answer = sdk(tracker).chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=4)
    request_id = answer.headers["x-meshnet-request-id"]
    browser.wait_for(f"document.getElementById('routes').innerText.includes({json.dumps(request_id[:12])})")
    browser.wait_for("document.getElementById('routes').innerText.includes('agree')", timeout=30)
    assert "counts agree" in str(browser.evaluate("document.getElementById('disagreements').textContent"))
    if (target := screenshot_target("tracker-page.png")) is not None:
        browser.screenshot(target)

    # The meshed node's own page answers on its machine and names its tracker; no chat there.
    status = httpx.get(node.url + "/status.json", timeout=10).json()
    assert status["tracker"] == tracker.url and status["chat"] is False
    assert httpx.get(node.url + "/chat/", timeout=10).status_code == 404


class _Ledger:
    def __init__(self, usage: list[TrackerUsage]) -> None:
        self._usage = usage

    async def usage_list(self, *, request_id: str | None = None, limit: int = 100) -> list[TrackerUsage]:
        return self._usage[:limit]

    async def billed_by_node(self) -> dict[str, NodeEarnings]:
        return {}

    async def billed_by_node_and_model(self) -> dict[str, dict[str, NodeEarnings]]:
        return {}


@pytest.mark.anyio
async def test_a_disagreement_is_flagged_on_the_page() -> None:
    agree = TrackerUsage(
        request_id="r1", node_id="n1", model="tiny", stream=False, tracker=UsageCounts(prompt_tokens=5, completion_tokens=4),
        node=UsageCounts(prompt_tokens=5, completion_tokens=4), agreement="agree",
    )  # fmt: skip
    differs = agree.model_copy(update={"request_id": "r2", "agreement": "mismatch", "flagged": True,
                                       "node": UsageCounts(prompt_tokens=5, completion_tokens=400)})  # fmt: skip
    stand_in: Any = SimpleNamespace(registry=SimpleNamespace(all=lambda: []), ledger=_Ledger([differs, agree]))
    document = await dashboard_document(stand_in)
    assert document["disagreements"] == 1
    assert [u["flagged"] for u in document["recent_routes"]] == [True, False]


@pytest.mark.anyio
async def test_every_column_is_explained_and_no_figure_reads_as_a_question_mark(  # type: ignore[no-untyped-def]
    browser: Browser, tracker: TrackerProcess
) -> None:
    """Rows of each kind the ledger holds (a stream with its receipt, a whole answer awaiting its receipt,
    one in flight, one refused by a node that was not there), written into a real `dev tracker`'s ledger."""
    ledger = TrackerLedger(tracker.state_dir / TRACKER_LEDGER_FILE)
    try:
        path = "/v1/chat/completions"
        await ledger.open_request("req-stream", "node-a", "tiny", path, True, max_tokens=8, prompt_ceiling=150)
        await ledger.finish_request("req-stream", 200, "complete", UsageCounts(completion_tokens=5), completion_ceiling=7)
        record = UsageRecord(request_id="req-stream", route=path, model="tiny", status=200, stream=True, prompt_tokens=9,
                             completion_tokens=5, finish_reason="stop", started_at=1.0)  # fmt: skip
        await ledger.store_receipt("node-a", record, "token")
        await ledger.open_request("req-whole", "node-a", "tiny", path, False, max_tokens=8, prompt_ceiling=150)
        await ledger.finish_request("req-whole", 200, "complete", UsageCounts(), completion_ceiling=8)
        await ledger.open_request("req-going", "node-a", "tiny", path, True, max_tokens=8, prompt_ceiling=150)
        await ledger.open_request("req-refused", "node-b", "tiny", path, True, max_tokens=8, prompt_ceiling=150)
        await ledger.finish_request("req-refused", None, "refused", None)
        # Earned: the one request with a receipt and ceilings, each figure capped (9 <= 150, 5 <= 7); the refused bills nothing.
        assert await ledger.billed_by_node() == {"node-a": NodeEarnings(requests=1, prompt_tokens=9, completion_tokens=5)}
        assert await ledger.billed_by_node_and_model() == {"node-a": {"tiny": NodeEarnings(1, 9, 5)}}  # the same, by model
    finally:
        ledger.close()

    browser.goto(tracker.url + "/")
    browser.wait_for("document.getElementById('routes').innerText.includes('req-stream')")
    routes = str(browser.text_of("routes", "innerText"))
    assert "?" not in routes
    by_id = {line.split("\t")[0]: line.split("\t")[3:] for line in routes.splitlines()}
    assert by_id["req-stream"] == ["complete (200)", "5 token events", "9 / 5", "9 / 5", "agree"]
    assert by_id["req-whole"] == [
        "complete (200)",
        "no stream: bounded by its text",
        "no receipt yet",
        "not yet (no receipt)",
        "awaiting receipt",
    ]
    assert by_id["req-going"] == ["in flight", "counting…", "no receipt yet", "not yet (in flight)", "awaiting receipt"]
    assert by_id["req-refused"][0] == "refused (no answer)" and by_id["req-refused"][3] == "0 / 0"
    ceiling = browser.evaluate(
        "[...document.querySelectorAll('#routes tr')].find(tr => tr.cells[0].textContent === 'req-stream').cells[4].title"
    )
    assert ceiling == "ceiling: at most 150 prompt / 7 completion tokens"
    # Each column of both tables has its line in the legend under it.
    for table, legend in (("nodes", "nodes-legend"), ("routes", "routes-legend")):
        headers = browser.evaluate(
            f"[...document.getElementById('{table}').closest('table').querySelectorAll('th')].map(th => th.textContent)"
        )
        explained = browser.evaluate(f"[...document.querySelectorAll('#{legend} dt')].map(dt => dt.textContent)")
        assert headers == explained
    assert "Audits" in explained_nodes(browser)
    # The Audits column in words for each state a node's audits can be in: the page's own render, given
    # /dashboard.json's shape (a real tracker with a verifier shows them in tests/proof/test_proof_wiring.py).
    cells = browser.evaluate(_RENDER_AUDITS)
    assert cells == [
        ["n-none", "not audited", "muted"],
        ["n-new", "none audited yet", "muted"],
        ["n-probing", "probing: 1 passed, 2 pending", "muted"],
        ["n-passed", "5 passed, 1 pending", ""],
        ["n-failed", "FAILED 1, passed 3: not routed", "flag"],
    ]
    assert "?" not in str(cells)
    # What each node got, beside its speed: its share of the last requests and what it was billed for.
    assert browser.evaluate(_RENDER_MARKET) == [
        ["n-new", "no request yet", "nothing billed yet"],
        ["n-busy", "33 % (20 of the last 60)", "20 request(s): 1,234 prompt + 567 completion tokens"],
    ]


def explained_nodes(browser: Browser) -> list[str]:
    return list(browser.evaluate("[...document.querySelectorAll('#nodes-legend dt')].map(dt => dt.textContent)"))


_RENDER_AUDITS = """(() => {
  const node = (id, audits) => ({node_id: id, model: "tiny", quant: null, state: "online", node_state: "ready", healthy: true,
    slots_total: 1, slots_busy: 0, tokens_per_s: null, reached: "direct", relay_url: null, advertised_url: "http://127.0.0.1:1",
    last_seen_s_ago: 0, health_misses: 0, routed: 0, speed: null, audits});
  const audits = (passed, failed, pending, proof_blocked, last) => ({passed, failed, pending, proof_blocked, recent: [],
    last_verdict: last ? {outcome: last, reason: "why"} : null});
  render({nodes: [node("n-none", null), node("n-new", audits(0, 0, 0, false, null)), node("n-probing", audits(1, 0, 2, true, "passed")),
                  node("n-passed", audits(5, 0, 1, false, "passed")), node("n-failed", audits(3, 1, 0, true, "failed"))],
          recent_routes: [], disagreements: 0, poll_interval_s: 2});
  const column = [...document.getElementById("nodes").closest("table").querySelectorAll("th")].findIndex(th => th.textContent === "Audits");
  return [...document.querySelectorAll("#nodes tr")].map(tr => [tr.cells[0].title, tr.cells[column].textContent, tr.cells[column].className]);
})()"""


_RENDER_MARKET = """(() => {
  const node = (id, recent_share, earned) => ({node_id: id, model: "tiny", quant: null, state: "online", node_state: "ready",
    healthy: true, slots_total: 1, slots_busy: 0, tokens_per_s: null, reached: "direct", relay_url: null,
    advertised_url: "http://127.0.0.1:1", last_seen_s_ago: 0, health_misses: 0, routed: 0, speed: null, audits: null,
    recent_share, earned});
  render({nodes: [node("n-new", {requests: 0, of_last: 0, share: null}, {requests: 0, prompt_tokens: 0, completion_tokens: 0}),
                  node("n-busy", {requests: 20, of_last: 60, share: 0.333}, {requests: 20, prompt_tokens: 1234, completion_tokens: 567})],
          recent_routes: [], disagreements: 0, poll_interval_s: 2});
  const headers = [...document.getElementById("nodes").closest("table").querySelectorAll("th")].map(th => th.textContent);
  const [share, earned] = [headers.indexOf("Share"), headers.indexOf("Earned")];
  return [...document.querySelectorAll("#nodes tr")].map(tr => [tr.cells[0].title, tr.cells[share].textContent, tr.cells[earned].textContent]);
})()"""
