"""Several models on one node: one supervised llama-server per loaded model, loaded on demand, unloaded when idle.

Each loaded model is its own `Supervisor` (its private UNIX socket and key, restarts with backoff, a crash
explained), in a state folder of its own. A request goes through `using(alias)`: the model is loaded if it
is not (making room first: the least recently used idle model that is not pinned goes), the request is
counted while it runs, and an unload waits for none. A model that fails to load answers its requests with
`ModelFailed` (its log lines quoted) until someone loads it again on purpose; the others keep serving.

Why not llama-server's own router mode (`llama-server` without `-m`): its children listen on loopback TCP
ports it picks (no private socket), its eviction counts models and knows no pinned one, a corrupt model's
load evicts a healthy model first, and a child's crash reaches it as exit code 1 whatever the signal was
(bench/RESULTS.md, "Several models per node: llama-server's router mode").
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import anyio
from anyio.abc import TaskGroup

from meshnet_gguf.contract.node_part import BasePart
from meshnet_gguf.llama.child import ChildFailed, ChildSpec
from meshnet_gguf.llama.model_set import ModelSet, ModelSetError, ModelToServe
from meshnet_gguf.llama.supervisor import Supervisor, SupervisorPolicy

log = logging.getLogger(__name__)

ModelState = Literal["unloaded", "loading", "loaded", "unloading", "failed"]
MODELS_STATE_DIR = "models"
# Each model's folder (its socket, its pidfile) is named by a digest of its alias: an alias may hold '/' and be
# 128 characters long, and a UNIX socket's path must stay under ~108 bytes or llama-server falls back to TCP.
STATE_FOLDER_DIGEST_CHARS = 12
# How often a load, an unload and a drain look again (a tiny model loads in ~60 ms; the demo in ~1 s).
POLL_S = 0.02
# How often run() looks for models idle past their time.
IDLE_SWEEP_INTERVAL_S = 5.0
# A model that failed to load is refused at once (not loaded again per request: a broken file would crash a child
# for every request), then tried again by the first request this long after the failure: a load that failed for
# want of memory another program held, or a file the operator has since replaced, serves again without a restart.
FAILED_RETRY_AFTER_S = 10 * 60.0


def model_state_dir(state_dir: Path, alias: str) -> Path:
    """Where the model's llama-server keeps its socket and pidfile: the same folder for the same alias on every start,
    so a child a killed node left behind is found and reaped."""
    digest = hashlib.sha256(alias.lower().encode()).hexdigest()[:STATE_FOLDER_DIGEST_CHARS]
    return state_dir / MODELS_STATE_DIR / digest


def _check_room(models: ModelSet, max_loaded: int | None, budget: int | None) -> None:
    """The pinned models stay loaded together: refuse a room they cannot share (ModelSetError naming them)."""
    pinned = models.pinned
    if max_loaded is not None and max_loaded < max(1, len(pinned)):
        names = ", ".join(m.alias for m in pinned) or "any model"
        raise ModelSetError(f"room for {max_loaded} loaded model(s) cannot hold {names} (pinned models stay loaded)")
    if budget is not None and sum(m.memory_bytes or 0 for m in pinned) > budget:
        needs = ", ".join(f"{m.alias} {m.memory_bytes or 0} bytes" for m in pinned)
        raise ModelSetError(f"the pinned models need more than the {budget} bytes this node gives its models: {needs}")


class ModelUnavailable(RuntimeError):
    """A request's model cannot serve it now; the message says why, for the client."""

    def __init__(self, alias: str, message: str) -> None:
        super().__init__(message)
        self.alias = alias


class ModelUnknown(ModelUnavailable):
    pass


class ModelFailed(ModelUnavailable):
    pass


class NoRoom(ModelUnavailable):
    """Loading the model would need unloading a pinned or busy one."""


@dataclass(frozen=True)
class ModelStatus:
    alias: str
    state: ModelState
    pinned: bool
    pid: int | None
    requests: int  # answered or running, since the node started
    in_flight: int
    idle_s: float | None  # since the last request ended; None while one runs or it never served
    expected_load_s: float | None  # measured at its first load; None until then
    last_load_s: float | None
    loads: int
    error: str | None
    memory_bytes: int | None
    # A failed model: seconds until a request tries it again (0: the next one does); None when it has not failed.
    retry_in_s: float | None = None


@dataclass
class _Entry:
    model: ModelToServe
    supervisor: Supervisor | None = None
    ended: anyio.Event = field(default_factory=anyio.Event)
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    draining: bool = False
    error: str | None = None
    failed_at: float | None = None
    requests: int = 0
    in_flight: int = 0
    last_used: float | None = None
    expected_load_s: float | None = None
    last_load_s: float | None = None
    loads: int = 0

    @property
    def state(self) -> ModelState:
        if self.error is not None:
            return "failed"
        if self.supervisor is None:
            return "unloaded"
        if self.draining:
            return "unloading"
        return "loaded" if self.supervisor.is_ready() else "loading"

    @property
    def holds_memory(self) -> bool:
        return self.supervisor is not None


