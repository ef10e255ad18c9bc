"""The mesh knows each model a node serves: the reference tracker over real loopback HTTP in front of nodes that
announce several models with their states (`support.models_node`, real keys and signed calls), and a node built
from the real parts announcing its models (`support.mesh_node`).

Node "a" serves alpha (loaded) and beta (loadable, 5 s to load); node "b" serves beta, loaded, with one slot.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from support.browser import Browser
from support.mesh_node import MODEL, FakeLlama, MeshNode
from support.mesh_tracker import HEARTBEAT_S, SECRET, models, start_tracker, wait_until
from support.models_node import ModelsNode

from meshnet_gguf.contract.protocol import (
    ENROLMENT_HEADER,
    MAX_ANNOUNCED_MODELS,
    MAX_MODEL_NAME_CHARS,
    AnnouncedModel,
    NodeAnnouncement,
    NodeCapability,
    NodeLoad,
    RatePoint,
)
from meshnet_gguf.reference.tracker.app import Tracker
from meshnet_gguf.reference.tracker.node_address import NodeTarget
from meshnet_gguf.reference.tracker.node_speed import TRUST_AFTER_SAMPLES, StreamSample
from meshnet_gguf.reference.tracker.registry import NodeRegistry
from meshnet_gguf.reference.tracker.request_io import MAX_CONTROL_BODY_BYTES

pytestmark = pytest.mark.anyio

LOAD_S = 5.0
SLOW_LOAD_S = 0.5
ALPHA = AnnouncedModel(model_id="alpha", aliases=["alpha-q4"])
BETA_COLD = AnnouncedModel(model_id="beta", aliases=["beta-q4"], state="loadable", expected_load_s=LOAD_S)
BETA_WARM = AnnouncedModel(model_id="beta", slots=1)


@pytest.fixture
async def tracker(tmp_path: Path) -> AsyncIterator[tuple[Tracker, str]]:
    async with start_tracker(tmp_path) as running:
        yield running


async def ask(http: httpx.AsyncClient, url: str, model: str) -> httpx.Response:
    return await http.post(url + "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}]})


async def routable(service: Tracker, model: str, count: int) -> None:
    async def ready() -> bool:
        return len(service.registry.routable(model)) == count

    await wait_until(ready)


@asynccontextmanager
async def registered(service: Tracker, model: str, *nodes: ModelsNode) -> AsyncIterator[httpx.AsyncClient]:
    """`nodes` running and registered, each routable for `model`; a client for the tracker meanwhile."""
    async with AsyncExitStack() as stack:
        for node in nodes:
            await stack.enter_async_context(node.running())
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=10))
        for node in nodes:
            await node.register()
        await routable(service, model, len(nodes))
        yield http


async def node_view(http: httpx.AsyncClient, url: str, node_id: str) -> dict[str, Any]:
    return next(n for n in (await http.get(url + "/v1/nodes")).json() if n["node_id"] == node_id)


def states(view: dict[str, Any]) -> dict[str, tuple[str, float | None]]:
    return {m["model"]: (m["state"], m["expected_load_s"]) for m in view["models"]}


async def test_a_model_goes_to_the_node_where_it_is_loaded_and_to_a_cold_one_when_that_one_is_full(
    tmp_path: Path, tracker: tuple[Tracker, str]
) -> None:
    service, url = tracker
    a = ModelsNode(tmp_path / "a", url, [ALPHA, BETA_COLD])
    b = ModelsNode(tmp_path / "b", url, [BETA_WARM], slots=1)
    async with registered(service, "beta", a, b) as http:
        for _ in range(3):  # one at a time: b always has its slot free
            answer = await ask(http, url, "beta")
            assert answer.status_code == 200 and answer.json()["model"] == "beta"
        assert [x["model"] for x in b.answered] == ["beta"] * 3 and a.answered == []  # warm wins over cold

        b.hold["beta"] = anyio.Event()  # b's one slot for beta stays busy
        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, http, url, "beta")
            with anyio.fail_after(5):
                while b.held == 0:
                    await anyio.sleep(0.02)
            answer = await ask(http, url, "beta")
            assert answer.status_code == 200
            assert [x["model"] for x in a.answered] == ["beta"]  # no warm node free: the cold one, its route for beta
            view = await node_view(http, url, a.node_id)
            beta = next(m for m in view["models"] if m["model"] == "beta")
            assert beta["state"] == "loadable" and beta["loading"] and 0 < beta["cold_load_s"] <= LOAD_S
            b.hold["beta"].set()

        answer = await ask(http, url, "beta-q4")  # only a answers to this alias: routed as a's own id for it
        assert answer.status_code == 200 and a.answered[-1] == {**a.answered[-1], "model": "beta", "requested": "beta-q4"}
        answer = await ask(http, url, "alpha")
        assert answer.status_code == 200 and a.answered[-1]["model"] == "alpha"


async def test_a_model_no_node_announces_is_a_404_in_openais_error_shape(tmp_path: Path, tracker: tuple[Tracker, str]) -> None:
    service, url = tracker
    a = ModelsNode(tmp_path / "a", url, [ALPHA, BETA_COLD])
    async with registered(service, "beta", a) as http:
        answer = await ask(http, url, "gamma")
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert error["code"] == "model_not_found" and "gamma" in error["message"] and error["type"]
        assert a.answered == []


async def test_each_request_is_recorded_and_billed_as_the_model_it_was_served_as(tmp_path: Path, tracker: tuple[Tracker, str]) -> None:
    service, url = tracker
    a = ModelsNode(tmp_path / "a", url, [ALPHA, BETA_COLD])
    async with registered(service, "beta", a) as http:
        for model in ("alpha", "beta-q4", "beta"):
            assert (await ask(http, url, model)).status_code == 200
        for answered in a.answered:
            usage = (await http.get(f"{url}/v1/usage/{answered['request_id']}")).json()
            assert usage["model"] == answered["model"] and usage["node_id"] == a.node_id
        ack = await a.send_receipts()  # the receipts name the model each route named: accepted
        assert sorted(ack.accepted) == sorted(x["request_id"] for x in a.answered) and not ack.rejected
        earned = {m["model"]: m["earned"]["requests"] for m in (await node_view(http, url, a.node_id))["models"]}
        assert earned == {"alpha": 1, "beta": 2}


async def test_nodes_the_page_and_models_show_each_models_state_per_node(tmp_path: Path, tracker: tuple[Tracker, str]) -> None:
    service, url = tracker
    a = ModelsNode(tmp_path / "a", url, [ALPHA, BETA_COLD])
    b = ModelsNode(tmp_path / "b", url, [BETA_WARM], slots=1)
    async with registered(service, "beta", a, b) as http:
        assert states(await node_view(http, url, a.node_id)) == {"alpha": ("loaded", None), "beta": ("loadable", LOAD_S)}
        assert states(await node_view(http, url, b.node_id)) == {"beta": ("loaded", None)}
        page = {n["node_id"]: n for n in (await http.get(url + "/dashboard.json")).json()["nodes"]}
        assert states(page[a.node_id]) == {"alpha": ("loaded", None), "beta": ("loadable", LOAD_S)}
        listed = {m["id"]: m for m in (await http.get(url + "/v1/models")).json()["data"]}
        assert set(listed) == {"alpha", "beta"}
        assert (listed["beta"]["meshnet_nodes"], listed["beta"]["meshnet_loaded_on"]) == (2, 1)

        a.models = [ALPHA, BETA_COLD.model_copy(update={"state": "loaded"})]  # a loaded beta: its heartbeat says so
        await a.heartbeat()
        assert states(await node_view(http, url, a.node_id))["beta"] == ("loaded", LOAD_S)
        listed = {m["id"]: m for m in (await http.get(url + "/v1/models")).json()["data"]}
        assert listed["beta"]["meshnet_loaded_on"] == 2

        a.models = [ALPHA, BETA_COLD.model_copy(update={"state": "unavailable"})]  # its load failed: not routed there
        await a.heartbeat()
        await routable(service, "beta", 1)
        assert service.registry.routable("beta")[0].node_id == b.node_id


async def test_the_tracker_page_shows_each_models_state_on_a_node(tmp_path: Path, tracker: tuple[Tracker, str], browser: Browser) -> None:
    service, url = tracker
    a = ModelsNode(tmp_path / "a", url, [ALPHA, BETA_COLD])

    def look() -> str:  # the browser's calls block: off the loop that serves the tracker
        browser.goto(url + "/")
        browser.wait_for("document.getElementById('nodes').innerText.includes('beta: loadable')")
        return str(browser.text_of("nodes", "innerText"))

    async with a.running(), anyio.create_task_group() as tg:
        await a.register()
        await routable(service, "beta", 1)
        tg.start_soon(a.keep_beating, HEARTBEAT_S)
        shown = await anyio.to_thread.run_sync(look)
        tg.cancel_scope.cancel()
    assert "alpha: loaded" in shown and f"beta: loadable, ~{LOAD_S:.1f} s load" in shown


async def signed_registration(node: ModelsNode, url: str, announcement: dict[str, Any]) -> httpx.Response:
    """A registration as an enrolled node with a valid key sends it, whatever its body says."""
    body = json.dumps(announcement).encode()
    node.client.audience = (await node.client.info()).issuer
    auth = node.identity.request_auth("POST", "/v1/nodes/register", body, node.client.audience)
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(
            url + "/v1/nodes/register", content=body,
            headers={"authorization": f"Bearer {auth}", ENROLMENT_HEADER: SECRET, "content-type": "application/json"},
        )  # fmt: skip


async def test_a_node_announcing_ten_thousand_models_to_bloat_the_tracker_is_refused(tmp_path: Path, tracker: tuple[Tracker, str]) -> None:
    service, url = tracker
    a = ModelsNode(tmp_path / "a", url, [ALPHA])
    async with a.running():
        announcement = a.announcement().model_dump(mode="json")
        announcement["models"] = [{"model_id": "alpha"}] + [{"model_id": f"m{i}"} for i in range(10_000)]
        assert len(json.dumps(announcement)) < MAX_CONTROL_BODY_BYTES  # refused by the models' limit, not the body's
        refused = await signed_registration(a, url, announcement)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "malformed" and "models" in error["message"] and str(MAX_ANNOUNCED_MODELS) in error["message"]
        assert len(service.registry) == 0

        announcement["models"] = announcement["models"][:MAX_ANNOUNCED_MODELS]  # at the limit: registered
        assert (await signed_registration(a, url, announcement)).status_code == 200
        assert len(service.registry.get(a.node_id).models) == MAX_ANNOUNCED_MODELS  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("models", "says"),
    [
        ([{"model_id": "alpha", "aliases": ["a\nb"]}], "printable"),
        ([{"model_id": "alpha"}, {"model_id": "x" * (MAX_MODEL_NAME_CHARS + 1)}], str(MAX_MODEL_NAME_CHARS)),
        ([{"model_id": "alpha"}, {"model_id": "beta", "aliases": ["ALPHA"]}], "names two models"),
        ([{"model_id": "beta"}], "first model"),
        ([{"model_id": "alpha", "aliases": [f"a{i}" for i in range(1000)]}], "aliases"),
        ([{"model_id": "alpha"}, {"model_id": "beta", "state": "loadable", "expected_load_s": 1e9}], "expected_load_s"),
    ],
    ids=["control character", "too long", "one name for two models", "first is not model_id", "too many aliases", "load forever"],
)
async def test_an_announcement_with_a_bad_model_name_or_list_is_refused_saying_why(
    tmp_path: Path, tracker: tuple[Tracker, str], models: list[dict[str, Any]], says: str
) -> None:
    service, url = tracker
    a = ModelsNode(tmp_path / "a", url, [ALPHA])
    async with a.running():
        announcement = a.announcement().model_dump(mode="json")
        announcement["models"] = models
        refused = await signed_registration(a, url, announcement)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "malformed"
        assert says in refused.json()["error"]["message"]
        assert len(service.registry) == 0


async def test_a_heartbeat_cannot_add_a_model_the_registration_did_not_announce(tmp_path: Path, tracker: tuple[Tracker, str]) -> None:
    service, url = tracker
    a = ModelsNode(tmp_path / "a", url, [ALPHA])
    async with registered(service, "alpha", a) as http:
        a.models = [ALPHA, AnnouncedModel(model_id="gamma")]
        await a.heartbeat()
        assert await models(http, url) == ["alpha"]
        assert (await ask(http, url, "gamma")).status_code == 404 and a.answered == []


async def test_an_audited_model_is_routed_only_to_nodes_that_announce_it_first(tmp_path: Path) -> None:
    # The tracker's audits check a node's first model: a node naming the audited model second would serve it
    # unaudited (and earn as it) while its first model, not audited here, draws no probe.
    async with start_tracker(tmp_path, verifiers={"beta": "http://127.0.0.1:9"}) as (service, url):
        sneaky = ModelsNode(tmp_path / "a", url, [ALPHA, AnnouncedModel(model_id="beta")])
        async with registered(service, "alpha", sneaky) as http:
            assert service.registry.routable("beta") == []
            assert (await ask(http, url, "beta")).status_code == 503 and [x["model"] for x in sneaky.answered] == []
            assert (await ask(http, url, "alpha")).status_code == 200


async def stream(http: httpx.AsyncClient, url: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as answer:
        assert answer.status_code == 200
        assert b"[DONE]" in b"".join([chunk async for chunk in answer.aiter_bytes()])


async def test_a_node_calling_its_model_loadable_forever_is_timed_all_the_same(tmp_path: Path, tracker: tuple[Tracker, str]) -> None:
    # Only the stream that starts a load goes untimed (its first token waits for it). A node that says "loadable,
    # 0 s" at every heartbeat while it serves warm would otherwise never be measured, and keep a claim unchecked.
    service, url = tracker
    liar = ModelsNode(tmp_path / "a", url, [AnnouncedModel(model_id="alpha", state="loadable", expected_load_s=0.0)])
    async with registered(service, "alpha", liar) as http:
        for _ in range(TRUST_AFTER_SAMPLES + 1):
            await stream(http, url, "alpha")
            await liar.heartbeat()  # still "loadable"
        speed = (await node_view(http, url, liar.node_id))["speed"]
        assert speed["measured_streams"] == TRUST_AFTER_SAMPLES and speed["trusted"]


async def test_a_node_flipping_its_model_loaded_and_loadable_at_every_heartbeat_is_timed_all_the_same(
    tmp_path: Path, tracker: tuple[Tracker, str]
) -> None:
    # Each flip would make the next request start a "load": one untimed stream per UNTIMED_LOAD_INTERVAL_S at most.
    service, url = tracker
    cold = AnnouncedModel(model_id="alpha", state="loadable", expected_load_s=0.0)
    liar = ModelsNode(tmp_path / "a", url, [cold])
    async with registered(service, "alpha", liar) as http:
        for _ in range(TRUST_AFTER_SAMPLES + 1):
            for state in ("loaded", "loadable"):
                liar.models = [cold.model_copy(update={"state": state})]
                await liar.heartbeat()
            await stream(http, url, "alpha")
        assert (await node_view(http, url, liar.node_id))["speed"]["measured_streams"] == TRUST_AFTER_SAMPLES


async def test_a_node_claiming_its_loads_quicker_than_they_are_is_ranked_by_the_load_the_tracker_saw(
    tmp_path: Path, tracker: tuple[Tracker, str]
) -> None:
    service, url = tracker
    claims_instant = AnnouncedModel(model_id="alpha", state="loadable", expected_load_s=0.0)
    liar = ModelsNode(tmp_path / "a", url, [claims_instant])
    async with registered(service, "alpha", liar) as http:
        liar.load_s["alpha"] = SLOW_LOAD_S
        await stream(http, url, "alpha")  # starts the load: its first token comes after it
        for state in ("loaded", "loadable"):  # loaded, then unloaded again: the next request loads it anew
            liar.models = [claims_instant.model_copy(update={"state": state})]
            await liar.heartbeat()
        alpha = next(m for m in (await node_view(http, url, liar.node_id))["models"] if m["model"] == "alpha")
        assert alpha["expected_load_s"] == 0.0 and alpha["seen_load_s"] >= SLOW_LOAD_S * 0.8
        assert alpha["cold_load_s"] == alpha["seen_load_s"]  # what it costs a request now: the load as seen


async def test_the_stream_that_starts_a_load_times_its_decode_but_not_its_first_token(tmp_path: Path, tracker: tuple[Tracker, str]) -> None:
    service, url = tracker
    a = ModelsNode(tmp_path / "a", url, [ALPHA, BETA_COLD])
    async with registered(service, "beta", a) as http:
        await stream(http, url, "beta")
        beta = service.registry.get(a.node_id).model_for("beta")  # type: ignore[union-attr]
        assert beta is not None and beta.speed.samples == 0 and beta.speed.decode_samples == 1
        await stream(http, url, "beta")  # the load is under way: timed like any other
        assert beta.speed.samples == 1


# --- the pick, on the registry alone -------------------------------------------------------


def claim(prefill: float) -> NodeCapability:
    return NodeCapability(prefill_tokens_per_s=[RatePoint(ctx_tokens=256, tokens_per_s=prefill)], decode_tokens_per_s=[])


def announce(node_id: str, port: int, models: Sequence[AnnouncedModel], capability: NodeCapability | None = None) -> NodeAnnouncement:
    return NodeAnnouncement(
        node_id=node_id, public_key="k", advertised_url=f"http://127.0.0.1:{port}", model_id=models[0].model_id,
        first_layer=0, last_layer=1, total_layers=2, slots=4, node_version="t", state="online", models=list(models),
        capability=capability,
    )  # fmt: skip


def target(port: int) -> NodeTarget:
    from ipaddress import ip_address

    return NodeTarget(
        url=f"http://127.0.0.1:{port}", scheme="http", host="127.0.0.1", port=port, base_path="", address=ip_address("127.0.0.1")
    )


def measured(registry: NodeRegistry, node_id: str, model: str, ttft_s: float) -> None:
    entry = registry.get(node_id)
    on = entry.model_for(model) if entry is not None else None
    assert on is not None
    for _ in range(TRUST_AFTER_SAMPLES):
        on.speed.record(StreamSample(prompt_tokens=256, ttft_s=ttft_s, busy_before=0, decode_tokens=0, decode_s=0, concurrency=1))


def test_a_cold_load_counts_in_the_expected_first_token_and_a_second_request_waits_only_for_what_is_left() -> None:
    now = [0.0]
    registry = NodeRegistry(ttl_s=1e9, clock=lambda: now[0])
    cold_fast = [AnnouncedModel(model_id="alpha"), BETA_COLD]
    warm_slow = [AnnouncedModel(model_id="beta")]
    for node_id, port, served in (("cold", 1, cold_fast), ("warm", 2, warm_slow)):
        entry, _ = registry.register(announce(node_id, port, served), target(port))
        entry.healthy = True
    measured(registry, "cold", "beta", ttft_s=0.1)
    measured(registry, "warm", "beta", ttft_s=2.0)  # 20x slower, but no load: 2 s against 0.1 + 5 s
    assert registry.pick("beta", prompt_tokens=256).node_id == "warm"  # type: ignore[union-attr]
    measured(registry, "warm", "beta", ttft_s=8.0)  # now slower than a load and a fast first token
    cold = registry.get("cold")
    assert cold is not None
    assert registry.pick("beta", prompt_tokens=256) is cold
    assert registry.routed_to(cold, cold.model_for("beta")) is True  # the request found beta cold: its load starts
    now[0] = 4.0  # 4 s into the load: 1 s left, the warm node's 8 s is far later
    assert cold.model_for("beta").cold_load_s(now[0]) == pytest.approx(1.0)  # type: ignore[union-attr]
    assert registry.pick("beta", prompt_tokens=256) is cold
    registry.heartbeat("cold", "online", NodeLoad(slots_total=4, models=[{"model_id": "beta", "state": "loaded"}]))  # type: ignore[list-item]
    assert cold.model_for("beta").cold_load_s(now[0]) == 0.0  # type: ignore[union-attr]


def test_a_node_announcing_one_model_without_a_list_is_ranked_as_before() -> None:
    registry = NodeRegistry(ttl_s=1e9, clock=lambda: 0.0)
    old = NodeAnnouncement(
        node_id="old", public_key="k", advertised_url="http://127.0.0.1:3", model_id="alpha", model_aliases=["alpha-q4"],
        first_layer=0, last_layer=1, total_layers=2, slots=2, node_version="t", state="online", capability=claim(1000),
    )  # fmt: skip
    entry, _ = registry.register(old, target(3))
    entry.healthy = True
    assert [m.model_id for m in entry.models.values()] == ["alpha"] and entry.primary().state == "loaded"
    assert entry.primary().speed is entry.speed  # the node's own claim is its one model's
    assert registry.pick("ALPHA-Q4") is entry and registry.models() == {"alpha": [entry]}
    entry.in_flight = 2
    assert entry.full_for(entry.primary()) and registry.pick("alpha") is entry  # full: still the soonest (it answers 503)


# --- the node's side: the real tracker link announces its models ---------------------------------


async def test_a_node_announces_its_models_and_its_heartbeats_say_when_one_is_loaded(
    tmp_path: Path, tiny_gguf: Path, tracker: tuple[Tracker, str]
) -> None:
    service, url = tracker
    llama = FakeLlama(tmp_path)
    try:
        node = MeshNode(tmp_path / "n", tiny_gguf, llama, tracker_url=url, tracker_key=service.public_key_text, enrolment_secret=SECRET)
        other = [AnnouncedModel(model_id="other", state="loadable", expected_load_s=LOAD_S)]
        node.link.model = dataclasses.replace(node.link.model, models=lambda: [AnnouncedModel(model_id=MODEL), *other])
        async with node.running(), httpx.AsyncClient(timeout=10) as http:
            await routable(service, MODEL, 1)
            assert states(await node_view(http, url, node.node_id)) == {MODEL: ("loaded", None), "other": ("loadable", LOAD_S)}
            other[0] = other[0].model_copy(update={"state": "loaded"})  # the node loaded it: the next state check says so

            async def loaded() -> bool:
                return states(await node_view(http, url, node.node_id))["other"][0] == "loaded"

            await wait_until(loaded)
    finally:
        llama.close()


async def test_a_node_serving_one_model_announces_it_loaded(tmp_path: Path, tiny_gguf: Path, tracker: tuple[Tracker, str]) -> None:
    service, url = tracker
    llama = FakeLlama(tmp_path)
    try:
        node = MeshNode(tmp_path / "n", tiny_gguf, llama, tracker_url=url, tracker_key=service.public_key_text, enrolment_secret=SECRET)
        async with node.running(), httpx.AsyncClient(timeout=10) as http:
            await routable(service, MODEL, 1)
            view = await node_view(http, url, node.node_id)
            assert states(view) == {MODEL: ("loaded", None)}
            assert [m["model_id"] for m in view["announcement"]["models"]] == [MODEL]
    finally:
        llama.close()
