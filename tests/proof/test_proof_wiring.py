"""Proof of model wired into the tracker, on the real llama-server with generated models: a node that
serves another model than it announces is caught at registration; one that switches after it passed
is caught at its next audited answer (rate 1.0 here) and its receipts since its last pass flagged; an
honest node is never refused; a verifier that is down only delays a new node's first route."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from support.llama_instance import Backend, llama_instance
from support.loopback import serve_asgi
from support.mesh_node import MODEL, MeshNode
from support.mesh_tracker import SECRET, start_tracker, tracker_key, wait_until

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.contract.model_proof import AUDIT_PATH, AUDIT_TOKEN_HEADER
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
from meshnet_gguf.proof.audit import audit
from meshnet_gguf.serving.audit_door import AuditDoor, audit_route
from meshnet_gguf.serving.routes import RouteTable
from meshnet_gguf.reference.tracker.audits import PROBE_PROMPTS, AuditPolicy

pytestmark = pytest.mark.anyio

SHAPE = TinyModelSpec(n_layers=4, n_embd=256, n_head=8, n_head_kv=4, n_ff=512)
EVERY_ANSWER = AuditPolicy(rate=1.0, new_node_rate=1.0)
# Honest answers audited in the switch test before the switch (M in docs/protocol.md): none refused.
HONEST_RUNS = 6
PROMPTS = ["The quick brown fox", "In the beginning there was", "My favourite food is", "Tell me about the sea"]
# How long a test waits for its drawn audits to be decided: a sampled answer costs the verifier a request per token
# where it diverges, and on a loaded 2-core box (the other test worker beside it) 60 s was seen to run out.
AUDITS_SETTLE_S = 180
# The near quant's audited answers asked at most before the test gives up on its refusal (it comes in about 8).
NEAR_QUANT_MOST_ANSWERS = 40


class SwitchableLlama:
    """The llama-server a node forwards to; the test may point it at another one (a node switching models)."""

    def __init__(self, url: str) -> None:
        self.url = url


@pytest.fixture(scope="module")
def llamas(real_llama: BinaryInfo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("wiring")
    claimed = write_tiny_model(folder / "claimed.gguf", SHAPE)
    other = write_tiny_model(folder / "other.gguf", TinyModelSpec(**{**SHAPE.__dict__, "seed": 1}))
    # The claimed weights themselves, stored as Q5_0: a near quant whose picks no token test tells from the claimed
    # model's (bench/RESULTS.md: 0 % refused within 50 audited answers by the tokens), about a third the size.
    near_quant = write_tiny_model(folder / "q5_0.gguf", TinyModelSpec(**{**SHAPE.__dict__, "weight_type": "Q5_0"}))
    cpu = Backend("cpu", threads=1, batch=512)
    with llama_instance(real_llama, claimed, Backend("cpu", threads=2, batch=32), folder / "v.log") as verifier, \
            llama_instance(real_llama, claimed, cpu, folder / "h.log") as honest, \
            llama_instance(real_llama, other, cpu, folder / "o.log") as impostor, \
            llama_instance(real_llama, near_quant, cpu, folder / "q.log") as quant:  # fmt: skip
        yield {"gguf": claimed, "verifier": verifier, "honest": honest, "other": impostor, "near_quant": quant}


@asynccontextmanager
async def verifier_at(port: int, llama_url: str, key: str) -> AsyncIterator[None]:
    async with serve_asgi(RouteTable([audit_route(AuditDoor(audit, llama_url, key))]), port):
        yield


@asynccontextmanager
async def mesh(
    tmp_path: Path, llamas: dict[str, Any], serving: str, *, verifier_up: bool = True
) -> AsyncIterator[tuple[Any, str, MeshNode, SwitchableLlama]]:
    key = tracker_key(tmp_path / "tracker")
    port = free_local_port()
    async with start_tracker(tmp_path, verifiers={MODEL: f"http://127.0.0.1:{port}"}, audit_policy=EVERY_ANSWER) as (tracker, url):
        llama = SwitchableLlama(llamas[serving])
        node = MeshNode(tmp_path / "node", llamas["gguf"], llama, tracker_url=url, tracker_key=key, enrolment_secret=SECRET)
        if verifier_up:
            async with verifier_at(port, llamas["verifier"], key), node.running():
                yield tracker, url, node, llama
        else:
            async with node.running():
                yield tracker, url, node, llama


def _audits(tracker: Any, node: MeshNode) -> Any:
    return tracker.auditor.record(node.node_id)


async def _ask(http: httpx.AsyncClient, url: str, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, **extra}
    return await http.post(url + "/v1/completions", json=body, timeout=120)


async def test_a_node_serving_another_model_is_caught_at_registration(tmp_path: Path, llamas: dict[str, Any]) -> None:
    async with mesh(tmp_path, llamas, "other") as (tracker, url, node, _), httpx.AsyncClient() as http:
        await wait_until(lambda: _async(_audits(tracker, node).failed > 0), timeout=60)
        entry = tracker.registry.get(node.node_id)
        assert entry.proof_blocked and entry.healthy
        refused = await _ask(http, url, "hello")
        assert refused.status_code == 503, refused.text  # never routed a client
        listed = (await http.get(url + "/v1/nodes")).json()[0]
        assert listed["audits"]["failed"] >= 1 and listed["audits"]["last_verdict"]["outcome"] == "failed"
        metrics = (await http.get(url + "/metrics")).text
        assert f'meshnet_tracker_audits_total{{outcome="failed"}} {float(listed["audits"]["failed"])}' in metrics
        assert 'meshnet_tracker_nodes{state="proof_blocked"} 1.0' in metrics


async def test_an_honest_node_passes_and_one_that_switches_is_caught_at_its_next_audited_answer(
    tmp_path: Path, llamas: dict[str, Any]
) -> None:
    async with mesh(tmp_path, llamas, "honest") as (tracker, url, node, llama), httpx.AsyncClient() as http:
        record = _audits(tracker, node)
        await wait_until(lambda: _async(_routed(tracker, node)), timeout=60)
        for i in range(HONEST_RUNS):  # greedy and sampled, chat and completions: none refused
            sampled = {"temperature": 0.8, "max_tokens": 48} if i % 2 else {}
            answer = await _ask(http, url, PROMPTS[i % len(PROMPTS)], **sampled)
            assert answer.status_code == 200, answer.text
        await wait_until(lambda: _async(tracker.auditor.outstanding == 0), timeout=AUDITS_SETTLE_S)
        assert record.failed == 0 and record.passed >= len(PROBE_PROMPTS) + HONEST_RUNS // 2  # sampled ones may be too short
        llama.url = llamas["other"]  # the node switches its weights under the same identity
        switched = await _ask(http, url, "Once upon a time")
        assert switched.status_code == 200  # the audit comes after the answer: the client got it
        await wait_until(lambda: _async(record.failed == 1), timeout=60)  # N = 1 audited answer
        assert (await _ask(http, url, "hello")).status_code == 503  # no longer routed
        usage = (await http.get(url + "/v1/usage?limit=100")).json()
        flagged = [u["request_id"] for u in usage if u["flagged"]]
        # The switched answer is flagged, with any answer after the last passed audit (a sampled one too short
        # for a verdict, say): all as not the model they claimed.
        assert switched.headers["x-meshnet-request-id"] in flagged, flagged
        assert [await tracker.ledger.flag_reason(request_id) for request_id in flagged] == ["model_unproven"] * len(flagged)
        # The tracker's metrics count what the audits did: every pass, the one failure, each answer drawn.
        metrics = (await http.get(url + "/metrics")).text
        assert f'meshnet_tracker_audits_total{{outcome="passed"}} {float(record.passed)}' in metrics
        assert 'meshnet_tracker_audits_total{outcome="failed"} 1.0' in metrics
        drawn = next(
            float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("meshnet_tracker_audit_answers_drawn_total")
        )
        assert drawn >= HONEST_RUNS + 1  # at this policy every answer is drawn: the honest ones and the switched one


async def test_a_client_steering_the_sampler_cannot_get_an_honest_node_refused(tmp_path: Path, llamas: dict[str, Any]) -> None:
    """A client's logit_bias (or grammar, schema, penalty) makes the honest node's greedy answer another than the claimed
    model's own: judged by re-generation it would be refused. Such answers are never drawn, at any rate."""
    async with mesh(tmp_path, llamas, "honest") as (tracker, url, node, _), httpx.AsyncClient() as http:
        record = _audits(tracker, node)
        await wait_until(lambda: _async(_routed(tracker, node)), timeout=60)
        passed = record.passed
        for steering in ({"logit_bias": {"5": 100}}, {"presence_penalty": 1.5}, {"frequency_penalty": 2.0}):
            answer = await _ask(http, url, "The quick brown fox", **steering)
            assert answer.status_code == 200, answer.text
        assert record.pending == 0 and tracker.auditor.outstanding == 0  # not drawn, though every answer is at rate 1.0
        plain = await _ask(http, url, "The quick brown fox")  # the same prompt unsteered is drawn, and passes
        assert plain.status_code == 200
        await wait_until(lambda: _async(record.passed == passed + 1), timeout=60)
        assert record.failed == 0 and _routed(tracker, node)