class ModelChildren(BasePart):
    """Owns the llama-servers of a `ModelSet`, as a node part: `run()` loads the pinned models and unloads idle ones
    until `close()`, which returns once every child has stopped; requests use `using(alias)`; `status()` is what
    `ps`, `/v1/models` and the tracker's announcement read."""

    name = "models"

    def __init__(
        self,
        models: ModelSet,
        spec_for: Callable[[ModelToServe], ChildSpec],
        policy: SupervisorPolicy,
        state_dir: Path,
        *,
        max_loaded: int | None = None,
        memory_budget_bytes: int | None = None,
        idle_sweep_s: float = IDLE_SWEEP_INTERVAL_S,
        failed_retry_s: float | None = FAILED_RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_room(models, max_loaded, memory_budget_bytes)
        self.models = models
        self._spec_for = spec_for
        self._policy = policy
        self._state_dir = state_dir
        self._max_loaded = max_loaded
        self._budget = memory_budget_bytes
        self._clock = clock
        self._idle_sweep_s = idle_sweep_s
        self._failed_retry_s = failed_retry_s
        self._entries = {m.alias: _Entry(m) for m in models}
        self._room = anyio.Lock()  # one load or eviction decision at a time
        self._tg: TaskGroup | None = None
        self._started = anyio.Event()
        self._closing = anyio.Event()
        self._finished = anyio.Event()

    # --- the part's life -----------------------------------------------------------------
    async def run(self) -> None:
        """Load the pinned models (one after another, as the plan placed them), then unload idle ones until `close()`;
        `load` and `using` wait for this to have started."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._started.set()
                for model in self.models.pinned:
                    try:
                        await self.load(model.alias)
                    except ModelUnavailable as exc:
                        log.error("pinned model %s did not load: %s", model.alias, exc)
                while not self._closing.is_set():
                    with anyio.move_on_after(self._idle_sweep_s):
                        await self._closing.wait()
                    await self.unload_idle()
                for entry in self._entries.values():
                    await self._stop(entry)
                tg.cancel_scope.cancel()
        finally:
            self._finished.set()

    async def close(self) -> None:
        """Stop every model's llama-server (each once its requests have ended) and wait until they have."""
        self._closing.set()
        if self._started.is_set():
            await self._finished.wait()

    # --- requests ------------------------------------------------------------------------
    @asynccontextmanager
    async def using(self, alias: str) -> AsyncIterator[Supervisor]:
        """The model's ready llama-server for one request (loaded first if need be); counted while the block runs,
        so no eviction and no idle unload ends it halfway."""
        entry = self._entry(alias)
        while True:
            await self.load(entry.model.alias)
            if entry.state == "loaded" and entry.supervisor is not None:
                break
        supervisor = entry.supervisor
        entry.in_flight += 1
        entry.requests += 1
        try:
            yield supervisor
        finally:
            entry.in_flight -= 1
            entry.last_used = self._clock()

    def status(self) -> list[ModelStatus]:
        now = self._clock()
        return [
            ModelStatus(
                alias=e.model.alias, state=e.state, pinned=e.model.pinned,
                pid=e.supervisor.pid if e.supervisor is not None else None,
                requests=e.requests, in_flight=e.in_flight,
                idle_s=None if e.in_flight or e.last_used is None else now - e.last_used,
                expected_load_s=e.expected_load_s, last_load_s=e.last_load_s, loads=e.loads, error=e.error,
                memory_bytes=e.model.memory_bytes, retry_in_s=self._retry_in_s(e, now),
            )
            for e in self._entries.values()
        ]  # fmt: skip

    # --- loads and unloads ---------------------------------------------------------------
    async def load(self, alias: str, *, retry_failed: bool = False) -> None:
        """Until the model is ready. ModelFailed when it failed (now or before, unless `retry_failed`),
        NoRoom when only a pinned or busy model could make room for it."""
        entry = self._entry(alias)
        await self._started.wait()
        async with entry.lock:
            if entry.error is not None and not retry_failed and not self._retry_due(entry):
                raise ModelFailed(alias, f"model {alias} failed to load: {entry.error}{self._retry_text(entry)}")
            entry.error = None
            if entry.supervisor is not None and not entry.draining:
                await self._until_ready(entry)
                return
            async with self._room:
                for victim in self._evictions_for(entry):
                    log.info("unloading %s to make room for %s", victim.model.alias, alias)
                    await self._stop(victim)
                self._start(entry)
            started = self._clock()
            await self._until_ready(entry)
            if entry.state != "loaded":
                return  # unloaded again before it was ready (a caller in `using` asks again)
            entry.loads += 1
            entry.last_load_s = self._clock() - started
            if entry.expected_load_s is None:
                entry.expected_load_s = entry.last_load_s
            log.info("model %s loaded in %.2f s", alias, entry.last_load_s)

    async def unload(self, alias: str) -> None:
        """Stop the model's llama-server once its requests have ended (new ones wait, then load it again)."""
        entry = self._entry(alias)
        async with entry.lock:
            await self._stop(entry)
            entry.error = None

    async def unload_idle(self) -> list[str]:
        """Unload every model idle past its `idle_unload_s` (never a pinned one); the aliases unloaded."""
        now = self._clock()
        idle = [
            e for e in self._entries.values()
            if e.model.unloads_when_idle and e.holds_memory and e.in_flight == 0 and e.last_used is not None
            and now - e.last_used >= (e.model.idle_unload_s or 0.0)
        ]  # fmt: skip
        for entry in idle:
            log.info("unloading %s: idle for %.0f s", entry.model.alias, now - (entry.last_used or now))
            await self.unload(entry.model.alias)
        return [e.model.alias for e in idle]

    # --- inside ----------------------------------------------------------------------------
    def _entry(self, alias: str) -> _Entry:
        model = self.models.get(alias)
        if model is None:
            raise ModelUnknown(alias, f"model {alias!r} is not served here (served: {', '.join(self.models.aliases)})")
        return self._entries[model.alias]

    def _evictions_for(self, wanted: _Entry) -> list[_Entry]:
        """The loaded models to unload so `wanted` fits (least recently used first), or NoRoom."""
        alias = wanted.model.alias
        if not self._fits(wanted, []):
            raise NoRoom(alias, f"model {alias} alone needs more than this node gives its models ({self._room_text()})")
        loaded = [e for e in self._entries.values() if e.holds_memory and e is not wanted]
        # A model still loading is someone's request on its way: evicting it would only trade one cold load for another.
        idle = (e for e in loaded if not e.model.pinned and e.in_flight == 0 and e.state == "loaded")
        candidates = sorted(idle, key=lambda e: e.last_used or float("-inf"))
        victims: list[_Entry] = []
        while not self._fits(wanted, [e for e in loaded if e not in victims]):
            if not candidates:
                kept = [e.model.alias + f" ({'pinned' if e.model.pinned else 'busy'})" for e in loaded if e not in victims]
                raise NoRoom(alias, f"no room to load model {alias}: it would need unloading {', '.join(kept)}")
            victims.append(candidates.pop(0))
        return victims

    def _retry_in_s(self, entry: _Entry, now: float) -> float | None:
        if entry.state != "failed" or self._failed_retry_s is None or entry.failed_at is None:
            return None
        return max(0.0, self._failed_retry_s - (now - entry.failed_at))

    def _retry_due(self, entry: _Entry) -> bool:
        if self._failed_retry_s is None or entry.failed_at is None:
            return False
        return self._clock() - entry.failed_at >= self._failed_retry_s

    def _retry_text(self, entry: _Entry) -> str:
        if self._failed_retry_s is None or entry.failed_at is None:
            return ""
        left = max(0.0, self._failed_retry_s - (self._clock() - entry.failed_at))
        return f" (tried again by a request in {left:.0f} s)"

    def _room_text(self) -> str:
        limits = [f"{self._max_loaded} loaded at once"] if self._max_loaded is not None else []
        if self._budget is not None:
            limits.append(f"{self._budget} bytes")
        return ", ".join(limits)

    def _fits(self, wanted: _Entry, loaded: list[_Entry]) -> bool:
        if self._max_loaded is not None and len(loaded) + 1 > self._max_loaded:
            return False
        if self._budget is not None:  # a model the plan gave no figure counts as nothing
            used = sum(e.model.memory_bytes or 0 for e in loaded)
            return used + (wanted.model.memory_bytes or 0) <= self._budget
        return True

    def _start(self, entry: _Entry) -> None:
        assert self._tg is not None
        folder = model_state_dir(self._state_dir, entry.model.alias)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        supervisor = Supervisor(self._spec_for(entry.model), self._policy, state_dir=folder)
        entry.supervisor, entry.ended, entry.draining = supervisor, anyio.Event(), False
        self._tg.start_soon(self._supervise, entry, supervisor)

    async def _supervise(self, entry: _Entry, supervisor: Supervisor) -> None:
        try:
            await supervisor.run()
        except ChildFailed as exc:
            entry.error, entry.failed_at = str(exc), self._clock()
            log.error("model %s failed: %s", entry.model.alias, exc)
        finally:
            if entry.supervisor is supervisor:
                entry.supervisor = None
            entry.ended.set()

    async def _until_ready(self, entry: _Entry) -> None:
        supervisor = entry.supervisor
        while supervisor is not None and not supervisor.is_ready() and not entry.ended.is_set():
            await anyio.sleep(POLL_S)
        if entry.error is not None:
            raise ModelFailed(entry.model.alias, f"model {entry.model.alias} failed to load: {entry.error}")

    async def _stop(self, entry: _Entry) -> None:
        supervisor = entry.supervisor
        if supervisor is None:
            return
        entry.draining = True  # new requests wait for the unload, then load it again
        while entry.in_flight:
            await anyio.sleep(POLL_S)
        await supervisor.stop()
        await entry.ended.wait()
        entry.draining = False
