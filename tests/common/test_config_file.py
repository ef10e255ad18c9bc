"""The config file checks itself: a mistake in it is one clear line and a non-zero exit, never a silence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshnet_gguf.cli import app
from meshnet_gguf.common.config_file import ConfigFileError
from meshnet_gguf.common.settings import CONFIG_FILE_ENV, NodeSettings

CLI_TIMEOUT_S = 60


@pytest.fixture(autouse=True)
def _no_settings_from_this_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in os.environ:
        if name.upper().startswith("MESHNET_"):
            monkeypatch.delenv(name)


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def _serve_dry_run(config: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MESHNET_")}
    return subprocess.run(
        [sys.executable, "-m", "meshnet_gguf", "serve", "--dry-run", "--gguf", "unused.gguf"], capture_output=True,
        text=True, timeout=CLI_TIMEOUT_S, env={**env, CONFIG_FILE_ENV: str(config)}, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("prot = 9000\n", "unknown key 'prot': did you mean port?"),
        ("ctx_sise = 4096\n", "unknown key 'ctx_sise': did you mean ctx_size?"),
        ("relay = 'http://127.0.0.1:8001'\n", "unknown key 'relay': that is the flag --relay; in the file its key is relay_url"),
        ("[model]\ngguf = 'x.gguf'\n", "unknown table [model]: the settings are top-level keys, with no [table] above them"),
        ("ctx-size = 1\nctx_size = 2\n", "ctx_size is set twice (as 'ctx-size' and 'ctx_size'); keep one"),
    ],
)
def test_a_key_the_node_does_not_know_is_an_error_naming_the_nearest(tmp_path: Path, text: str, said: str) -> None:
    config = _config(tmp_path, text)
    done = _serve_dry_run(config)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {config}: {said}"


def test_a_syntax_error_is_one_line_with_file_line_and_column(tmp_path: Path) -> None:
    config = _config(tmp_path, "port = 9000\nhost = \n")
    done = _serve_dry_run(config)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {config}:2:8: TOML syntax error: Invalid value"


def test_a_config_file_that_is_not_there_is_an_error(tmp_path: Path) -> None:
    done = _serve_dry_run(tmp_path / "nodee.toml")
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {CONFIG_FILE_ENV} names {tmp_path / 'nodee.toml'}, which does not exist"


def test_the_dashed_flag_spelling_and_the_key_both_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONFIG_FILE_ENV, str(_config(tmp_path, "ctx-size = 4096\nmax_tokens_cap = 100\nallowed-hosts = ['node.lan']\n")))
    settings = NodeSettings()
    assert (settings.ctx_size, settings.max_tokens_cap, settings.allowed_hosts) == (4096, 100, ["node.lan"])


def test_a_bad_file_is_left_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = "prot = 9000  # the operator's own comment\n"
    config = _config(tmp_path, text)
    monkeypatch.setenv(CONFIG_FILE_ENV, str(config))
    with pytest.raises(ConfigFileError):
        NodeSettings()
    assert config.read_text() == text


def test_doctor_says_where_each_setting_came_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path, "ctx-size = 4096\nport = 9001\napi_key = 'the-operators-secret'\n")
    monkeypatch.setenv(CONFIG_FILE_ENV, str(config))
    monkeypatch.setenv("MESHNET_HOST", "127.0.0.2")
    args = ["doctor", "--port", "9002", "--llama-server", str(tmp_path / "no-such-llama-server"), "--download-dir", str(tmp_path)]
    text = CliRunner().invoke(app, args).stdout
    assert "  port = 9002  (flag --port)" in text  # the flag wins over the file's 9001
    assert "  host = '127.0.0.2'  (environment MESHNET_HOST)" in text
    assert f"  ctx_size = 4096  (file {config})" in text
    assert "the-operators-secret" not in text and f"  api_key = (set, not shown)  (file {config})" in text
    assert "others at their default" in text
    listed = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)["settings"]
    assert listed["parallel"] == {"value": "4", "from": "default", "where": ""}
    assert listed["port"]["from"] == "flag" and listed["ctx_size"]["from"] == "file"
    assert set(listed) == set(NodeSettings.model_fields)


def test_allowed_hosts_come_comma_separated_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHNET_ALLOWED_HOSTS", "node.lan, Proxy.Example.net.")
    assert NodeSettings().allowed_hosts == ["node.lan", "proxy.example.net"]
