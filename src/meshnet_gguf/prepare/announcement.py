"""What a meshed node tells its tracker about the model it serves, read from the files and the machine:
the layer count, every shard of a split model, each shard's sha256 and a hardware summary.

The tracker link announces these facts and never reads a GGUF or probes a GPU itself: the
composition root computes them here and hands them in.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshnet_gguf.common.atomic_file import write_atomically
from meshnet_gguf.contract.protocol import HardwareSummary, ShardDigest
from meshnet_gguf.hardware.report import HardwareReport
from meshnet_gguf.models.download import sha256_of
from meshnet_gguf.models.gguf_info import read_gguf_info
from meshnet_gguf.models.gguf_names import sibling_shards

log = logging.getLogger(__name__)

# sha256 of each shard, remembered by size and mtime so a restart does not re-hash 100 GB.
SHARD_DIGESTS_FILE = "shard_digests.json"


class ModelFactsError(ValueError):
    """The model's files cannot say what the tracker must hear; the message says which and why."""


@dataclass(frozen=True)
class ModelLayout:
    """The layer count the node covers (all of it) and every shard, first shard first."""

    total_layers: int
    shards: tuple[Path, ...]


def model_layout(shards: Sequence[Path]) -> ModelLayout:
    """Read the first shard's header; given only shard 1 of a split (what llama-server loads),
    the others are the files beside it named by the split."""
    first = Path(shards[0])
    info = read_gguf_info(first)
    if not info.block_count:
        raise ModelFactsError(f"{first.name}: no block_count in the GGUF metadata; cannot state layer coverage")
    if len(shards) == 1 and info.split_count > 1:
        shards = sibling_shards(first, info.split_count)
    return ModelLayout(total_layers=info.block_count, shards=tuple(Path(s) for s in shards))


def shard_digests(shards: Sequence[Path], known: Sequence[str | None], state_dir: Path) -> list[ShardDigest]:
    """Each shard's sha256 (from `known`, a verified download, the cache, or hashed now), cached in the state dir."""
    cache_path = Path(state_dir) / SHARD_DIGESTS_FILE
    try:
        cache: dict[str, dict[str, object]] = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    given = list(known) + [None] * (len(shards) - len(known))
    digests = []
    for path, sha in zip(shards, given):
        st = path.stat()
        key = str(path.resolve())
        entry = cache.get(key)
        if sha is None and entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
            sha = str(entry["sha256"])
        if sha is None:
            log.info("hashing %s (%d MiB) for the tracker announcement", path.name, st.st_size >> 20)
            sha = sha256_of(path).hexdigest()
        cache[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
        digests.append(ShardDigest(name=path.name, sha256=sha, size=st.st_size))
    write_atomically(cache_path, json.dumps(cache, indent=1))
    return digests


def hardware_summary(report: HardwareReport) -> HardwareSummary:
    gpu = report.primary_gpu()
    devices = gpu.llama_devices if gpu else ()
    return HardwareSummary(
        summary=report.summary(),
        # What llama-server will actually drive, not what the box has.
        backend=devices[0].backend if devices else "cpu",
        memory_bytes=report.ram_total_bytes,
        gpu_memory_bytes=gpu.budget_bytes if gpu else None,
    )


__all__ = ["SHARD_DIGESTS_FILE", "ModelFactsError", "ModelLayout", "hardware_summary", "model_layout", "shard_digests"]
