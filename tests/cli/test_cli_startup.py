"""`meshnet-gguf --help` starts fast: it imports none of the heavy libraries the commands use."""

from __future__ import annotations

import json
import subprocess
import sys

from meshnet_gguf.contract.protocol import DEFAULT_HEARTBEAT_INTERVAL_S
from meshnet_gguf.contract.relay_wire import RELAY_PING_INTERVAL_S
from meshnet_gguf.reference.relay.config import RELAY_STRANGER_BURST_S, RELAY_STRANGER_CONNECTIONS_PER_S

# Each costs tens of milliseconds to import; none is needed to print help.
HEAVY_MODULES = ("pydantic", "pydantic_settings", "anyio", "aiohttp", "httpx", "rich", "numpy", "gguf", "meshnet_gguf.common.settings")


def _modules_after(*argv: str) -> set[str]:
    code = (
        "import sys, json\n"
        f"sys.argv = ['meshnet-gguf', *{list(argv)!r}]\n"
        "from meshnet_gguf.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "sys.stderr.write(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


def test_help_imports_no_heavy_library() -> None:
    for argv in (["--help"], ["--version"], ["serve", "--help"]):
        heavy = set(HEAVY_MODULES)
        if argv[0] == "serve":
            # typer imports pydantic to parse a command's options, and a node command's help shows
            # each setting's default and MESHNET_* name, which live in the settings (config).
            heavy -= {"pydantic", "pydantic_settings", "meshnet_gguf.common.settings"}
        loaded = _modules_after(*argv)
        assert not loaded & heavy, (argv, sorted(loaded & heavy))


def test_dev_defaults_written_as_literals_are_the_protocol_ones() -> None:
    from typer.testing import CliRunner

    from meshnet_gguf.cli import app

    def help_text(*argv: str) -> str:
        return " ".join(CliRunner().invoke(app, [*argv, "--help"], terminal_width=200).output.split())

    assert f"node heartbeats [default: {DEFAULT_HEARTBEAT_INTERVAL_S}]" in help_text("dev", "tracker")
    relay_help = help_text("dev", "relay")
    assert f"(at most 20) [default: {RELAY_PING_INTERVAL_S};" in relay_help
    assert f"a burst of {RELAY_STRANGER_BURST_S:g} s of it" in relay_help
    assert f"[default: {RELAY_STRANGER_CONNECTIONS_PER_S:g}]" in relay_help
