"""A chaos soak of the relayed mesh: steady client load while components die and the network misbehaves.

Built on `home_mesh` (tracker and relay beyond a home router's NAT, nodes behind it, the client on a
link of its own). While client threads stream requests without pause, a driver picks an action every
few seconds: SIGKILL (by PID) and restart the tracker, the relay, a node or a node's llama-server; flush
the router's mappings (`conntrack -F`); change the node's and the client's link (delay, loss,
reordering). At the end every component is brought back, the links made clean, and `verify()` checks:

- every request the client saw complete was billed once: in the tracker's ledger with the node's
  receipt, and in exactly one node's ledger;
- no request billed twice (no request id in two nodes' ledgers);
- every stream that failed ended with an error event, or was refused with an error answer, unless the
  tracker itself was dead at the time (then nobody is left to send one: the connection breaks);
- node and tracker ledgers agree row for row: each node row has the tracker's row with the node's receipt,
  figure for figure, and each receipt the tracker holds is some node's row;
- no process leaked descriptors or memory beyond `FD_GROWTH_BOUND` and `RSS_GROWTH_BOUND_MB` over its life.

`bench/soak_chaos.py` runs it by hand for 30 minutes or more; `tests/e2e/test_chaos_soak.py` for one.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from support.home_mesh import HomeMesh, HomeNode, StreamResult
from support.relay_processes import ServiceProcess

# A process may hold this many more descriptors at the end of its life than when it was first seen serving:
# connections in flight (a client's, a tunnel's, a llama-server's) and kept ones, never more than a few dozen.
FD_GROWTH_BOUND = 64
# ... and this much more resident memory: caches that fill once (routes, replay ids, interned strings) and
# the allocator's slack; a leak of a stream's buffers or a task per request passes it within minutes.
RSS_GROWTH_BOUND_MB = 64.0
# A process is first measured this long after it serves, once its imports and warm-up are done.
SETTLE_BEFORE_SAMPLE_S = 5.0
# One client request, first byte to last: streams here last a second or two; a cut one ends within the
# tunnel's keep-alive bound (9 s). Past this the client gives up and counts it as heard nothing.
CLIENT_REQUEST_TIMEOUT_S = 30.0
# A client whose request was refused (a 503 while no node is routable, the tracker down) tries again after this
# pause, as SDK clients back off: the count of requests then says how many were tried, not how fast a loop spins.
REFUSED_PAUSE_S = 0.5
# A node's supervisor gives up on a llama-server that crashes 5 times before it was up this long
# (NodeSettings.restart_stable_after_s, max_quick_crashes), on purpose: a crash loop is a failed node. The driver
# kills a llama-server only once it has been up this long since its last kill, so what it tests is the restart, not
# the give-up (a 30-minute run that killed more often lost its spared node to it after 8 minutes).
LLAMA_STABLE_S = 125.0
# A killed service waits this long before its restart (a crash, then the supervisor's restart).
RESTART_PAUSE_S = (0.5, 2.5)
# After the chaos: every component back, ready and routable within this (a node's restart, its registration,
# the relay's tunnels).
RECOVER_S = 90.0
# ... and every receipt the nodes hold acknowledged by the tracker within this (the outbox backs off to 60 s
# while the tracker is down; one more round after it is back).
SETTLE_RECEIPTS_S = 150.0
# Requests that must all succeed once everything is back: the mesh recovered, not just survived.
FINAL_REQUESTS = 4
# The link settings the driver picks from (each way): clean, a home link, a bad one, a jittery one.
NETEM_PRESETS: list[dict[str, float]] = [
    {"delay_ms": 0, "jitter_ms": 0, "loss": 0, "reorder": 0},
    {"delay_ms": 40, "jitter_ms": 5, "loss": 0.01, "reorder": 0.02},
    {"delay_ms": 80, "jitter_ms": 10, "loss": 0.03, "reorder": 0.05},
    {"delay_ms": 20, "jitter_ms": 20, "loss": 0.005, "reorder": 0.0},
]


@dataclass
class ChaosConfig:
    duration_s: float
    action_every_s: tuple[float, float] = (3.0, 6.0)
    clients: int = 2
    max_tokens: tuple[int, int] = (8, 60)
    seed: int = 0
    # Nodes the driver never SIGKILLs (their llama-server it still does): one process that lives the whole soak,
    # whose descriptors and memory say whether anything leaks per request over hours.
    spared_nodes: tuple[int, ...] = (0,)
    weights: dict[str, float] = field(
        default_factory=lambda: {
            "kill_tracker": 1.0, "kill_relay": 1.5, "kill_node": 1.5, "kill_llama": 1.0, "flush_nat": 2.0, "netem": 2.0,
        }
    )  # fmt: skip


@dataclass
class Sent:
    started: float
    ended: float
    max_tokens: int
    request_id: str | None
    status: int
    ok: bool
    error_code: str | None
    transport_error: str | None
    completion_events: int


@dataclass
class Sample:
    name: str
    pid: int
    first_at: float
    fds_first: int
    rss_first_mb: float
    fds_last: int = 0
    rss_last_mb: float = 0.0
    last_at: float = 0.0


@dataclass
class ChaosReport:
    duration_s: float
    actions: dict[str, int]
    sent: int
    completed: int
    refused: int
    error_events: int
    broken_with_tracker_dead: int
    final_requests_ok: int
    node_rows: int
    tracker_rows: int
    ledger_disagreements: int
    billed_twice: int
    completed_not_billed: int
    rejected_unknown: int
    self_exits: int
    samples: list[dict[str, Any]]
    problems: list[str]

    def summary(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if k != "samples"}, indent=1)


class Chaos:
    def __init__(self, mesh: HomeMesh, config: ChaosConfig, events_log: Path) -> None:
        self.mesh, self.config = mesh, config
        self.rng = random.Random(config.seed)
        self.sent: list[Sent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.tracker_down: list[tuple[float, float]] = []  # (killed, serving again)
        self.actions: dict[str, int] = {}
        self._events = events_log.open("a")
        self.samples: dict[tuple[str, int], Sample] = {}
        self._started_at: dict[tuple[str, int], float] = {}
        self._llama_killed_at: dict[str, float] = {}
        self.self_exits: list[str] = []

    # --- the run -----------------------------------------------------------------------------------------
    def run(self) -> ChaosReport:
        started = time.monotonic()
        for node in self.mesh.nodes:
            self._born(self._node_name(node), node.proc.pid if node.proc else 0)
        self._born("tracker", self._pid(self.mesh.tracker))
        self._born("relay", self._pid(self.mesh.relay))
        clients = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(self.config.clients)]
        for thread in clients:
            thread.start()
        try:
            self._drive(started + self.config.duration_s)
        finally:
            self._stop.set()
            for thread in clients:
                thread.join(CLIENT_REQUEST_TIMEOUT_S + 10)
        self._log("chaos over", sent=len(self.sent))
        return self.verify(time.monotonic() - started)

    def _client(self, n: int) -> None:
        rng = random.Random(self.config.seed * 1000 + n)
        # Each request opens its own connection (HomeMesh.stream): a killed tracker leaves no dead kept one behind.
        while not self._stop.is_set():
            max_tokens = rng.randint(*self.config.max_tokens)
            t0 = time.monotonic()
            result = self.mesh.stream(max_tokens, timeout=CLIENT_REQUEST_TIMEOUT_S)
            self._record(t0, max_tokens, result)
            self._sample_all()
            if not result.ok:
                self._stop.wait(REFUSED_PAUSE_S)

    def _record(self, t0: float, max_tokens: int, result: StreamResult) -> None:
        sent = Sent(
            started=t0, ended=time.monotonic(), max_tokens=max_tokens, request_id=result.request_id, status=result.status, ok=result.ok,
            error_code=(result.error_event or {}).get("code") if result.error_event else None, transport_error=result.transport_error,
            completion_events=result.body.count(b'"content"'),
        )  # fmt: skip
        with self._lock:
            self.sent.append(sent)
        self._log("request", **asdict(sent))

    def _drive(self, until: float) -> None:
        names = list(self.config.weights)
        weights = [self.config.weights[n] for n in names]
        while time.monotonic() < until:
            pause = self.rng.uniform(*self.config.action_every_s)
            time.sleep(max(0.0, min(pause, until - time.monotonic())))
            if time.monotonic() >= until:
                break
            self._restart_exited_nodes()
            action = self.rng.choices(names, weights)[0]
            self.actions[action] = self.actions.get(action, 0) + 1
            getattr(self, "_" + action)()

    def _restart_exited_nodes(self) -> None:
        """A node that ended by itself is started again, as its service manager would (systemd's Restart=on-failure),
        and counted: nothing the driver does should end one."""
        for node in self.mesh.nodes:
            if node.proc is not None and node.proc.poll() is not None:
                code = node.proc.returncode
                self.self_exits.append(f"{node.name} (pid {node.proc.pid}) exited by itself with {code}")
                self._log(f"{node.name} exited by itself", code=code)
                node.start()
                self._born(self._node_name(node), node.proc.pid if node.proc else 0)

    # --- the actions -------------------------------------------------------------------------------------
    def _kill_tracker(self) -> None:
        killed = time.monotonic()
        self._restart_service(self.mesh.tracker, "tracker")
        self.tracker_down.append((killed, time.monotonic()))

    def _kill_relay(self) -> None:
        self._restart_service(self.mesh.relay, "relay")

    def _restart_service(self, service: ServiceProcess, name: str) -> None:
        self._final_sample(name, self._pid(service))
        service.kill()
        self._log(f"killed {name}")
        time.sleep(self.rng.uniform(*RESTART_PAUSE_S))
        service.start()
        self._born(name, self._pid(service))
        self._log(f"restarted {name}")

    def _kill_node(self) -> None:
        candidates = [n for i, n in enumerate(self.mesh.nodes) if i not in self.config.spared_nodes]
        if not candidates:
            return self._kill_llama()
        node = self.rng.choice(candidates)
        if node.proc is not None:
            self._final_sample(self._node_name(node), node.proc.pid)
        node.kill()
        self._log(f"killed {node.name}")
        time.sleep(self.rng.uniform(*RESTART_PAUSE_S))
        node.start()
        self._born(self._node_name(node), node.proc.pid if node.proc else 0)
        self._log(f"restarted {node.name}")
        return None

    def _kill_llama(self) -> None:
        now = time.monotonic()
        stable = [n for n in self.mesh.nodes if now - self._llama_killed_at.get(n.name, -LLAMA_STABLE_S) >= LLAMA_STABLE_S]
        if not stable:
            return self._flush_nat()
        node = self.rng.choice(stable)
        self._llama_killed_at[node.name] = now
        pid = node.llama_pid()
        if pid is None:
            return None
        try:
            os.kill(pid, 9)  # by the PID the node's pidfile names; the node's supervisor restarts it
        except ProcessLookupError:
            return None
        self._log(f"killed {node.name}'s llama-server", pid=pid)
        return None

    def _flush_nat(self) -> None:
        self.mesh.net.flush_nat()
        self._log("flushed the router's mappings")

    def _netem(self) -> None:
        node_link, client_link = self.rng.choice(NETEM_PRESETS), self.rng.choice(NETEM_PRESETS)
        self.mesh.net.node_link.set(**node_link)
        self.mesh.net.client_link.set(**client_link)
        self._log("netem", node_link=node_link, client_link=client_link)

    # --- bringing it back, and the verdict ---------------------------------------------------------------
    def recover(self) -> int:
        """Links clean, every component running, ready and routable; then FINAL_REQUESTS that must succeed."""
        self._restart_exited_nodes()
        clean = NETEM_PRESETS[0]
        self.mesh.net.node_link.set(**clean)
        self.mesh.net.client_link.set(**clean)
        for service in (self.mesh.tracker, self.mesh.relay):
            if service.proc is None or service.proc.poll() is not None:
                service.start()
        for node in self.mesh.nodes:
            if not node.alive():
                node.start()
        for node in self.mesh.nodes:
            node.wait_ready(RECOVER_S)
        self.mesh.wait_routable(len(self.mesh.nodes), RECOVER_S)
        ok = 0
        for _ in range(FINAL_REQUESTS):
            result = self.mesh.stream(8, timeout=CLIENT_REQUEST_TIMEOUT_S)
            self._record(time.monotonic(), 8, result)
            ok += result.ok
        return ok

    def verify(self, duration_s: float) -> ChaosReport:
        final_ok = self.recover()
        problems: list[str] = list(self.self_exits)
        if final_ok != FINAL_REQUESTS:
            problems.append(f"only {final_ok} of {FINAL_REQUESTS} requests succeeded once everything was back")
        self._wait_receipts(problems)
        time.sleep(SETTLE_BEFORE_SAMPLE_S)
        self._sample_all(final=True)

        ledgers = {node.name: node.ledger() for node in self.mesh.nodes}
        usage = {u["request_id"]: u for u in self.mesh.usage()}
        where: dict[str, list[str]] = {}
        for name, ledger in ledgers.items():
            for rid in ledger:
                where.setdefault(rid, []).append(name)
        billed_twice = [rid for rid, names in where.items() if len(names) > 1]
        problems += [f"request {rid} is in the ledgers of {where[rid]}" for rid in billed_twice]

        disagreements, rejected_unknown = 0, 0
        for name, ledger in ledgers.items():
            for rid, row in ledger.items():
                if row["rejected"]:
                    if "unknown_request" in row["rejected"] or "never routed" in row["rejected"]:
                        rejected_unknown += 1  # a tracker killed before its row was synced: billed by nobody (protocol 6.5)
                        if rid in usage and usage[rid]["node"] is not None:
                            disagreements += 1
                            problems.append(f"{name} was refused {rid} as unknown, yet the tracker holds its receipt")
                        continue
                    disagreements += 1
                    problems.append(f"{name}'s receipt for {rid} was refused: {row['rejected']}")
                    continue
                u = usage.get(rid)
                if u is None or u["node"] is None:
                    disagreements += 1
                    problems.append(f"{name} holds {rid} ({row}) but the tracker has {'no row' if u is None else 'no receipt'}")
                elif (u["node"]["prompt_tokens"], u["node"]["completion_tokens"]) != (row["prompt"], row["completion"]):
                    disagreements += 1
                    problems.append(f"{rid}: {name} says {row}, the tracker holds {u['node']}")
        for rid, u in usage.items():
            if u["node"] is not None and rid not in where:
                disagreements += 1
                problems.append(f"the tracker holds a receipt for {rid}, which no node's ledger has")
            elif u["node"] is None and u["outcome"] == "complete":
                disagreements += 1
                problems.append(f"the tracker forwarded {rid} whole but never got its receipt")

        completed = [s for s in self.sent if s.ok]
        not_billed = []
        for s in completed:
            u = usage.get(s.request_id or "")
            if u is None or u["node"] is None or u["billed"] is None or len(where.get(s.request_id or "", [])) != 1:
                not_billed.append(s.request_id)
        problems += [f"the client saw {rid} complete, but it is not billed once" for rid in not_billed]

        refused = [s for s in self.sent if not s.ok and s.status not in (0, 200)]
        events = [s for s in self.sent if not s.ok and s.status == 200 and s.error_code is not None]
        silent = [s for s in self.sent if not s.ok and s not in refused and s not in events]
        excused = [s for s in silent if self._tracker_died_during(s)]
        for s in silent:
            if s not in excused:
                problems.append(f"a request failed with no error event or answer while the tracker was up: {s}")

        samples = [asdict(s) for s in self.samples.values()]
        for s in self.samples.values():
            if s.last_at and s.fds_last - s.fds_first > FD_GROWTH_BOUND:
                problems.append(f"{s.name} (pid {s.pid}) grew from {s.fds_first} to {s.fds_last} descriptors")
            if s.last_at and s.rss_last_mb - s.rss_first_mb > RSS_GROWTH_BOUND_MB:
                problems.append(f"{s.name} (pid {s.pid}) grew from {s.rss_first_mb:.0f} to {s.rss_last_mb:.0f} MB")
        report = ChaosReport(
            duration_s=duration_s, actions=dict(self.actions), sent=len(self.sent), completed=len(completed), refused=len(refused),
            error_events=len(events), broken_with_tracker_dead=len(excused), final_requests_ok=final_ok,
            node_rows=sum(len(ledger) for ledger in ledgers.values()), tracker_rows=len(usage), ledger_disagreements=disagreements,
            billed_twice=len(billed_twice), completed_not_billed=len(not_billed), rejected_unknown=rejected_unknown,
            self_exits=len(self.self_exits), samples=samples,
            problems=problems,
        )  # fmt: skip
        self._log("report", **{k: v for k, v in asdict(report).items() if k != "samples"})
        return report

    def _wait_receipts(self, problems: list[str]) -> None:
        deadline = time.monotonic() + SETTLE_RECEIPTS_S
        while time.monotonic() < deadline:
            pending = sum(1 for node in self.mesh.nodes for row in node.ledger().values() if not row["reported"])
            if pending == 0:
                return
            time.sleep(1.0)
        problems.append(f"{pending} receipts still unacknowledged {SETTLE_RECEIPTS_S:.0f} s after the chaos")

    def _tracker_died_during(self, s: Sent) -> bool:
        return any(s.started <= back and s.ended >= killed - 1.0 for killed, back in self.tracker_down)

    # --- descriptors and memory --------------------------------------------------------------------------
    def _born(self, name: str, pid: int) -> None:
        self._started_at[(name, pid)] = time.monotonic()

    def _sample_all(self, final: bool = False) -> None:
        for name, pid in self._live():
            self._sample(name, pid, final)

    def _live(self) -> list[tuple[str, int]]:
        live = [("tracker", self._pid(self.mesh.tracker)), ("relay", self._pid(self.mesh.relay))]
        live += [(self._node_name(n), n.proc.pid) for n in self.mesh.nodes if n.proc is not None and n.proc.poll() is None]
        return [(name, pid) for name, pid in live if pid]

    def _sample(self, name: str, pid: int, final: bool = False) -> None:
        born = self._started_at.get((name, pid))
        if born is None or time.monotonic() - born < SETTLE_BEFORE_SAMPLE_S:
            return
        measured = _fds_and_rss(pid)
        if measured is None:
            return
        fds, rss = measured
        with self._lock:
            sample = self.samples.get((name, pid))
            if sample is None:
                self.samples[(name, pid)] = Sample(name, pid, time.monotonic(), fds, rss)
            elif final:
                sample.fds_last, sample.rss_last_mb, sample.last_at = fds, rss, time.monotonic()

    def _final_sample(self, name: str, pid: int) -> None:
        """Just before a kill: the instance's last figures (under load: connections in flight count)."""
        self._sample(name, pid, final=True)

    @staticmethod
    def _pid(service: ServiceProcess) -> int:
        return service.proc.pid if service.proc is not None and service.proc.poll() is None else 0

    @staticmethod
    def _node_name(node: HomeNode) -> str:
        return node.name

    def _log(self, what: str, **fields: Any) -> None:
        self._events.write(json.dumps({"t": round(time.time(), 3), "what": what, **fields}, default=str) + "\n")
        self._events.flush()

    def close(self) -> None:
        self._events.close()


def _fds_and_rss(pid: int) -> tuple[int, float] | None:
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/status") as status:
            rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None
    return fds, rss_kb / 1024


def chaos_node_env(token_delay_s: float = 0.02) -> dict[str, str]:
    """The fake llama-server of a soak node: streams a token every `token_delay_s`, as many as asked for."""
    return {"FAKE_LLAMA_TOKEN_DELAY_S": str(token_delay_s), "FAKE_LLAMA_TOKENS": "100000"}
