"""The nodes a trusted tracker has admitted at this relay, remembered past a blip and a restart.

A tunnel is provisional until a trusted tracker's CONNECT names its node (protocol 9.2).
Forgetting that admission the moment the tunnel drops would put an honest node whose
connection blipped back among the provisional, where a flood of strangers' fresh keys can
keep it out. So a node stays admitted while its tunnel is up and for `remember_s` after it
drops, and the set survives a restart in a small JSON file in the relay's state dir,
written atomically (never half a file) and at most once per `SAVE_INTERVAL_S`.

Being remembered gives a node one thing: its next tunnel skips the provisional pool. The
tracker still decides whether to route to it, so a node it has since removed gains nothing.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from meshnet_gguf.common.atomic_file import write_atomically
from meshnet_gguf.common.private_files import PRIVATE_FILE_MODE, private_dir

log = logging.getLogger(__name__)

STATE_FILE_NAME = "relay-admitted.json"
STATE_FILE_VERSION = 1
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
        self.dirty = False

    def holds(self, node_id: str) -> bool:
        return node_id in self._attached or self._until.get(node_id, 0.0) > time.time()

    def admitted(self, node_id: str) -> None:
        """A trusted tracker reached `node_id`, whose tunnel is up."""
        if node_id not in self._attached:
            self._attached.add(node_id)
            self._until.pop(node_id, None)
            self.dirty = True

    def dropped(self, node_id: str) -> None:
        """`node_id`'s admitted tunnel ended: it stays admitted for `remember_s`."""
        if node_id in self._attached:
            self._attached.discard(node_id)
            self._until[node_id] = time.time() + self.remember_s
            self.dirty = True
            self._bound()

    def _bound(self) -> None:
        now = time.time()
        self._until = {n: t for n, t in self._until.items() if t > now}
        if len(self._until) > self.max_nodes:
            kept = sorted(self._until.items(), key=lambda item: item[1])[-self.max_nodes :]
            self._until = dict(kept)

    # --- the state file ---------------------------------------------------------------------------------------
    def load(self) -> None:
        """Reads the state file, if any; a missing or unreadable one is an empty memory (said in the log)."""
        if self.state_file is None or not self.state_file.exists():
            return
        try:
            data = json.loads(self.state_file.read_text())
            entries = data["admitted"] if data.get("version") == STATE_FILE_VERSION else {}
            until = {str(node): float(t) for node, t in entries.items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("%s is unreadable (%s): no node is remembered as admitted", self.state_file, exc)
            return
        now = time.time()
        # A time further ahead than the memory itself was not written by this code: a node is never remembered longer.
        self._until = {n: min(t, now + self.remember_s) for n, t in until.items() if t > now}
        self._bound()
        log.info("%d node(s) remembered as admitted from %s", len(self._until), self.state_file)

    def save(self) -> None:
        """Writes the memory now; an attached node is written as remembered `remember_s` from now (it may drop unseen)."""
        self.dirty = False
        if self.state_file is None:
            return
        now = time.time()
        entries = {**{n: t for n, t in self._until.items() if t > now}, **{n: now + self.remember_s for n in self._attached}}
        try:
            private_dir(self.state_file.parent)
            write_atomically(self.state_file, json.dumps({"version": STATE_FILE_VERSION, "admitted": entries}), mode=STATE_FILE_MODE)
        except OSError as exc:
            log.warning("cannot write %s (%s): admissions are kept in memory only", self.state_file, exc)


__all__ = ["ADMITTED_REMEMBERED_S", "AdmittedNodes", "SAVE_INTERVAL_S", "STATE_FILE_NAME"]
