"""Several models on one node, on the real llama-server: one supervised child per loaded model, each on its
private socket; loads on demand, unloads that free the child, room made from idle models only (never a pinned
one), and a model that fails to load refused with its reason while the others keep serving."""

from __future__ import annotations

import os
import stat
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import psutil
import pytest
from support.supervisor_policies import FAST

from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.child import SOCKET_DIR_NAME, SOCKET_NAME, ChildSpec
from meshnet_gguf.llama.model_children import ModelChildren, ModelFailed, ModelUnknown, NoRoom, model_state_dir
from meshnet_gguf.llama.model_set import MAX_ALIAS_CHARS, MIN_IDLE_UNLOAD_S, ModelSet, ModelSetError, ModelToServe
from meshnet_gguf.llama.supervisor import Supervisor
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model

pytestmark = [pytest.mark.anyio, pytest.mark.real_llama]
CONTEXT = 512
OTHER_UID = 65534  # nobody


def _tiny(tmp_path: Path, name: str, seed: int, **kw: object) -> ModelToServe:
    path = write_tiny_model(tmp_path / f"{name}.gguf", TinyModelSpec(seed=seed, name=name))
    return ModelToServe(path=path, alias=str(kw.pop("alias", name)), context=CONTEXT, **kw)  # type: ignore[arg-type]


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A state dir with a short path, as a node's is (`~/.local/state/meshnet`): pytest's own folders, named after
    the test, leave too few of a socket address's 108 bytes, and llama-server would listen on loopback TCP instead."""
    with tempfile.TemporaryDirectory(prefix="mc-") as folder:
        yield Path(folder)


def _children(binary: BinaryInfo, state_dir: Path, models: list[ModelToServe], **kw: object) -> ModelChildren:
    return ModelChildren(
        ModelSet.checked(models),
        lambda m: ChildSpec(binary, m.llama_args()),
        FAST,
        state_dir,
        **kw,  # type: ignore[arg-type]
    )


@asynccontextmanager
async def running(children: ModelChildren) -> AsyncIterator[ModelChildren]:
    async with anyio.create_task_group() as tg:
        tg.start_soon(children.run)
        try:
            yield children
        finally:
            await children.close()


async def ask(children: ModelChildren, alias: str) -> httpx.Response:
    async with children.using(alias) as llama:
        return await _chat(llama, alias)


