"""The preparation walk's room count: how often `serve --dry-run`'s preparation enters each module.

Runs `prepare_launch(settings, dry_run=True)` under `sys.setprofile` and counts, per module
of meshnet_gguf, the calls whose caller stands in another module (an entry into that room).
A call within a module is not counted: only the walk from room to room. The caller is the
nearest frame of meshnet_gguf: a call that passes through the standard library (a dataclass
`replace` running `__init__`) belongs to the module that made it. A watched room is a module
or a package (`models.source` with its modules): its figure counts the calls from outside it.
The packaged catalog is parsed before counting (once per process, whichever walk comes first),
so both walks start alike. Two walks:

- a local GGUF file (a tiny generated model);
- a hub repo served by the project's loopback hub (`devtools.hf_server`), downloaded
  first with `meshnet-gguf download` (not counted), then planned from the files on disk as a dry run does.

The recorded llama-server (release b10434's --help) and the recorded cpu-only box make the
walk the same on any machine. Nothing is started but the loopback hub.

    PYTHONPATH=src:tests python bench/walk_rooms.py [--all]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from meshnet_gguf.common.settings import NodeSettings  # noqa: E402
from meshnet_gguf.devtools.hf_server import LocalHub, write_tiny_repo  # noqa: E402
from meshnet_gguf.models.catalog import load_catalog  # noqa: E402
from meshnet_gguf.models.tiny_model import write_tiny_model  # noqa: E402
from meshnet_gguf.prepare.pipeline import prepare_launch  # noqa: E402
from support.hardware_fixtures import FIXTURES, write_recorded_llama  # noqa: E402

PACKAGE = "meshnet_gguf."
REPO_ID = "acme/walk-GGUF"
# The tiny repo downloads in about a second; a minute means something hangs.
DOWNLOAD_TIMEOUT_S = 60
# The rooms the issue follows (a package counts with its modules); the rest are printed with --all.
WATCHED = ("models.source", "models.quants")


def _area(module: str) -> str:
    return module.split(".")[0]


def _in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def _caller(frame: FrameType) -> str:
    """The module of the nearest calling frame in meshnet_gguf (below it), else the first caller's."""
    back = frame.f_back
    first = back.f_globals.get("__name__", "") if back is not None else ""
    while back is not None and not back.f_globals.get("__name__", "").startswith(PACKAGE):
        back = back.f_back
    return back.f_globals["__name__"].removeprefix(PACKAGE) if back is not None else first


def count_entries(walk: Callable[[], Any]) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """While `walk` runs: module (below meshnet_gguf) -> calls into it from another module; the same
    counting only calls from another area (the pipeline's walk into `models/`); and watched room ->
    calls into it from outside it."""
    entries: Counter[str] = Counter()
    from_area: Counter[str] = Counter()
    rooms: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if not callee.startswith(PACKAGE):
            return
        module, caller = callee.removeprefix(PACKAGE), _caller(frame)
        if caller == module:
            return
        entries[module] += 1
        if _area(caller) != _area(module):
            from_area[module] += 1
        for room in WATCHED:
            if _in_room(module, room) and not _in_room(caller, room):
                rooms[room] += 1

    sys.setprofile(profile)
    try:
        walk()
    finally:
        sys.setprofile(None)
    return entries, from_area, rooms


def settings_for(gguf: str, work: Path, llama: Path) -> NodeSettings:
    return NodeSettings(
        gguf=gguf, llama_server=llama, hardware_fixture=FIXTURES / "cpu-only", download_dir=work / "models",
        state_dir=work / "state",
    )  # fmt: skip


def hub_walk(work: Path, llama: Path) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """Download the repo's Q8_0 through the loopback hub (not counted), then count the dry run's walk."""
    write_tiny_repo(work / "hub", REPO_ID, ["Q8_0", "Q4_K_M"], layout="root-file")
    with LocalHub(work / "hub") as hub:
        os.environ["HF_ENDPOINT"] = hub.endpoint
        os.environ["HF_HOME"] = str(work / "hf-home")
        settings = settings_for(f"{REPO_ID}:Q8_0", work, llama)
        download = [sys.executable, "-m", "meshnet_gguf", "download", settings.gguf or "", "--download-dir", str(settings.download_dir)]
        subprocess.run(download, check=True, capture_output=True, timeout=DOWNLOAD_TIMEOUT_S)
        return count_entries(lambda: prepare_launch(settings, dry_run=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="print every module entered, not only the watched ones")
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)
    load_catalog()  # parsed once per process (cached): not part of either walk
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        llama = write_recorded_llama(work)
        model = write_tiny_model(work / "tiny.gguf")
        walks = {
            "local file": count_entries(lambda: prepare_launch(settings_for(str(model), work, llama), dry_run=True)),
            f"hub repo {REPO_ID}:Q8_0 (on disk)": hub_walk(work, llama),
        }
    for name, (entries, from_area, rooms) in walks.items():
        print(f"{name}: {sum(entries.values())} entries into {len(entries)} modules (from another module / from another area)")
        watched = [m for m in entries if m.startswith(WATCHED)]
        shown = [m for m, _ in entries.most_common()] if args.all else sorted(watched)
        for module in shown:
            print(f"  {module:<28} {entries[module]:>5} {from_area[module]:>5}")
        for room in WATCHED:
            inside = [m for m in entries if _in_room(m, room)]
            print(f"  room {room:<23} {sum(entries[m] for m in inside):>5} {sum(from_area[m] for m in inside):>5}"
                  f"  {rooms[room]:>3} from outside the room")  # fmt: skip


if __name__ == "__main__":
    main()