async def test_a_verifier_that_is_down_delays_a_new_node_and_never_refuses_it(tmp_path: Path, llamas: dict[str, Any]) -> None:
    key = tracker_key(tmp_path / "tracker")
    port = free_local_port()
    async with start_tracker(tmp_path, verifiers={MODEL: f"http://127.0.0.1:{port}"}, audit_policy=EVERY_ANSWER) as (tracker, url):
        node = MeshNode(tmp_path / "node", llamas["gguf"], SwitchableLlama(llamas["honest"]), tracker_url=url,
                        tracker_key=key, enrolment_secret=SECRET)  # fmt: skip
        async with node.running(), httpx.AsyncClient() as http:
            await wait_until(lambda: _async(tracker.registry.get(node.node_id) is not None
                                            and tracker.registry.get(node.node_id).healthy), timeout=30)  # fmt: skip
            await anyio.sleep(2)  # the probe's audits are retried meanwhile
            assert tracker.registry.get(node.node_id).proof_blocked and _audits(tracker, node).failed == 0
            async with verifier_at(port, llamas["verifier"], key):
                await wait_until(lambda: _async(_routed(tracker, node)), timeout=60)
                assert (await _ask(http, url, "hello")).status_code == 200
            assert _audits(tracker, node).failed == 0


async def test_the_verifier_refuses_an_audit_not_signed_by_its_tracker(tmp_path: Path, llamas: dict[str, Any]) -> None:
    port = free_local_port()
    async with verifier_at(port, llamas["verifier"], tracker_key(tmp_path / "tracker")), httpx.AsyncClient() as http:
        body = b'{"audit_id": "x", "model": "tiny", "path": "/v1/completions", "body": "{}", "answer_text": "hi"}'
        for token in (None, "not.a.token"):
            headers = {} if token is None else {AUDIT_TOKEN_HEADER: token}
            assert (await http.post(f"http://127.0.0.1:{port}{AUDIT_PATH}", content=body, headers=headers)).status_code == 401