async def _chat(llama: Supervisor, alias: str) -> httpx.Response:
    transport = httpx.AsyncHTTPTransport(uds=str(llama.socket_path)) if llama.socket_path else None
    base = "http://llama" if llama.socket_path else str(llama.base_url)
    async with httpx.AsyncClient(transport=transport, base_url=base, timeout=30) as client:
        body = {"model": alias, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        return await client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {llama.api_key}"})


def _states(children: ModelChildren) -> dict[str, str]:
    return {s.alias: s.state for s in children.status()}


def _pid(children: ModelChildren, alias: str) -> int | None:
    return next(s.pid for s in children.status() if s.alias == alias)


# As long as an alias may be: a socket's path must stay short whatever the alias, or llama-server would fall back to TCP.
LONG_ALIAS = "acme/" + "tiny-b-" * 16 + "GGUF:F32"


async def test_two_models_answer_each_on_a_private_socket_and_an_unload_frees_its_child(
    real_llama: BinaryInfo, tmp_path: Path, state_dir: Path
) -> None:
    assert len(LONG_ALIAS) <= MAX_ALIAS_CHARS
    children = _children(real_llama, state_dir, [_tiny(tmp_path, "tiny-a", 1), _tiny(tmp_path, "tiny-b", 2, alias=LONG_ALIAS)])
    async with running(children):
        assert _states(children) == {"tiny-a": "unloaded", LONG_ALIAS: "unloaded"}
        for alias in ("tiny-a", LONG_ALIAS):
            answer = await ask(children, alias)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == alias
        assert _states(children) == {"tiny-a": "loaded", LONG_ALIAS: "loaded"}
        pid_a, pid_b = _pid(children, "tiny-a"), _pid(children, LONG_ALIAS)
        assert pid_a and pid_b and pid_a != pid_b
        for pid, alias in ((pid_a, "tiny-a"), (pid_b, LONG_ALIAS)):
            # llama-server's router mode puts its children on loopback TCP ports; these listen on none.
            assert [c for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN] == []
            socket_folder = model_state_dir(state_dir, alias) / SOCKET_DIR_NAME
            argv = psutil.Process(pid).cmdline()
            assert argv[argv.index("--host") + 1] == str(socket_folder / SOCKET_NAME)
            assert stat.S_IMODE(os.stat(socket_folder).st_mode) == 0o700
        first = next(s for s in children.status() if s.alias == "tiny-a")
        assert first.loads == 1 and first.requests == 1 and first.expected_load_s is not None and first.expected_load_s > 0

        await children.unload("tiny-a")
        assert not psutil.pid_exists(pid_a)
        assert _states(children) == {"tiny-a": "unloaded", LONG_ALIAS: "loaded"}
        assert (await ask(children, LONG_ALIAS)).status_code == 200
        # A request for an unloaded model loads it again (a new child), and its first load time is kept.
        assert (await ask(children, "tiny-a")).status_code == 200
        again = next(s for s in children.status() if s.alias == "tiny-a")
        assert again.loads == 2 and again.pid not in (None, pid_a) and again.expected_load_s == first.expected_load_s
        with pytest.raises(ModelUnknown, match=f"served: tiny-a, {LONG_ALIAS}"):
            await ask(children, "other")
    assert not psutil.pid_exists(pid_b)


async def test_a_model_that_fails_to_load_is_refused_with_its_reason_and_the_other_keeps_serving(
    real_llama: BinaryInfo, tmp_path: Path, state_dir: Path
) -> None:
    good = _tiny(tmp_path, "good", 1)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(good.path.read_bytes()[:1000])
    children = _children(real_llama, state_dir, [good, ModelToServe(path=corrupt, alias="corrupt", context=CONTEXT)])
    async with running(children):
        assert (await ask(children, "good")).status_code == 200
        pid_good = _pid(children, "good")
        with pytest.raises(ModelFailed, match="model corrupt failed to load: llama-server exited with code 1") as failed:
            await ask(children, "corrupt")
        assert "gguf" in str(failed.value).lower()  # its own log lines say what is wrong with the file
        status = {s.alias: s for s in children.status()}
        assert status["corrupt"].state == "failed" and status["corrupt"].pid is None and status["corrupt"].error
        # Its next request is refused at once, without a new child (llama-server's router spawns one per request)...
        started = time.monotonic()
        with pytest.raises(ModelFailed):
            await ask(children, "corrupt")
        assert time.monotonic() - started < 0.5 and next(s for s in children.status() if s.alias == "corrupt").pid is None
        # ...and the healthy model was neither evicted nor restarted.
        assert _pid(children, "good") == pid_good
        assert (await ask(children, "good")).status_code == 200
        # Loading it again on purpose tries again (and fails the same way).
        with pytest.raises(ModelFailed):
            await children.load("corrupt", retry_failed=True)


async def test_room_is_made_from_idle_models_never_from_a_pinned_one(real_llama: BinaryInfo, tmp_path: Path, state_dir: Path) -> None:
    pinned = _children(
        real_llama, state_dir / "pinned", [_tiny(tmp_path, "big", 1, pinned=True), _tiny(tmp_path, "small", 2)], max_loaded=1
    )
    async with running(pinned):
        await pinned.load("big")  # run() loads it at start; this waits for that
        with pytest.raises(NoRoom, match=r"no room to load model small: it would need unloading big \(pinned\)"):
            await ask(pinned, "small")
        assert _states(pinned) == {"big": "loaded", "small": "unloaded"}

    evicting = _children(real_llama, state_dir / "lru", [_tiny(tmp_path, "one", 1), _tiny(tmp_path, "two", 2)], max_loaded=1)
    async with running(evicting):
        assert (await ask(evicting, "one")).status_code == 200
        pid_one = _pid(evicting, "one")
        assert (await ask(evicting, "two")).status_code == 200
        assert _states(evicting) == {"one": "unloaded", "two": "loaded"}
        assert pid_one is not None and not psutil.pid_exists(pid_one)

        # A busy model is not evicted: while a request holds "two", "one" cannot load.
        async with evicting.using("two"):
            with pytest.raises(NoRoom, match=r"two \(busy\)"):
                await evicting.load("one")


async def test_idle_models_are_unloaded_after_their_time_and_a_pinned_one_stays(
    real_llama: BinaryInfo, tmp_path: Path, state_dir: Path
) -> None:
    offset = [0.0]
    models = [_tiny(tmp_path, "big", 1, pinned=True), _tiny(tmp_path, "small", 2, idle_unload_s=MIN_IDLE_UNLOAD_S)]
    children = _children(real_llama, state_dir, models, clock=lambda: time.monotonic() + offset[0])
    async with running(children):
        for alias in ("big", "small"):
            assert (await ask(children, alias)).status_code == 200
        assert await children.unload_idle() == []
        pid_small = _pid(children, "small")
        offset[0] += MIN_IDLE_UNLOAD_S + 1
        assert await children.unload_idle() == ["small"]
        assert _states(children) == {"big": "loaded", "small": "unloaded"}
        assert pid_small is not None and not psutil.pid_exists(pid_small)
        idle = next(s for s in children.status() if s.alias == "big").idle_s
        assert idle is not None and idle >= MIN_IDLE_UNLOAD_S


async def test_a_socket_folder_planted_for_one_model_fails_that_model_only(real_llama: BinaryInfo, tmp_path: Path, state_dir: Path) -> None:
    """Another local user who knows an alias can compute its folder; a folder of theirs there is refused (no
    llama-server started to listen in it), and the other model serves."""
    if os.getuid() != 0:
        pytest.skip("planting a folder owned by another user needs root")
    children = _children(real_llama, state_dir, [_tiny(tmp_path, "target", 1), _tiny(tmp_path, "other", 2)])
    planted = model_state_dir(state_dir, "target") / SOCKET_DIR_NAME
    planted.mkdir(parents=True, mode=0o777)
    os.chown(planted, OTHER_UID, OTHER_UID)
    async with running(children):
        with pytest.raises(ModelFailed, match="not a folder owned by this user"):
            await ask(children, "target")
        assert _pid(children, "target") is None and not any(planted.iterdir())
        assert (await ask(children, "other")).status_code == 200


async def test_an_unload_waits_for_the_request_in_flight_and_the_next_request_waits_for_the_unload(
    real_llama: BinaryInfo, tmp_path: Path, state_dir: Path
) -> None:
    children = _children(real_llama, state_dir, [_tiny(tmp_path, "one", 1)])
    async with running(children), anyio.create_task_group() as tg:
        assert (await ask(children, "one")).status_code == 200
        first_pid = _pid(children, "one")
        answers: list[int] = []
        async with children.using("one") as llama:
            tg.start_soon(children.unload, "one")
            await _wait(lambda: _states(children)["one"] == "unloading")

            async def late_request() -> None:
                answers.append((await ask(children, "one")).status_code)

            tg.start_soon(late_request)
            await anyio.sleep(0.3)
            # The unload holds back: the child still serves the request in flight, to the end.
            assert first_pid is not None and psutil.pid_exists(first_pid) and answers == []
            assert (await _chat(llama, "one")).status_code == 200
        await _wait(lambda: answers == [200])
        # The late request was answered by a new child, after the old one had gone.
        assert not psutil.pid_exists(first_pid) and _pid(children, "one") not in (None, first_pid)


async def test_a_crashed_child_is_restarted_by_its_supervisor_and_serves_again(
    real_llama: BinaryInfo, tmp_path: Path, state_dir: Path
) -> None:
    children = _children(real_llama, state_dir, [_tiny(tmp_path, "one", 1), _tiny(tmp_path, "two", 2)])
    async with running(children):
        for alias in ("one", "two"):
            assert (await ask(children, alias)).status_code == 200
        crashed, other = _pid(children, "one"), _pid(children, "two")
        assert crashed is not None
        psutil.Process(crashed).kill()
        # Once its supervisor has seen the exit, a request waits for the restart, then is answered. (One sent in the
        # few milliseconds before meets a closed socket: an error for the proxy to give, never half an answer.)
        await _wait(lambda: _states(children)["one"] != "loaded")
        assert (await ask(children, "one")).status_code == 200
        assert _pid(children, "one") not in (None, crashed) and _pid(children, "two") == other
        assert next(s for s in children.status() if s.alias == "one").loads == 1  # a restart, not a new load


async def test_requests_at_once_for_a_cold_model_share_one_load(real_llama: BinaryInfo, tmp_path: Path, state_dir: Path) -> None:
    children = _children(real_llama, state_dir, [_tiny(tmp_path, "one", 1)])
    answers: list[int] = []
    async with running(children):

        async def one_request() -> None:
            answers.append((await ask(children, "one")).status_code)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(one_request)
        status = children.status()[0]
        assert answers == [200, 200, 200] and status.loads == 1 and status.requests == 3


async def _wait(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.02)


async def test_the_memory_budget_makes_room_by_bytes_and_refuses_a_model_too_big_alone(
    real_llama: BinaryInfo, tmp_path: Path, state_dir: Path
) -> None:
    models = [
        _tiny(tmp_path, "big", 1, pinned=True, memory_bytes=600),
        _tiny(tmp_path, "small", 2, memory_bytes=300),
        _tiny(tmp_path, "other", 3, memory_bytes=400),
        _tiny(tmp_path, "huge", 4, memory_bytes=1001),
    ]
    children = _children(real_llama, state_dir, models, memory_budget_bytes=1000)
    async with running(children):
        await children.load("big")
        assert (await ask(children, "small")).status_code == 200  # 600 + 300 fit in 1000
        assert (await ask(children, "other")).status_code == 200  # 600 + 400: small goes, big stays
        assert _states(children) == {"big": "loaded", "small": "unloaded", "other": "loaded", "huge": "unloaded"}
        with pytest.raises(NoRoom, match="model huge alone needs more than this node gives its models"):
            await ask(children, "huge")
        assert _states(children)["other"] == "loaded"  # nothing was unloaded for a model that could never fit


def test_pinned_models_that_cannot_stay_loaded_together_are_refused_by_name(tmp_path: Path) -> None:
    models = ModelSet.checked([
        ModelToServe(path=write_tiny_model(tmp_path / f"{n}.gguf"), alias=n, context=CONTEXT, pinned=True, memory_bytes=600)
        for n in ("left", "right")
    ])  # fmt: skip
    with pytest.raises(ModelSetError, match="cannot hold left, right"):
        ModelChildren(models, lambda m: ChildSpec(None, []), FAST, tmp_path, max_loaded=1)  # type: ignore[arg-type]
    with pytest.raises(ModelSetError, match="need more than the 1000 bytes this node gives its models: left 600 bytes, right 600 bytes"):
        ModelChildren(models, lambda m: ChildSpec(None, []), FAST, tmp_path, memory_budget_bytes=1000)  # type: ignore[arg-type]
