"""docs/meshnet-gguf.example.toml names every setting, and what it shows is what the node reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshnet_gguf.common.settings import CONFIG_FILE_ENV, NodeSettings

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "meshnet-gguf.example.toml"
_KEY_LINE = re.compile(r"^# ([a-z_]+) = (.*)$")


def _commented_settings() -> list[str]:
    return [line.removeprefix("# ") for line in EXAMPLE.read_text().splitlines() if _KEY_LINE.match(line)]


def test_every_setting_is_in_the_example_once() -> None:
    keys = [line.split(" = ", 1)[0] for line in _commented_settings()]
    assert sorted(keys) == sorted(NodeSettings.model_fields)


def test_the_example_uncommented_is_a_config_the_node_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "node.toml"
    config.write_text("\n".join(_commented_settings()) + "\n")
    monkeypatch.setenv(CONFIG_FILE_ENV, str(config))
    for name in NodeSettings.model_fields:  # nothing from this test's own environment
        monkeypatch.delenv(f"MESHNET_{name.upper()}", raising=False)
    settings = NodeSettings()
    assert settings.port == 8080 and settings.tracker == "https://tracker.example.net"
    assert settings.parallel == NodeSettings.model_fields["parallel"].default