async def test_a_node_that_failed_stays_refused_with_its_audits_listed_after_a_tracker_restart(
    tmp_path: Path, llamas: dict[str, Any]
) -> None:
    """The attacker fails its probe, then comes back with the right weights once the tracker restarted: the ledger
    kept its failure, so it is never routed again, and its audits and flagged answers are still listed."""
    key, port, tracker_port = tracker_key(tmp_path / "tracker"), free_local_port(), free_local_port()
    config: dict[str, Any] = {"verifiers": {MODEL: f"http://127.0.0.1:{port}"}, "audit_policy": EVERY_ANSWER, "port": tracker_port}
    async with verifier_at(port, llamas["verifier"], key), httpx.AsyncClient() as http:
        async with start_tracker(tmp_path, **config) as (tracker, url):
            node = MeshNode(tmp_path / "node", llamas["gguf"], SwitchableLlama(llamas["other"]), tracker_url=url, tracker_key=key,
                            enrolment_secret=SECRET)  # fmt: skip
            async with node.running():
                # Every probe answer decided: the probe asks its prompts one after another, so the queue is empty
                # between a verdict and the next prompt's answer.
                decided = lambda: _audits(tracker, node).passed + _audits(tracker, node).failed
                await wait_until(
                    lambda: _async(decided() >= len(PROBE_PROMPTS) and tracker.auditor.outstanding == 0), timeout=AUDITS_SETTLE_S
                )
                before = (await http.get(url + "/v1/nodes")).json()[0]["audits"]
                flagged_before = [u["request_id"] for u in (await http.get(url + "/v1/usage?limit=100")).json() if u["flagged"]]
        assert before["failed"] >= 1 and before["recent"][0]["outcome"] == "failed" and flagged_before

        async with start_tracker(tmp_path, **config) as (tracker, url):
            # Read back from the ledger before any node registers.
            record = _audits(tracker, node)
            assert (record.passed, record.failed, record.last_verdict.outcome) == (before["passed"], before["failed"], "failed")
            honest = MeshNode(tmp_path / "node", llamas["gguf"], SwitchableLlama(llamas["honest"]), tracker_url=url, tracker_key=key,
                              enrolment_secret=SECRET)  # fmt: skip
            assert honest.node_id == node.node_id  # the same identity, now with the claimed weights
            async with honest.running():
                await wait_until(lambda: _async(_healthy(tracker, honest)), timeout=30)
                await anyio.sleep(1)  # room for a probe, if one were (wrongly) asked
                assert tracker.registry.get(honest.node_id).proof_blocked
                assert (await _ask(http, url, "hello")).status_code == 503  # still never routed a client
                listed = (await http.get(url + "/v1/nodes")).json()[0]
                assert listed["proof_blocked"] and listed["audits"]["failed"] == before["failed"]
                assert [a["audit_id"] for a in listed["audits"]["recent"]] == [a["audit_id"] for a in before["recent"]]
                usage = (await http.get(url + "/v1/usage?limit=100")).json()
                assert set(flagged_before) <= {u["request_id"] for u in usage if u["flagged"]}
                page = (await http.get(url + "/dashboard.json")).json()["nodes"][0]["audits"]
                assert page["failed"] == before["failed"] and page["proof_blocked"]


