"""Fixtures for tests that talk to a local HF-compatible hub over real HTTP on 127.0.0.1.

Import the fixtures into a test module: `from local_hub_fixtures import hub, hub_root, access  # noqa: F401`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnet_gguf.devtools.hf_server import LocalHub, write_tiny_repo
from meshnet_gguf.models.download import HubAccess

ROOT_FILE = "acme/root-file-GGUF"  # Tiny-Q4_K_M.gguf, Tiny-Q8_0.gguf
ROOT_SPLIT = "acme/root-split-GGUF"  # Tiny-Q8_0-0000k-of-00003.gguf, Tiny-Q4_K_M-0000k-of-00003.gguf
FOLDERS = "acme/folder-GGUF"  # UD-Q4_K_XL/Tiny-UD-Q4_K_XL-0000k-of-00003.gguf, IQ4_XS/...-of-00002.gguf
AMBIGUOUS = "acme/ambiguous-GGUF"  # Tiny-Q4_K_M.gguf and Q4_K_M/Tiny-Q4_K_M-0000k-of-00002.gguf
GATED = "acme/gated-GGUF"
NOT_GGUF = "acme/not-gguf-GGUF"  # Broken-Q4_K_M.gguf: random bytes with a valid sha256
GOOD_TOKEN = "hf_local_test_token"
# A catalog whose one model is FOLDERS's repo, with both its quants.
TINY_CATALOG = f"""
[[model]]
id = "tiny"
title = "Tiny"
repo = "{FOLDERS}"
context_length = 2048
  [[model.quant]]
  name = "UD-Q4_K_XL"
  files = "UD-Q4_K_XL/Tiny-UD-Q4_K_XL-*-of-00003.gguf"
  total_bytes = 400000
  shards = 3
  [[model.quant]]
  name = "IQ4_XS"
  files = "IQ4_XS/Tiny-IQ4_XS-*-of-00002.gguf"
  total_bytes = 400000
  shards = 2
"""


@pytest.fixture(scope="session")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    write_tiny_repo(root, ROOT_FILE, ["Q4_K_M", "Q8_0"], layout="root-file")
    write_tiny_repo(root, ROOT_SPLIT, ["Q8_0", "Q4_K_M"], layout="root-split", shards=3)
    write_tiny_repo(root, FOLDERS, ["UD-Q4_K_XL"], layout="folder-split", shards=3)
    write_tiny_repo(root, FOLDERS, ["IQ4_XS"], layout="folder-split", shards=2)
    write_tiny_repo(root, AMBIGUOUS, ["Q4_K_M"], layout="root-file")
    write_tiny_repo(root, AMBIGUOUS, ["Q4_K_M"], layout="folder-split", shards=2)
    write_tiny_repo(root, GATED, ["Q4_K_M"], layout="root-file")
    (root / NOT_GGUF).mkdir(parents=True)
    (root / NOT_GGUF / "Broken-Q4_K_M.gguf").write_bytes(bytes(range(256)) * 64)
    return root


@pytest.fixture
def hub(hub_root: Path) -> Iterator[LocalHub]:
    with LocalHub(hub_root, gated=[GATED], tokens=[GOOD_TOKEN]) as running:
        yield running


@pytest.fixture
def access(hub: LocalHub) -> HubAccess:
    return HubAccess(endpoint=hub.endpoint, token=None, offline=False)
