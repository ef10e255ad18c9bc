"""Every --help says defaults and variables the same way: `[default: X; env: MESHNET_X]`, once, no stray backslash."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from meshnet_gguf.cli import app

COMMANDS = [
    ["serve"], ["doctor"], ["models"], ["hardware"], ["usage"], ["download"], ["pull"], ["rm"], ["service", "install"],
    ["dev", "tracker"], ["dev", "relay"], ["dev", "mesh"],
]  # fmt: skip


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_help_shows_defaults_and_variables_plainly(argv: list[str]) -> None:
    done = CliRunner().invoke(app, [*argv, "--help"], terminal_width=200)
    assert done.exit_code == 0, done.output
    text = done.output
    assert "\\[" not in text  # an escape meant for rich, printed by plain help
    assert "[env var:" not in text  # click's own spelling, beside ours
    said = re.findall(r"env:\s+(MESHNET_[A-Z_]+)", text)
    assert len(said) == len(set(said)), sorted(said)


def test_usage_json_is_json_even_without_a_ledger(tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = CliRunner().invoke(app, ["usage", "--json", "--state-dir", str(tmp_path)])
    assert done.exit_code == 0
    document = json.loads(done.output)
    assert document["entries"] == [] and "no usage recorded" in document["note"]


@pytest.mark.parametrize("group", [[], ["dev"], ["service"]], ids=lambda g: " ".join(g) or "top")
def test_command_lists_show_whole_summaries_at_80_columns(group: list[str]) -> None:
    done = CliRunner().invoke(app, [*group, "--help"], terminal_width=80)
    assert done.exit_code == 0, done.output
    listed = done.output.split("Commands:", 1)[1].strip().splitlines()
    assert listed and all(line.rstrip().endswith(".") and "..." not in line for line in listed), listed


def test_arguments_are_named_in_capitals_not_braces() -> None:
    download = CliRunner().invoke(app, ["download", "--help"], terminal_width=200).output
    models = CliRunner().invoke(app, ["models", "--help"], terminal_width=200).output
    assert "download [OPTIONS] MODEL" in download and "{" not in download.splitlines()[0]
    assert "models [OPTIONS] [REPO]" in models