async def test_a_node_serving_a_near_quant_of_the_claimed_weights_is_caught_by_its_committed_values(
    tmp_path: Path, llamas: dict[str, Any]
) -> None:
    """The attacker serves the claimed weights as Q5_0 and announces the claimed file: every token it picks is the
    claimed model's best or a near-tie, so the token tests pass it. The values its llama-server reports at each token
    (asked by the tracker on every answer) lie off the claimed model's a little on every token, and its audits in a row
    add up past the values' bound. Meanwhile clients that did not ask for log-probabilities never see them."""
    async with mesh(tmp_path, llamas, "near_quant") as (tracker, url, node, _), httpx.AsyncClient() as http, AsyncExitStack() as stack:
        record = _audits(tracker, node)
        await wait_until(lambda: _async(_routed(tracker, node) or record.failed > 0), timeout=60)
        client = await stack.enter_async_context(openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0))
        asked = 0
        while record.failed == 0 and asked < NEAR_QUANT_MOST_ANSWERS:
            prompt = PROMPTS[asked % len(PROMPTS)] + f" ({asked})"
            if asked % 2:
                stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stream=True)
                chunks = [chunk async for chunk in stream]
                assert chunks and all(c.choices[0].logprobs is None for c in chunks if c.choices)
            else:
                answer = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
                assert answer.choices[0].logprobs is None and answer.choices[0].text
            asked += 1
            await wait_until(lambda: _async(tracker.auditor.outstanding == 0), timeout=AUDITS_SETTLE_S)
        assert record.failed >= 1, f"{asked} answers audited, values CUSUM {record.values.s:.3f}"
        assert "log-probabilities" in record.last_verdict.reason
        assert record.drift.s < record.drift.rule.refuse_nats  # the tokens alone would have let it go on
        assert (await _ask(http, url, "hello")).status_code == 503


async def test_the_log_probabilities_a_client_asks_for_reach_it_and_an_honest_nodes_values_pass(
    tmp_path: Path, llamas: dict[str, Any]
) -> None:
    async with mesh(tmp_path, llamas, "honest") as (tracker, url, node, _), AsyncExitStack() as stack:
        record = _audits(tracker, node)
        await wait_until(lambda: _async(_routed(tracker, node)), timeout=60)
        client = await stack.enter_async_context(openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0))
        for i in range(HONEST_RUNS):
            if i % 2:  # the client's own: as many tops as it asked, where the tracker asks 4 of its own
                answer = await client.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=24,
                                                         temperature=0, logprobs=2)  # fmt: skip
                assert answer.choices[0].logprobs is not None
            else:
                chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i % 4]}],
                                                            max_tokens=24, temperature=0.8)  # fmt: skip
                assert chat.choices[0].logprobs is None
        await wait_until(lambda: _async(tracker.auditor.outstanding == 0), timeout=AUDITS_SETTLE_S)
        assert record.failed == 0 and record.values.answers >= len(PROBE_PROMPTS) and record.values.s == 0.0


def _healthy(tracker: Any, node: MeshNode) -> bool:
    entry = tracker.registry.get(node.node_id)
    return entry is not None and entry.healthy


def _routed(tracker: Any, node: MeshNode) -> bool:
    entry = tracker.registry.get(node.node_id)
    return entry is not None and entry.healthy and not entry.proof_blocked


async def _async(value: bool) -> bool:
    return value
