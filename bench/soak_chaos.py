#!/usr/bin/env python3
"""A chaos soak of the relayed mesh on real links: run by hand, for 30 minutes or more.

    nice .venv/bin/python bench/soak_chaos.py --minutes 30

Needs root, `ip`, `iptables`, `conntrack` and /dev/net/tun (as tests/e2e/test_home_nat.py). Builds a home
network in namespaces (tests/support/home_network.py: a router doing MASQUERADE with strict conntrack, user-
space netem wires on the node's and the client's links), starts `dev tracker` and `dev relay` beyond the
router and two `serve --relay` nodes behind it (the fake llama-server, a token every 20 ms), and while two
clients stream without pause, kills by PID and restarts a random component every few seconds, flushes the
router's mappings and changes the links (tests/support/chaos.py). At the end: every completed request billed
once, none twice, every failed stream ended with an error event (unless the tracker itself was dead), node and
tracker ledgers agree row for row, no process grew past the stated descriptor and memory bounds. Prints the
report; exits 1 when it found a problem. Everything it made (namespaces, links, processes) goes at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from support.chaos import FD_GROWTH_BOUND, RSS_GROWTH_BOUND_MB, Chaos, ChaosConfig, chaos_node_env
from support.home_mesh import MeshOptions, print_logs, start_home_mesh
from support.home_network import HomeNetwork

from meshnet_gguf.models.tiny_model import write_tiny_model

FAKE_LLAMA = HERE.parent / "tests" / "support" / "fake_llama_server.py"
NODES = 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=43)
    parser.add_argument("--action-every", type=float, nargs=2, default=(3.0, 6.0), metavar=("MIN_S", "MAX_S"))
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and the event log here (default: a temp dir, removed)")
    args = parser.parse_args()
    why = HomeNetwork.missing()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="soak-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    gguf = write_tiny_model(workdir / "tiny.gguf")
    fake = workdir / "llama-server"
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_LLAMA}" "$@"\n')
    fake.chmod(0o755)
    config = ChaosConfig(duration_s=args.minutes * 60, action_every_s=tuple(args.action_every), clients=args.clients, seed=args.seed)
    mesh_gen = start_home_mesh(workdir, gguf.stem, MeshOptions(nat_idle_timeout_s=30))
    mesh = next(mesh_gen)
    report = None
    try:
        for _ in range(NODES):
            mesh.add_node(gguf, fake, chaos_node_env())
        for node in mesh.nodes:
            node.wait_ready()
        mesh.wait_routable(NODES)
        chaos = Chaos(mesh, config, workdir / "chaos-events.jsonl")
        try:
            report = chaos.run()
        finally:
            chaos.close()
    finally:
        if report is None or report.problems:
            print_logs(mesh)
        for _ in mesh_gen:
            pass
    (workdir / "chaos-report.json").write_text(json.dumps(report.__dict__, indent=1, default=str))
    print(report.summary())
    print(f"bounds: descriptors +{FD_GROWTH_BOUND}, memory +{RSS_GROWTH_BOUND_MB:.0f} MB over a process's life")
    for s in report.samples:
        if s["last_at"]:
            life = s["last_at"] - s["first_at"]
            print(f"  {s['name']:8} pid {s['pid']:>7}: {life:7.0f} s, fds {s['fds_first']} -> {s['fds_last']}, "
                  f"RSS {s['rss_first_mb']:.0f} -> {s['rss_last_mb']:.0f} MB")  # fmt: skip
    if args.workdir is None and not report.problems:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs and events: {workdir}")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
