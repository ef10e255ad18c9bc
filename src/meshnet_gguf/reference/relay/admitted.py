"""The nodes a trusted tracker has admitted at this relay, remembered past a blip and a restart.

A tunnel is provisional until a trusted tracker's CONNECT names its node (protocol 9.2).
Forgetting that admission the moment the tunnel drops would put an honest node whose
connection blipped back among the provisional, where a flood of strangers' fresh keys can
keep it out. So a node stays admitted while its tunnel is up and for `remember_s` after it
drops, and the set survives a restart in a small JSON file in the relay's state dir,
written atomically (never half a file) and at most once per `SAVE_INTERVAL_S`.

Being remembered gives a node two things: its next tunnel skips the provisional pool, and the
network its tunnel came from is spared the relay-wide budget of strangers' connections (so a
flood from thousands of other networks cannot keep it from re-attaching). The tracker still
decides whether to route to it, so a node it has since removed gains nothing.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path

from meshnet_gguf.common.atomic_file import write_atomically
from meshnet_gguf.common.private_files import PRIVATE_FILE_MODE, private_dir

log = logging.getLogger(__name__)

STATE_FILE_NAME = "relay-admitted.json"
STATE_FILE_VERSION = 2  # 2: each node's network too; a version 1 file is still read (its nodes' networks unknown)
# Only the relay reads it (0600 in a 0700 dir): which nodes a tracker admitted is metadata about who uses this relay.
STATE_FILE_MODE = PRIVATE_FILE_MODE
# Long enough for a home router's reboot, a laptop's suspend or a relay's upgrade; short enough that a node
# gone for good stops counting against the bound below within the hour.
ADMITTED_REMEMBERED_S = 30 * 60.0
# Remembered nodes beyond those attached: past this, the ones whose memory ends soonest are forgotten first.
MAX_REMEMBERED_NODES = 20_000
# Writes are batched: a fleet re-attaching after a restart costs one write a second, not one per node.
SAVE_INTERVAL_S = 1.0


class AdmittedNodes:
    """Node ids admitted by a trusted tracker: attached now, or until a wall-clock time after their tunnel dropped."""

    def __init__(self, state_file: Path | None, remember_s: float = ADMITTED_REMEMBERED_S,
                 max_nodes: int = MAX_REMEMBERED_NODES) -> None:  # fmt: skip
        self.state_file, self.remember_s, self.max_nodes = state_file, remember_s, max_nodes
        self._attached: set[str] = set()
        self._until: dict[str, float] = {}  # dropped nodes: node id -> time.time() their admission ends
        self._network_of: dict[str, str] = {}  # node id -> the source network of its last admitted tunnel
        self._networks: Counter[str] = Counter()  # network -> nodes held (attached or remembered) that came from it
        self.dirty = False

    def holds(self, node_id: str) -> bool:
        return node_id in self._attached or self._until.get(node_id, 0.0) > time.time()

    def hosts_admitted(self, network: str) -> bool:
        """Whether an admitted node (attached, or remembered) last attached from `network`."""
        return self._networks.get(network, 0) > 0

    def admitted(self, node_id: str, network: str) -> None:
        """A trusted tracker reached `node_id`, whose tunnel is up and came from `network`."""
        if node_id not in self._attached or self._network_of.get(node_id) != network:
            self._attached.add(node_id)
            self._until.pop(node_id, None)
            self._set_network(node_id, network)
            self.dirty = True

    def _set_network(self, node_id: str, network: str | None) -> None:
        previous = self._network_of.pop(node_id, None)
        if previous is not None:
            self._networks[previous] -= 1
            if self._networks[previous] <= 0:
                del self._networks[previous]
        if network is not None:
            self._network_of[node_id] = network
            self._networks[network] += 1

    def dropped(self, node_id: str) -> None:
        """`node_id`'s admitted tunnel ended: it stays admitted for `remember_s`."""
        if node_id in self._attached:
            self._attached.discard(node_id)
            self._until[node_id] = time.time() + self.remember_s
            self.dirty = True
            self._bound()

    def expire(self) -> None:
        """Forgets the dropped nodes whose memory has ended (and their networks)."""
        self._bound()

    def _bound(self) -> None:
        now = time.time()
        kept = {n: t for n, t in self._until.items() if t > now}
        if len(kept) > self.max_nodes:
            kept = dict(sorted(kept.items(), key=lambda item: item[1])[-self.max_nodes :])
        for node_id in [n for n in self._until if n not in kept]:
            self._set_network(node_id, None)
        self._until = kept

    # --- the state file ---------------------------------------------------------------------------------------
    def load(self) -> None:
        """Reads the state file, if any; a missing or unreadable one is an empty memory (said in the log)."""
        if self.state_file is None or not self.state_file.exists():
            return
        try:
            data = json.loads(self.state_file.read_text())
            version = data.get("version")
            entries = data["admitted"] if version in (1, STATE_FILE_VERSION) else {}
            until = {str(node): float(t) for node, t in entries.items()}
            networks = {str(node): str(net) for node, net in data.get("networks", {}).items()} if version == STATE_FILE_VERSION else {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("%s is unreadable (%s): no node is remembered as admitted", self.state_file, exc)
            return
        now = time.time()
        # A time further ahead than the memory itself was not written by this code: a node is never remembered longer.
        self._until = {n: min(t, now + self.remember_s) for n, t in until.items() if t > now}
        for node_id in self._until:
            self._set_network(node_id, networks.get(node_id))
        self._bound()
        log.info("%d node(s) remembered as admitted from %s", len(self._until), self.state_file)

    def save(self) -> None:
        """Writes the memory now; an attached node is written as remembered `remember_s` from now (it may drop unseen)."""
        self.dirty = False
        if self.state_file is None:
            return
        now = time.time()
        entries = {**{n: t for n, t in self._until.items() if t > now}, **{n: now + self.remember_s for n in self._attached}}
        networks = {n: self._network_of[n] for n in entries if n in self._network_of}
        try:
            private_dir(self.state_file.parent)
            state = {"version": STATE_FILE_VERSION, "admitted": entries, "networks": networks}
            write_atomically(self.state_file, json.dumps(state), mode=STATE_FILE_MODE)
        except OSError as exc:
            log.warning("cannot write %s (%s): admissions are kept in memory only", self.state_file, exc)


__all__ = ["ADMITTED_REMEMBERED_S", "AdmittedNodes", "SAVE_INTERVAL_S", "STATE_FILE_NAME"]
